"""A prefill or decode worker: one vLLM engine with a KV connector, served over NATS.

The worker takes jobs on its job subject (``kvpush.prefill.<id>`` or
``kvpush.decode.<id>``), acks them, and hands each to its role (``prefill.PrefillRole``,
``decode.DecodeRole``), which runs it on the engine. Both roles heartbeat their load and
free KV blocks. A ``CancelJob`` on the job subject drops the request (queued) or discards
it (running); the engine then frees its blocks (decode's connector first makes sure no
write can still land in them). Leases on prefill's blocks are the connectors' business.

An engine that dies (its engine core, or one rank's process at tensor parallelism above 1:
vLLM then stops every rank, and its client raises ``EngineDeadError``) ends the worker:
it stops heartbeating, says nothing more of the jobs it held (no error to their clients,
no end to the schedulers), and exits with status 1, as a crashed worker would. The
schedulers find it lost by its silence and retry or migrate its requests; whatever
restarts crashed workers restarts it with a new engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import uuid

import structlog
from opentelemetry import trace

from kvpush.otel import attributes as A
from kvpush.otel import endpoint
from kvpush.otel.messaging import TEMPORARY, trace_id_hex
from kvpush.otel.metrics import instruments
from kvpush.services.bus import Bus
from kvpush.services.lifecycle import BackgroundTasks, Service
from kvpush.services.worker.cache_relay import CacheRelay, events_endpoint
from kvpush.services.worker.decode import DecodeRole
from kvpush.services.worker.engine import EngineLoad, kv_bytes_per_block, start_engine
from kvpush.services.worker.kinds import strategy
from kvpush.services.worker.engine_settings import EngineSettings, layer_wise
from kvpush.services.worker.job_book import JobBook
from kvpush.services.worker.jobs import RunningJob
from kvpush.services.worker.kinds import strategy
from kvpush.services.worker.lending import Lender
from kvpush.services.worker.prefill import PrefillRole
from kvpush.shared import connector_kinds, settings, wire
from kvpush.shared.errors import BadJob
from kvpush.shared.nats_security import nats_user
from kvpush.shared.settings import FaultSettings

log = structlog.get_logger("kvpush.worker")
_tracer = trace.get_tracer("kvpush.worker")

SHUTDOWN_GRACE_S = 10.0  # requests under way get this long to finish on shutdown
ENGINE_WATCH_S = 0.25  # how often the worker asks whether its engine still runs
ROLES = {"prefill": PrefillRole, "decode": DecodeRole}


def new_worker_id(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:10]}"


def worker_id_for(role: str, given: str | None, user: str | None) -> str:
    """A worker's id is its NATS identity: ``--worker-id``, else the NATS user it logs in
    as, else (no login) a new one. With per-worker users the two must agree, since NATS
    lets a worker publish only under its user's name."""
    if given and user and given != user:
        raise ValueError(f"the worker id {given!r} differs from its NATS user {user!r}: with one NATS user per "
                         "worker the id is the user name (leave --worker-id out)")
    worker_id = given or user or new_worker_id(role)
    if (problem := wire.identity_problem(worker_id)) is not None:
        raise ValueError(f"worker id: {problem}")
    return worker_id


