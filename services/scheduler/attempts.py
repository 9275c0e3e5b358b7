"""One attempt at a flight: where it is served (``placement``), which workers serve it,
and its jobs out to them, each attempt with a fresh transfer id. Push: prefill and decode
at the same time. Pull: prefill first, then decode, chosen by the load at that moment.
Local: the decode computes the prompt itself.

``Attempts.dispatch`` raises what stopped the attempt; what to do then (retry, end) is
``kvpush.services.scheduler.control``'s business."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvpush.otel import attributes as A
from kvpush.services.scheduler import dispatch
from kvpush.services.scheduler.flights import Flight, FlightTable, new_transfer_key
from kvpush.services.scheduler.journal import Journal
from kvpush.services.scheduler.outbox import Outbox
from kvpush.services.scheduler import prefix_sources
from kvpush.services.scheduler.placement import Placement, PlacementSettings, place
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.services.scheduler.timing import WATCH_INTERVAL_S, Uptime
from kvpush.shared import connector_kinds, settings, wire
from kvpush.shared.errors import EngineFailed, NoWorkers

log = structlog.get_logger("kvpush.scheduler")
_tracer = trace.get_tracer("kvpush.scheduler")
LEND_TIMEOUT_S = 2.0  # a holder that does not answer a lend in this long: the prefill computes the prefix


class Attempts:
    def __init__(self, pool: WorkerPool, flights: FlightTable, journal: Journal, outbox: Outbox,
                 placement: PlacementSettings, uptime: Uptime, kv_checksums: str = settings.KV_CHECKSUMS,
                 fetch: prefix_sources.FetchSettings | None = None):
        self.pool = pool
        self.fetch = fetch or prefix_sources.FetchSettings()
        self.kv_checksums = kv_checksums  # which transfers get an end-to-end checksum
        self.flights = flights
        self.journal = journal
        self.outbox = outbox
        self.placement = placement
        self.uptime = uptime
        self._handoffs: dict[str, asyncio.Future] = {}  # pull: transfer id -> its prefill's handoff

    def handoff_arrived(self, handoff: wire.Handoff) -> bool:
        """Pull: hand the attempt waiting for it its prefill's handoff; False if none waits."""
        waiting = self._handoffs.get(handoff.transfer_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(handoff)  # pull: now pick decode
            return True
        return False

    def stop_waiting(self, transfer_id: str) -> None:
        """The attempt under ``transfer_id`` is stopped: no handoff is waited for any more."""
        waiting = self._handoffs.pop(transfer_id, None)
        if waiting is not None and not waiting.done():
            waiting.cancel()

    async def _pick(self, flight: Flight, pick):
        """``pick()`` now. With no live worker: fail at once if this deployment never had
        one (as far as a whole heartbeat round since our start can tell: a scheduler that
        just joined has heard nobody yet); otherwise they are down (crashed, restarting),
        and the request waits for one until its deadline."""
        while True:
            try:
                return pick()
            except NoWorkers:
                heard_a_round = self.uptime.heard_a_round(time.monotonic())
                if flight.attempt <= 1 and not self.pool.has_served() and heard_a_round:
                    raise
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def dispatch(self, flight: Flight) -> None:
        """A new attempt at the flight, its jobs out and taken."""
        flight.key_prompt()  # its block keys, for prefix-aware picks
        placement = self._place(flight)
        flight.place(placement.mode, placement.chosen_by, placement.reason)
        self.flights.bind(flight, uuid.uuid4().hex)
        span = trace.get_current_span()
        span.set_attributes({A.TRANSFER_MODE: flight.mode, A.PLACEMENT_REASON: placement.reason,
                             **{f"{A.PLACEMENT_PREFIX}{k}": v for k, v in placement.numbers.items()}})
        if flight.mode == "pull":
            await self._dispatch_pull(flight)
        elif flight.mode == "local":
            await self._dispatch_local(flight)
        else:
            await self._dispatch_push(flight)
        flight.jobs_taken()
        log.info("dispatched", transfer_id=flight.transfer_id, prefill=flight.prefill_id, decode=flight.decode_id,
                 prompt_tokens=len(flight.attempt_prompt), mode=flight.mode, attempt=flight.attempt)

    def _place(self, flight: Flight) -> Placement:
        now = time.monotonic()
        prompt_tokens = len(flight.attempt_prompt)
        return place(prompt_tokens, flight.request.transfer_mode, self.placement,
                     connector_kinds.of(self.pool.connector(now)).modes,
                     self.pool.prefill_load(now, flight.prompt), self.pool.decode_load(prompt_tokens, now, flight.prompt))

    async def _dispatch_local(self, flight: Flight) -> None:
        """The decode computes the prompt itself: no prefill, no transfer."""
        decode = await self._pick(
            flight, lambda: self.pool.pick_decode(len(flight.attempt_prompt), time.monotonic(),
                                                  prompt=flight.prompt))
        flight.assign_decode(decode)
        trace.get_current_span().set_attributes({A.TRANSFER_ID: flight.transfer_id, A.DECODE_WORKER: decode.worker_id})
        await self._prefix_source(flight, decode, can_fetch=False)  # a decode computing a prompt does not fetch (yet)
        await self.journal.write_down(flight)
        await self.outbox.send(decode.worker_id, dispatch.decode_job(flight, None))

    async def _dispatch_push(self, flight: Flight) -> None:
        prefill, decode = await self._pick(
            flight, lambda: self.pool.pick(len(flight.attempt_prompt), time.monotonic(), prompt=flight.prompt))
        flight.assign_prefill(prefill)
        flight.assign_decode(decode)
        trace.get_current_span().set_attributes(
            {A.TRANSFER_ID: flight.transfer_id, A.PREFILL_WORKER: prefill.worker_id, A.DECODE_WORKER: decode.worker_id}
        )
        fetch = await self._prefix_source(flight, prefill)
        await self.journal.write_down(flight)
        beat = self.pool.beat(prefill.worker_id)  # as it is now, after the write
        # Both at once: decode registers its blocks while prefill computes.
        await asyncio.gather(
            self.outbox.send(prefill.worker_id, dispatch.prefill_job(flight, self.kv_checksums, fetch)),
            self.outbox.send(decode.worker_id, dispatch.decode_job(flight, beat.kv_params if beat else None)),
        )

    async def _dispatch_pull(self, flight: Flight) -> None:
        """Pull, the way vLLM's default connector is driven: prefill first; decode is chosen
        from the load at the moment prefill finished, and reads the prefill's blocks."""
        transfer_id = flight.transfer_id
        # A retry waits for a live decode *before* prefill: once prefill is done, its
        # blocks are held only for a lease, and a READ after that would read freed ones.
        await self._pick(flight, lambda: self.pool.require("decode", time.monotonic()))
        prefill = await self._pick(
            flight, lambda: self.pool.pick_prefill(len(flight.attempt_prompt), time.monotonic(), prompt=flight.prompt))
        flight.assign_prefill(prefill)
        span = trace.get_current_span()
        span.set_attributes({A.TRANSFER_ID: transfer_id, A.PREFILL_WORKER: prefill.worker_id})
        fetch = await self._prefix_source(flight, prefill)
        await self.journal.write_down(flight)
        handoff_arrived = asyncio.get_running_loop().create_future()
        self._handoffs[transfer_id] = handoff_arrived
        try:
            await self.outbox.send(prefill.worker_id, dispatch.prefill_job(flight, self.kv_checksums, fetch))
            with _tracer.start_as_current_span(A.SCHEDULER_WAIT_PREFILL):
                handoff: wire.Handoff = await handoff_arrived  # the deadline watch bounds this wait
        finally:
            self._handoffs.pop(transfer_id, None)
        if handoff.error is not None:
            raise EngineFailed(handoff.error.message)
        decode = self.pool.pick_decode(len(flight.attempt_prompt), time.monotonic(),
                                       prompt=flight.prompt)  # no waiting now
        flight.assign_decode(decode)
        span.set_attribute(A.DECODE_WORKER, decode.worker_id)
        await self.journal.write_down(flight)
        # What the prefill engine returned goes to decode as is (vLLM's examples do the same).
        await self.outbox.send(decode.worker_id, dispatch.decode_job(flight, handoff.kv_transfer_params, handoff.prompt))

    async def _prefix_source(self, flight: Flight, target: wire.WorkerHeartbeat,
                             can_fetch: bool = True) -> wire.Fetch | None:
        """Where the prompt's longest cached prefix comes from for ``target`` (the engine
        computing the prompt): held there, recomputed, or fetched from its holder, who is
        asked to lend it now (``prefix_sources``). The fetch for the job, if any."""
        flight.prefix = None
        if flight.prompt is None:
            return None
        target_engine = self.pool.engine(target.worker_id, flight.prompt)
        if target_engine is None:
            return None
        if not can_fetch:
            target_engine = dataclasses.replace(target_engine, lends=False)
        holders = self.pool.holders(flight.prompt, time.monotonic())
        plan = prefix_sources.plan(len(flight.attempt_prompt), target_engine, holders, self.fetch)
        span = trace.get_current_span()
        span.set_attributes({A.PREFIX_CHOICE: plan.choice, A.PREFIX_HOLDER: plan.holder.worker_id if plan.holder else "",
                             **{f"{A.PREFIX_PREFIX}{k}": v for k, v in plan.numbers.items()}})
        flight.prefix = plan.source()
        if plan.choice != "fetch":
            return None
        transfer_id, transfer_key = uuid.uuid4().hex, new_transfer_key()
        job = dispatch.lend_job(flight, plan, target.worker_id, transfer_id, transfer_key)
        with _tracer.start_as_current_span(A.SCHEDULER_LEND, attributes={
                A.TRANSFER_ID: transfer_id, A.PREFIX_HOLDER: plan.holder.worker_id, A.BLOCKS: job.blocks}) as lend:
            try:
                lent = await self.outbox.lend(plan.holder.worker_id, job, LEND_TIMEOUT_S)
            except Exception as exc:  # no answer in time, or a garbled one: compute it
                why = f"the holder did not answer the lend: {type(exc).__name__}"
                lend.set_status(Status(StatusCode.ERROR, why))
                flight.prefix = plan.source("recompute", why)
                return None
            if lent.error is not None or not lent.kv_transfer_params:
                why = f"the holder refused the lend: {lent.error.message if lent.error else 'no blocks'}"
                lend.set_status(Status(StatusCode.ERROR, why))
                lend.set_attribute(A.ERROR_CODE, lent.error.code if lent.error else "")
                flight.prefix = plan.source("recompute", why)
                return None
            lend.set_attribute(A.CACHED_TOKENS, lent.cached_tokens)
        return dispatch.fetch_of(plan, lent, transfer_key)
