"""What workers and clients tell the scheduler, each message to its handler: workers'
heartbeats and cache events (the live pool), a prefill's handoff and its transfer's
completions, a decode's progress to the request's end and each chunk it sends; a client's cancel, its status poll,
and its ask for a request's final again. A message about a flight from a worker that is
not that flight's is refused (``wrong_party``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from kvpush.services.bus import Bus
from kvpush.services.ledger import Ledger
from kvpush.services.lifecycle import BackgroundTasks
from kvpush.services.scheduler import dispatch
from kvpush.services.scheduler.attempts import Attempts
from kvpush.services.scheduler.control import FlightControl
from kvpush.services.scheduler.flights import Flight, FlightTable, Operation
from kvpush.services.scheduler.intake import EarlyCancels
from kvpush.services.scheduler.journal import Journal
from kvpush.services.scheduler.migrations import Migrations
from kvpush.services.scheduler.outbox import Outbox
from kvpush.services.scheduler.retargets import Retargets
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.shared import wire
from kvpush.shared.errors import Cancelled, EngineFailed, InFlight, KvpushError, NotFound, to_error_body

log = structlog.get_logger("kvpush.scheduler")


@dataclass
class Events:
    bus: Bus
    ledger: Ledger
    pool: WorkerPool
    flights: FlightTable
    early_cancels: EarlyCancels
    journal: Journal
    outbox: Outbox
    attempts: Attempts
    control: FlightControl
    retargets: Retargets
    migrations: Migrations
    tasks: BackgroundTasks
    scheduler_id: str

    # ------------------------------------------------ workers

    async def on_heartbeat(self, msg) -> None:
        beat = await self.bus.decoded(msg, wire.WorkerHeartbeat)
        if beat is not None:
            self.pool.observe(beat, time.monotonic())

    async def on_cache_events(self, msg) -> None:
        events = await self.bus.decoded(msg, wire.CacheEvents)
        if events is not None:
            self.pool.cache_events(events)

    async def on_handoff(self, msg) -> None:
        handoff = await self.bus.decoded(msg, wire.Handoff)
        if handoff is None:
            return
        flight = self.flights.by_transfer(handoff.transfer_id)
        if flight is None:
            return  # another scheduler's, or an attempt we already replaced
        if handoff.prefill_engine_id != flight.prefill_id:
            await self.bus.wrong_party(msg, f"a Handoff from {handoff.prefill_engine_id} for {handoff.transfer_id}, "
                                            f"whose prefill is {flight.prefill_id or 'not chosen'}")
            return
        if not self.attempts.handoff_arrived(handoff):  # push: decode generates already
            if handoff.error is not None:
                await self.control.end(flight, EngineFailed(handoff.error.message))  # decode would wait in vain
            elif (ready := dispatch.prompt_ready(flight, handoff)) is not None:
                await self.outbox.prompt_ready(flight, ready)
        log.debug("prefill finished", request_id=handoff.request_id, transfer_id=handoff.transfer_id,
                  prefill_ms=round((handoff.prefill_finished_at - handoff.prefill_started_at) * 1000, 1))

    async def on_completion(self, msg) -> None:
        event = await self.bus.decoded(msg, wire.Completion)
        if isinstance(event, wire.TransferFailed):
            # Decode hears it too and recomputes or fails the request, per its policy.
            log.warning("kv transfer failed", transfer_id=event.transfer_id, code=event.code, reason=event.reason)
            return
        if event is None:
            return
        flight = self.flights.by_transfer(event.transfer_id)
        if flight is not None and event.prefill_engine_id != flight.prefill_id:
            await self.bus.wrong_party(msg, f"a {type(event).__name__} from {event.prefill_engine_id} for "
                                            f"{event.transfer_id}, whose prefill is {flight.prefill_id}")
            return
        if isinstance(event, wire.TransferDone):
            if flight is not None:
                flight.kv_written()
            log.debug("kv pushed", transfer_id=event.transfer_id, order=event.order,
                      bytes=event.bytes, descriptors=event.descriptors, write_ms=round(event.write_ms, 2))
            return
        self.retargets.answer_arrived(event)  # a TransferMoved

    async def _from_its_decode(self, msg, kind, what: str):
        """(the message as ``kind``, its flight), when it is about a flight of ours and
        comes from that flight's decode; else (None, None), a wrong party refused."""
        event = await self.bus.decoded(msg, kind)
        flight = self.flights.by_transfer(event.transfer_id) if event is not None else None
        if flight is None:
            return None, None  # another scheduler's, or an attempt we already replaced
        if event.worker_id != flight.decode_id:
            await self.bus.wrong_party(msg, f"{what} from {event.worker_id} for {event.transfer_id}, "
                                            f"whose decode is {flight.decode_id or 'not chosen'}")
            return None, None
        return event, flight

    async def on_progress(self, msg) -> None:
        event, flight = await self._from_its_decode(msg, wire.RequestProgress, "progress")
        if flight is None:
            return
        if event.stage == "streaming":
            flight.streaming_started(time.monotonic())
            return
        if flight.operation is Operation.MIGRATE:  # its decode was told to stop: it says when it did
            self.migrations.fenced(event)
            if event.outcome in ("cancelled", wire.UNCLAIMED):
                return  # stopped without a word to the client: the migration goes on
        if event.outcome == wire.UNCLAIMED:  # it sent nothing, and never will: another attempt
            self.tasks.spawn(self.control.retry(flight, flight.decode_id, decode_gave_up=True))
            return
        if not self.flights.remove(flight):
            return
        # Every decode's progress comes through this one subscription: writing the end down
        # waits on JetStream, and must not hold up the next request's progress behind it.
        self.tasks.spawn(self._ended(flight, event))

    async def on_tokens(self, msg) -> None:
        """A decode is about to send a chunk: what the client has, should the stream move."""
        sent, flight = await self._from_its_decode(msg, wire.TokensSent, "tokens")
        if flight is not None:
            flight.tokens_sent(sent.seq, sent.index, sent.token_ids, time.time(), time.monotonic())

    async def _ended(self, flight: Flight, event: wire.RequestProgress) -> None:
        if event.final:
            await self.ledger.keep_final(flight.owner, flight.request_id, event.final, flight.reply_to)
        await self.ledger.forget(flight.owner, flight.request_id, flight.revision)
        if event.outcome == "client_gone":
            await self.outbox.cancel_jobs(flight, "the client went away")  # prefill may still hold work for it

    # ------------------------------------------------ clients

    async def on_cancel(self, msg) -> None:
        cancel = await self.bus.decoded(msg, wire.CancelRequest, wire.decode_json)
        owner = wire.owner_of(msg.subject)
        flight = self.flights.by_request(owner, cancel.request_id) if cancel is not None else None
        if flight is not None:
            await self.control.end(flight, Cancelled(f"request {cancel.request_id} was cancelled by the client"))
        elif cancel is not None:  # another scheduler's, already ended, or not here yet: keep it for a while
            self.early_cancels.remember(owner, cancel.request_id, time.monotonic())

    async def on_status(self, msg) -> None:
        now = time.monotonic()
        prefill, decode = self.pool.live("prefill", now), self.pool.live("decode", now)
        status = wire.SchedulerStatus(
            scheduler_id=self.scheduler_id,
            prefill_workers=[b.worker_id for b in prefill],
            decode_workers=[b.worker_id for b in decode],
            max_model_len=min((b.max_model_len for b in (*prefill, *decode)), default=0),
        )
        # Only to the asker's own inbox: never make a scheduler publish into another's.
        if msg.reply and wire.reply_problem(msg.reply, wire.owner_of(msg.subject)) is None:
            await self.bus.nc.publish(msg.reply, wire.encode_json(status))

    async def on_final_request(self, msg) -> None:
        """``kvpush.final``: the request's last message again, to the client that sent it."""
        owner = wire.owner_of(msg.subject)
        if not msg.reply or wire.reply_problem(msg.reply, owner) is not None:
            return
        asked = await self.bus.decoded(msg, wire.FinalRequest, wire.decode_json)
        if asked is None:
            return
        try:
            stored = await self.ledger.final(owner, asked.request_id)
            if stored is not None and stored.owner == owner:
                await self.bus.nc.publish(msg.reply, stored.body)
                return
            flying = (self.flights.by_request(owner, asked.request_id)
                      or await self.journal.held_record(owner, asked.request_id))
        except Exception as exc:  # JetStream cannot say: the client asks again on its next silence
            log.warning("could not look up a final", request_id=asked.request_id, error=f"{type(exc).__name__}: {exc}")
            return
        # Another client's request is another key: its ids are not this one's to probe.
        if flying is not None and flying.owner == owner:
            answer: KvpushError = InFlight(f"request {asked.request_id!r} is in flight: its last message is not "
                                           "there yet")
        else:
            answer = NotFound(f"no request {asked.request_id!r} is in flight or kept: it never reached a "
                              f"scheduler, or it ended over {wire.FINALS_KEEP_S:g} s ago")
        await self.bus.nc.publish(msg.reply, wire.encode_json(wire.ErrorReply(asked.request_id, to_error_body(answer))))