class Worker(Service):
    def __init__(
        self,
        role: str,
        nats_url: str,
        model: str,
        worker_id: str | None = None,
        max_model_len: int = settings.MAX_MODEL_LEN,
        connector: str = settings.CONNECTOR,
        faults: FaultSettings = settings.FAULTS,
        prefix_caching: bool = settings.PREFIX_CACHING == "on",
        push_by_layer: bool | None = None,  # None: the setting's default (``layer_wise``)
        json_whitespace: str = settings.JSON_WHITESPACE,
        tensor_parallel_size: int = 1,
        block_size: int | None = None,  # None: vLLM's default for the platform
        max_num_seqs: int = 16,
    ):
        if role not in ROLES:
            raise ValueError(f"role must be prefill or decode, not {role!r}")
        self.nats_url = nats_url
        self.worker_id = worker_id_for(role, worker_id, nats_user())
        self.incarnation = uuid.uuid4().hex  # a restart keeps the id, not the incarnation
        self.settings = EngineSettings(
            model=model, role=role, engine_id=self.worker_id, nats_url=nats_url,
            max_model_len=max_model_len, block_size=block_size, max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size,
            connector=connector,
            faults=faults, incarnation=self.incarnation,
            prefix_caching=prefix_caching,
            push_by_layer=layer_wise(settings.PUSH_BY_LAYER) if push_by_layer is None else push_by_layer,
            json_whitespace=json_whitespace,
            # The schedulers route by what each engine's prefix cache holds: its events, relayed.
            kv_events_endpoint=events_endpoint(self.worker_id, self.incarnation) if prefix_caching else None,
        )
        self.connector = connector
        self.kv_params = strategy(connector).side_channel(self.worker_id, tensor_parallel_size)
        self.role = ROLES[role](self)
        self._load = EngineLoad()
        self._requests = BackgroundTasks()
        self._heartbeat: asyncio.Task | None = None
        self._cache_relay: CacheRelay | None = None
        self.lender: Lender | None = None  # lends the engine's cached prefixes (kvpush's connector, prefix caching on)
        self.kv_bytes_per_block = 0
        # Keyed by transfer id: one attempt at a request (a retry is a new one).
        self._jobs = JobBook()
        self._job_sub = None
        self._closed = False
        self.engine = None
        self.bus: Bus | None = None
        self.engine_dead = False
        self._engine_died = asyncio.Event()
        self._engine_watch: asyncio.Task | None = None

    async def _start(self) -> None:
        self.bus = await Bus.connect(self.nats_url, self.worker_id)
        log.info("starting engine", worker_id=self.worker_id, role=self.role.name, model=self.settings.model)
        started = time.monotonic()
        self.engine = start_engine(self.settings, stat_loggers=[self._load.factory()])
        config = self.engine.vllm_config
        self.total_blocks = config.cache_config.num_gpu_blocks or 0
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        log.info("engine ready", worker_id=self.worker_id, seconds=round(time.monotonic() - started, 1),
                 kv_blocks=self.total_blocks, block_size=self.block_size)
        if self.settings.kv_events_endpoint is not None:
            self._cache_relay = CacheRelay(self.bus, self.worker_id, self.incarnation, self.block_size,
                                           self.settings.kv_events_endpoint)
            await self._cache_relay.start()
            if self.connector == connector_kinds.KVPUSH.name:
                self.lender = Lender(self, self._cache_relay.keys, strategy(self.connector))
                await self.lender.start()
        self.kv_bytes_per_block = kv_bytes_per_block(config)
        self._job_sub = await self.bus.subscribe(self.role.job_subject(worker_id=self.worker_id), self._on_job)
        await self.role.start()
        self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        self._engine_watch = asyncio.get_running_loop().create_task(self._watch_engine())
        endpoint.mark_ready()  # /ready: the engine is up and the worker takes jobs

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._job_sub is not None:
            await self._job_sub.unsubscribe()  # no new jobs; let the ones under way finish
        if self.lender is not None:
            await self.lender.close()
        await self._requests.close(grace_s=0.0 if self.engine_dead else SHUTDOWN_GRACE_S)
        for task in (self._heartbeat, self._engine_watch):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._cache_relay is not None:
            await self._cache_relay.close()
        if self.bus is not None:
            await self.bus.close()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()
            del engine
            gc.collect()  # run AsyncLLM.__del__ now, not at interpreter exit where it fails
        log.info("worker stopped", worker_id=self.worker_id)

    async def until_failed(self) -> str:
        """Returns (why) once the engine died: the worker can serve no more and must exit."""
        await self._engine_died.wait()
        return "its engine died"

    async def _watch_engine(self) -> None:
        """Notice the engine's death when no job is there to meet it."""
        while not self.engine.errored:
            await asyncio.sleep(ENGINE_WATCH_S)
        self.engine_lost(None)

    def engine_lost(self, exc: BaseException | None) -> bool:
        """Whether the engine is dead (``exc`` is vLLM's ``EngineDeadError``, or its client
        says it errored). The first time, the worker stops heartbeating and taking jobs, and
        ``until_failed`` returns: from then on its jobs end without a word (``EngineLost``)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if not (self.engine_dead or isinstance(exc, EngineDeadError)
                or (self.engine is not None and self.engine.errored)):
            return False
        if not self.engine_dead:
            self.engine_dead = True
            log.error("the engine died: this worker stops heartbeating and exits; the schedulers retry or move "
                      "its requests", worker_id=self.worker_id, error=str(exc) if exc is not None else "")
            if self._heartbeat is not None:
                self._heartbeat.cancel()
            self._engine_died.set()
        return True

    async def _heartbeat_loop(self) -> None:
        while True:
            beat = wire.WorkerHeartbeat(
                worker_id=self.worker_id,
                role=self.role.name,
                free_kv_blocks=int(round(self.total_blocks * (1.0 - self._load.kv_cache_usage))),
                total_kv_blocks=self.total_blocks,
                running=self._load.running,
                waiting=self._load.waiting,
                block_size=self.block_size,
                max_model_len=self.max_model_len,
                connector=self.connector,
                kv_params=self.kv_params,
                incarnation=self.incarnation,
                lends=self.lender is not None,
                kv_bytes_per_block=self.kv_bytes_per_block,
                **self.role.heartbeat_fields(),
            )
            worker = {A.WORKER_ID: self.worker_id}
            instruments().free_kv_blocks.set(beat.free_kv_blocks, worker)
            instruments().waiting.set(beat.waiting, worker)
            instruments().running.set(beat.running, worker)
            try:
                await self.bus.nc.publish(wire.HEARTBEATS(sender=self.worker_id), wire.encode(beat))  # not traced
            except Exception as exc:
                log.warning("heartbeat failed", error=str(exc))
            await asyncio.sleep(settings.HEARTBEAT_INTERVAL_S)

    async def _on_job(self, msg) -> None:
        if self.engine_dead:
            return  # not acked: the scheduler sends it elsewhere
        job = await self.bus.decoded(msg, self.role.job_kind, refuse_as=BadJob, nack=True)
        if job is None:
            return
        if isinstance(job, wire.CancelJob):
            self.cancel(job.transfer_id, "cancelled", job.reason, job.error)
            return
        if isinstance(job, wire.PromptReady):
            self._jobs.prompt_ready(job)  # push: prefill's word on the prompt, for decode's job
            return
        if msg.reply and wire.is_inbox(msg.reply):
            await self.bus.publish(msg.reply, wire.encode(wire.JobAck(accepted=True)), template=TEMPORARY)
        running = self._jobs.arrived(job)
        if running is None:
            log.info("dropped a job cancelled before it arrived", request_id=job.request_id,
                     transfer_id=job.transfer_id)
            return
        running.task = self._requests.spawn(self._serve(running, time.time_ns()))

    async def _serve(self, running: RunningJob, received_ns: int) -> None:
        running.started = True
        if running.ended_by is not None:
            # Cancelled before its first step: cancelling the task then would have skipped
            # its body, and with it the role's cleanup (decode's "ended", the engine's abort).
            # Cancelled now, the role's first await raises inside its own try.
            asyncio.current_task().cancel()
        try:
            await self.role.serve(running, received_ns)
        finally:
            self._jobs.ended(running.job.transfer_id)

    def spawn(self, coroutine) -> asyncio.Task:
        """Run ``coroutine`` as one of the worker's requests (closed with them)."""
        return self._requests.spawn(coroutine)

    def cancel(self, transfer_id: str, why: str, detail: str = "", error: wire.ErrorBody | None = None) -> None:
        running = self._jobs.cancelled(transfer_id)
        if running is None or running.task is None or running.ended_by is not None:
            return
        log.info("cancelling", request_id=running.job.request_id, transfer_id=transfer_id, why=why, detail=detail)
        running.ended_by = why
        running.cancel_error = error
        if running.started:
            running.task.cancel()  # vLLM aborts the request: dropped if queued, discarded if running

    @contextlib.contextmanager
    def request_span(self, name: str, job, received_ns: int):
        """The job's span, with request_id and trace_id on every log line under it."""
        attributes = {
            A.REQUEST_ID: job.request_id,
            A.TRANSFER_ID: job.transfer_id,
            A.WORKER_ID: self.worker_id,
            A.PROMPT_TOKENS: len(job.prompt_token_ids),
        }
        with _tracer.start_as_current_span(name, start_time=received_ns, attributes=attributes) as span:
            with structlog.contextvars.bound_contextvars(request_id=job.request_id, trace_id=trace_id_hex(span)):
                yield span
