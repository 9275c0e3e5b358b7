"""The scheduler: takes ``kvpush.generate`` requests (as a queue group, so several
schedulers can share the load), validates them, and dispatches them, each attempt with a
fresh transfer id. Push: prefill and decode at the same time. Pull: prefill first, then
decode, chosen by the load at that moment.

It then watches each request to its end (``kvpush.services.scheduler.flights``): every accepted request
gets a final message within its deadline. It ends requests past their deadline or
cancelled by the client (``kvpush.cancel``), telling the workers to drop them, and
retries requests whose worker went silent on other workers.

Each flight is written down in JetStream (``kvpush.services.ledger``) before any worker hears of
it, and again before each attempt's jobs go out. A scheduler that hears no heartbeat from
the holder of a record for a timeout takes the flight over (``takeover``) and finishes
it. Exactly one party answers each attempt's client: whoever wins its claim (the decode,
before its first message; a scheduler, before an error final, a retry or a takeover).

This module keeps the scheduler's life (``async with``: connect, subscribe, run its
background loops, stop) and wires its parts, each in a module of its own:

    admission   where a request enters: intake copies, admission, writing it down
    attempts    one attempt: placement, the choice of workers, its jobs out
    recovery    an attempt gone wrong: fenced for a retry elsewhere, or ended with an error
    retargets   push: a transfer retargeted to another decode before its write
    migrations  a stream whose decode was lost or stalled, continued on another
    control     the one place that starts attempts and acts on each verdict
    adoption    flights of a scheduler that is gone, taken over
    events      what workers and clients say, each message to its handler
    watch       deadlines and liveness, checked every ``WATCH_INTERVAL_S``
    journal     a flight's record in JetStream
    outbox      what goes out to workers and clients: jobs, cancels, error finals
    timing      how long it waits for what"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid

import structlog

from kvpush.otel import endpoint
from kvpush.otel.metrics import instruments
from kvpush.services.bus import Bus
from kvpush.services.ledger import Ledger
from kvpush.services.lifecycle import BackgroundTasks, Service
from kvpush.services.scheduler.admission import Admission, AdmissionSettings
from kvpush.services.scheduler.adoption import Adoption
from kvpush.services.scheduler.attempts import Attempts
from kvpush.services.scheduler.control import FlightControl
from kvpush.services.scheduler.events import Events
from kvpush.services.scheduler.flights import FlightTable
from kvpush.services.scheduler.intake import EarlyCancels, IntakeBook
from kvpush.services.scheduler.journal import Journal
from kvpush.services.scheduler.migrations import Migrations
from kvpush.services.scheduler.outbox import Outbox
from kvpush.services.scheduler.placement import PlacementSettings
from kvpush.services.scheduler.recovery import Recovery
from kvpush.services.scheduler.retargets import Retargets
from kvpush.services.scheduler.prefix_sources import FetchSettings
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.services.scheduler.takeover import SchedulerLiveness
from kvpush.services.scheduler.timing import DISPATCH_TIMEOUT_S, INTAKE_GRACE_S, Uptime
from kvpush.services.scheduler.validation import RequestValidator
from kvpush.services.scheduler.watch import FlightWatch
from kvpush.shared import settings, wire
from kvpush.shared.nats_security import nats_user

log = structlog.get_logger("kvpush.scheduler")


class Scheduler(Service):
    """``async with Scheduler(url, validator):`` serves until closed. ``validator`` turns a
    request body into a ``ValidRequest`` (``validation.load_validator`` makes one from a
    model folder)."""

    def __init__(self, nats_url: str, validator: RequestValidator, scheduler_id: str | None = None,
                 mode: str = settings.TRANSFER_MODE, deadline_s: float = settings.DEADLINE_S,
                 worker_timeout_s: float = settings.WORKER_TIMEOUT_S, max_attempts: int = settings.MAX_ATTEMPTS,
                 max_in_flight: int = settings.MAX_IN_FLIGHT,
                 scheduler_timeout_s: float = settings.SCHEDULER_TIMEOUT_S, ledger_replicas: int = 1,
                 local_below_tokens: int = settings.LOCAL_PREFILL_TOKENS,
                 push_within_s: float = settings.PUSH_WITHIN_S, kv_policy: str = settings.KV_POLICY,
                 kv_checksums: str = settings.KV_CHECKSUMS, max_migrations: int = settings.MAX_MIGRATIONS,
                 stall_s: float = settings.STALL_S, prefix_fetch: str = settings.PREFIX_FETCH,
                 fetch_link_gbps: float = settings.FETCH_LINK_BYTES_PER_S * 8 / 1e9):
        self.placement = PlacementSettings(policy=mode, local_below_tokens=local_below_tokens,
                                           push_within_s=push_within_s)
        self.mode = mode
        self.deadline_s = deadline_s
        self.nats_url = nats_url
        self.scheduler_id = scheduler_id or nats_user() or f"scheduler-{uuid.uuid4().hex[:10]}"
        if (problem := wire.identity_problem(self.scheduler_id)) is not None:
            raise ValueError(f"scheduler id: {problem}")
        if kv_policy not in wire.KV_POLICIES:
            raise ValueError(f"kv_policy must be recompute or fail, not {kv_policy!r}")
        self.kv_policy = kv_policy
        if kv_checksums not in wire.KV_CHECKSUMS:
            raise ValueError(f"kv_checksums must be off, sampled or full, not {kv_checksums!r}")
        self.kv_checksums = kv_checksums
        self.validator = validator
        self.max_in_flight = max_in_flight
        # Tokenizing a long prompt takes a while: off the event loop, one at a time (a
        # Hugging Face tokenizer must not be used from two threads at once).
        self._tokenizer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        if prefix_fetch not in ("on", "off"):
            raise ValueError(f"prefix_fetch must be on or off, not {prefix_fetch!r}")
        self.fetch = FetchSettings(enabled=prefix_fetch == "on", link_bytes_per_s=fetch_link_gbps * 1e9 / 8)
        self.pool = WorkerPool(stale_after_s=worker_timeout_s)
        self.pool.fetch_credit = settings.FETCH_CREDIT if self.fetch.enabled else 0.0
        self.flights = FlightTable(max_attempts=max_attempts, max_migrations=max_migrations, stall_s=stall_s)
        self.early_cancels = EarlyCancels(keep_s=deadline_s)
        self.incarnation = uuid.uuid4().hex[:12]
        self.schedulers = SchedulerLiveness(self.scheduler_id, self.incarnation, scheduler_timeout_s,
                                            started_at=time.monotonic())
        self._intake = IntakeBook(self.scheduler_id, keep_s=deadline_s, grace_s=INTAKE_GRACE_S)
        self.ledger_replicas = ledger_replicas
        self.ledger: Ledger | None = None
        self._mirror: asyncio.Task | None = None
        self._beats: asyncio.Task | None = None
        self._requests = BackgroundTasks()
        self._watch: asyncio.Task | None = None
        self._closed = False
        self.uptime = Uptime(time.monotonic())
        self.bus: Bus | None = None
        # Its parts, wired once NATS and JetStream are there (``_assemble``).
        self.admission: Admission | None = None
        self.adoption: Adoption | None = None
        self.events: Events | None = None
        self.flight_watch: FlightWatch | None = None

    def _assemble(self) -> None:
        journal = Journal(self.ledger, self.flights, self.scheduler_id, self.incarnation)
        outbox = Outbox(self.bus, self.ledger)
        attempts = Attempts(self.pool, self.flights, journal, outbox, self.placement, self.uptime,
                            kv_checksums=self.kv_checksums, fetch=self.fetch)
        recovery = Recovery(self.ledger, self.pool, self.flights, self._requests, attempts, outbox)
        retargets = Retargets(self.bus, self.ledger, self.pool, self.flights, journal, outbox, self.scheduler_id)
        migrations = Migrations(self.pool, self.flights, outbox, recovery)
        control = FlightControl(self.pool, self.flights, self._requests, attempts, recovery, retargets, migrations,
                                self.deadline_s)
        self.adoption = Adoption(self.ledger, self.flights, self.schedulers, self._intake, self.early_cancels,
                                 control, outbox, self._requests, self.max_in_flight)
        self.admission = Admission(
            self.bus, self.ledger, self.validator, self._tokenizer, self.flights, self.early_cancels, self._intake,
            self.schedulers, journal, outbox, control, self._requests, self.uptime,
            AdmissionSettings(deadline_s=self.deadline_s, mode=self.mode, max_in_flight=self.max_in_flight,
                              kv_policy=self.kv_policy))
        self.events = Events(self.bus, self.ledger, self.pool, self.flights, self.early_cancels, journal, outbox,
                             attempts, control, retargets, migrations, self._requests, self.scheduler_id)
        self.flight_watch = FlightWatch(self.pool, self.flights, self.schedulers, control, self.adoption,
                                        self.admission)

    async def _start(self) -> None:
        self.bus = await Bus.connect(self.nats_url, self.scheduler_id, disconnected_cb=self._on_disconnected,
                                     reconnected_cb=self._on_reconnected)
        self.ledger = await Ledger.open(self.bus.nc, me=self._claimant(), replicas=self.ledger_replicas,
                                        deadline_s=self.deadline_s)
        self._assemble()
        events, admission = self.events, self.admission
        # Heartbeats and status polls are periodic, not part of any request: not traced.
        await self.bus.subscribe_plain(wire.HEARTBEATS.wildcard, events.on_heartbeat)
        await self.bus.subscribe_plain(wire.SCHEDULER_HEARTBEATS.wildcard, self._on_scheduler_heartbeat)
        await self.bus.subscribe_plain(wire.CACHE_EVENTS.wildcard, events.on_cache_events)
        for final in (wire.FINAL_SUBJECT, wire.OWNED_FINAL.wildcard):
            await self.bus.nc.subscribe(final, queue=wire.SCHEDULER_QUEUE_GROUP, cb=events.on_final_request)
        for status in (wire.SCHEDULER_STATUS_SUBJECT, wire.OWNED_STATUS.wildcard):
            await self.bus.subscribe_plain(status, events.on_status)
        await self.bus.subscribe(wire.HANDOFFS.wildcard, events.on_handoff, template=wire.HANDOFFS)
        await self.bus.subscribe(wire.COMPLETION_SUBJECTS, events.on_completion, template=wire.KV_COMPLETIONS)
        await self.bus.subscribe(wire.PROGRESS.wildcard, events.on_progress, template=wire.PROGRESS)
        await self.bus.subscribe_plain(wire.TOKENS_SENT.wildcard, events.on_tokens)  # one a chunk: not traced
        for cancel in (wire.CANCEL_SUBJECT, wire.OWNED_CANCEL.wildcard):
            await self.bus.subscribe(cancel, events.on_cancel, template=wire.CANCEL_SUBJECT)
        await self.bus.subscribe_plain(wire.INTAKE.wildcard, admission.on_intake_settled)
        # Every scheduler gets every request (no queue group): one takes it, the others keep
        # a copy until it is settled (services/scheduler/intake.py says why).
        for generate in (wire.GENERATE_SUBJECT, wire.OWNED_GENERATE.wildcard):
            await self.bus.subscribe(generate, admission.on_generate, template=wire.GENERATE_SUBJECT)
        await self.bus.nc.flush()
        self.uptime.started_at = time.monotonic()
        loop = asyncio.get_running_loop()
        self._mirror = loop.create_task(self.adoption.mirror_flights())
        self._beats = loop.create_task(self._heartbeat_loop())
        self._watch = loop.create_task(self.flight_watch.run())
        endpoint.mark_ready()  # /ready: it takes requests
        log.info("scheduler ready", scheduler_id=self.scheduler_id)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        background = [task for task in (self._watch, self._mirror, self._beats) if task is not None]
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if self.bus is not None:
            await self.bus.close()  # stop taking requests, finish the callbacks under way
        await self._requests.close(grace_s=DISPATCH_TIMEOUT_S)
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
        log.info("scheduler stopped", scheduler_id=self.scheduler_id)

    def _claimant(self) -> wire.Claimant:
        return wire.Claimant.scheduler(self.scheduler_id, self.incarnation)

    async def _on_disconnected(self) -> None:
        self.pool.pause_evidence()  # no heartbeat can arrive: silence proves nothing
        self.schedulers.pause_evidence()
        log.warning("lost the NATS connection: no worker is declared lost until it is back")

    async def _on_reconnected(self) -> None:
        now = time.monotonic()
        self.pool.resume_evidence(now)
        self.schedulers.resume_evidence(now)
        if self._mirror is not None and not self._closed:  # its consumer may not have survived the server
            self._mirror.cancel()
            self._mirror = asyncio.get_running_loop().create_task(self.adoption.mirror_flights())
        log.info("NATS connection back: workers get a full timeout to be heard again")

    async def _on_scheduler_heartbeat(self, msg) -> None:
        beat = await self.bus.decoded(msg, wire.SchedulerHeartbeat)
        if beat is not None:
            self.schedulers.observe(beat.scheduler_id, beat.incarnation, time.monotonic())

    async def _heartbeat_loop(self) -> None:
        subject = wire.SCHEDULER_HEARTBEATS(sender=self.scheduler_id)
        while True:
            beat = wire.SchedulerHeartbeat(scheduler_id=self.scheduler_id, incarnation=self.incarnation,
                                           flights=len(self.flights))
            instruments().in_flight.set(len(self.flights), {"scheduler_id": self.scheduler_id})
            try:
                await self.bus.nc.publish(subject, wire.encode(beat))
            except Exception as exc:
                log.warning("scheduler heartbeat failed", error=str(exc))
            await asyncio.sleep(settings.HEARTBEAT_INTERVAL_S)
