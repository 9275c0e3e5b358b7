"""A prefill or decode worker: one vLLM engine with kvpush's connector, served over NATS.

Prefill: takes PrefillJob on ``kvpush.prefill.<id>``, runs the prompt with
max_tokens=1, and announces the handoff; the connector pushes the KV by itself.
Decode: takes DecodeJob on ``kvpush.decode.<id>``, starts generating at once (the
connector registers the blocks with prefill and holds the request until the KV has
arrived), and streams tokens straight to the client's reply subject.
Both heartbeat their load and free KV blocks; decode also renews the leases prefill
holds for the transfers it still waits for.

Ending: a ``CancelJob`` on the job subject drops the request (queued) or discards it
(running); the engine then frees its blocks (decode's connector first makes sure no
write can still land in them). Decode publishes each token chunk with a reply subject
of its own: if the client dropped its subscription, NATS answers "no responders" there
and the request is cancelled. Decode tells the schedulers when the first token went
out and when the request ended (``kvpush.request.progress``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
import uuid
from dataclasses import dataclass

import msgspec
import nats
import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from otel import attributes as A
from otel.messaging import TEMPORARY, TracedNats, current_traceparent, trace_id_hex
from otel.metrics import instruments
from services.worker.engine import EngineSettings, FaultSettings, engine_args
from services.tasks import BackgroundTasks
from shared import wire
from shared.errors import EngineFailed, KvTransferFailed, to_error_body

log = structlog.get_logger("kvpush.worker")
_tracer = trace.get_tracer("kvpush.worker")

HEARTBEAT_INTERVAL_S = 1.0
SHUTDOWN_GRACE_S = 10.0  # requests under way get this long to finish on shutdown
CANCEL_MEMORY = 10_000  # cancellations remembered, for jobs that arrive after their cancel


@dataclass
class _Job:
    job: "wire.PrefillJob | wire.DecodeJob"
    task: asyncio.Task | None = None
    streaming: bool = False
    ended_by: str | None = None  # "cancelled" | "client_gone": why we stopped it


def new_worker_id(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:10]}"


class _EngineLoad:
    """Latest scheduler stats of the engine, fed by vLLM's stat logger hook."""

    def __init__(self) -> None:
        self.kv_cache_usage = 0.0
        self.running = 0
        self.waiting = 0

    def factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        load = self

        class Recorder(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    load.kv_cache_usage = scheduler_stats.kv_cache_usage
                    load.running = scheduler_stats.num_running_reqs
                    load.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs

            def log_engine_initialized(self):
                pass

        return Recorder


class Worker:
    def __init__(
        self,
        role: str,
        nats_url: str,
        model: str,
        worker_id: str | None = None,
        max_model_len: int = 2048,
        connector: str = "kvpush",
        faults: FaultSettings | None = None,
    ):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, not {role!r}")
        self.role = role
        self.nats_url = nats_url
        self.worker_id = worker_id or new_worker_id(role)
        self.settings = EngineSettings(
            model=model, role=role, engine_id=self.worker_id, nats_url=nats_url,
            max_model_len=max_model_len, connector=connector, faults=faults,
        )
        self.incarnation = uuid.uuid4().hex
        self.connector = connector
        self.kv_params: dict = {}
        if connector != "kvpush":
            # vLLM's NIXL connectors talk over a side channel of their own: one port per engine.
            from services.launch.natsd import free_port

            port = free_port()
            os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
            self.kv_params = {"remote_engine_id": self.worker_id, "remote_host": "127.0.0.1",
                              "remote_port": port, "tp_size": 1}
        self._load = _EngineLoad()
        self._requests = BackgroundTasks()
        self._heartbeat: asyncio.Task | None = None
        # Keyed by transfer id: one attempt at a request (a retry is a new one).
        self._jobs: dict[str, _Job] = {}  # the jobs under way
        self._probes: dict[str, str] = {}  # decode: probe key -> transfer id
        self._cancelled: dict[str, None] = {}  # cancelled, insertion-ordered
        self._job_sub = None
        self._closed = False
        self.engine = None
        self.nc = None

    async def __aenter__(self) -> "Worker":
        from vllm.v1.engine.async_llm import AsyncLLM

        from shared.nats_security import connect_options

        self.nc = await nats.connect(self.nats_url, name=self.worker_id, max_reconnect_attempts=-1,
                                     **connect_options())
        self.bus = TracedNats(self.nc)
        log.info("starting engine", worker_id=self.worker_id, role=self.role, model=self.settings.model)
        started = time.monotonic()
        self.engine = AsyncLLM.from_engine_args(
            engine_args(self.settings), stat_loggers=[self._load.factory()]
        )
        config = self.engine.vllm_config
        self.total_blocks = config.cache_config.num_gpu_blocks or 0
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        log.info("engine ready", worker_id=self.worker_id, seconds=round(time.monotonic() - started, 1),
                 kv_blocks=self.total_blocks, block_size=self.block_size)
        subject = (wire.prefill_job_subject if self.role == "prefill" else wire.decode_job_subject)(self.worker_id)
        self._job_sub = await self.bus.subscribe(subject, self._on_job, template=f"kvpush.{self.role}.{{worker_id}}")
        if self.role == "decode":
            self._probe_prefix = self.nc.new_inbox()
            await self.nc.subscribe(f"{self._probe_prefix}.*", cb=self._on_probe)
        self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._job_sub is not None:
            await self._job_sub.unsubscribe()  # no new jobs; let the ones under way finish
        await self._requests.close(grace_s=SHUTDOWN_GRACE_S)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        if self.nc is not None:
            await self.nc.drain()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()
            del engine
            gc.collect()  # run AsyncLLM.__del__ now, not at interpreter exit where it fails
        log.info("worker stopped", worker_id=self.worker_id)

    async def _heartbeat_loop(self) -> None:
        while True:
            beat = wire.WorkerHeartbeat(
                worker_id=self.worker_id,
                role=self.role,
                free_kv_blocks=int(round(self.total_blocks * (1.0 - self._load.kv_cache_usage))),
                total_kv_blocks=self.total_blocks,
                running=self._load.running,
                waiting=self._load.waiting,
                block_size=self.block_size,
                max_model_len=self.max_model_len,
                connector=self.connector,
                kv_params=self.kv_params,
                incarnation=self.incarnation,
            )
            instruments().free_kv_blocks.set(beat.free_kv_blocks, {A.WORKER_ID: self.worker_id})
            try:
                await self.nc.publish(wire.HEARTBEAT_SUBJECT, wire.encode(beat))  # periodic: not traced
                await self._renew_leases()
            except Exception as exc:
                log.warning("heartbeat failed", error=str(exc))
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _renew_leases(self) -> None:
        """Decode: prefill keeps the blocks of every transfer we still wait for."""
        if self.role != "decode" or self.connector != "kvpush":
            return
        by_prefill: dict[str, list[str]] = {}
        for running in self._jobs.values():
            if not running.streaming:
                by_prefill.setdefault(running.job.prefill_engine_id, []).append(running.job.transfer_id)
        for prefill_id, transfer_ids in by_prefill.items():
            renewal = wire.LeaseRenewal(decode_engine_id=self.worker_id, transfer_ids=transfer_ids)
            await self.nc.publish(wire.registration_subject(prefill_id), wire.encode(renewal))  # periodic: not traced

    async def _on_job(self, msg) -> None:
        kind = wire.PrefillMessage if self.role == "prefill" else wire.DecodeMessage
        try:
            job = wire.decode(msg.data, kind)
        except msgspec.MsgspecError as exc:
            await self._refuse(msg, exc)
            return
        if isinstance(job, wire.CancelJob):
            self._cancel(job.transfer_id, "cancelled", job.reason)
            return
        if msg.reply:
            await self.bus.publish(msg.reply, wire.encode(wire.JobAck(accepted=True)), template=TEMPORARY)
        if job.transfer_id in self._cancelled:
            log.info("dropped a job cancelled before it arrived", request_id=job.request_id,
                     transfer_id=job.transfer_id)
            return
        received_ns = time.time_ns()
        running = self._jobs[job.transfer_id] = _Job(job)
        running.task = self._requests.spawn(
            self._run_prefill(job, received_ns) if self.role == "prefill" else self._run_decode(running, received_ns)
        )

    async def _refuse(self, msg, exc: Exception) -> None:
        """A message we cannot use: say so (to the sender, and on kvpush.invalid); serve on."""
        log.warning("refused a malformed message", subject=msg.subject, error=str(exc))
        instruments().failures.add(1, {"reason": "bad_job"})
        if msg.reply:
            ack = wire.JobAck(accepted=False, error=wire.ErrorBody("bad_job", f"malformed job: {exc}"))
            await self.bus.publish(msg.reply, wire.encode(ack), template=TEMPORARY)
        invalid = wire.InvalidMessage(service=self.worker_id, subject=msg.subject, code="bad_job", reason=str(exc))
        await self.nc.publish(wire.INVALID_SUBJECT, wire.encode(invalid))

    def _cancel(self, transfer_id: str, why: str, detail: str = "") -> None:
        self._cancelled[transfer_id] = None
        while len(self._cancelled) > CANCEL_MEMORY:
            del self._cancelled[next(iter(self._cancelled))]
        running = self._jobs.get(transfer_id)
        if running is None or running.task is None or running.ended_by is not None:
            return
        log.info("cancelling", request_id=running.job.request_id, transfer_id=transfer_id, why=why, detail=detail)
        running.ended_by = why
        running.task.cancel()  # vLLM aborts the request: dropped if queued, discarded if running

    async def _on_probe(self, msg) -> None:
        """NATS said nobody listens on a client's reply subject any more."""
        if msg.headers and msg.headers.get("Status") == "503":
            transfer_id = self._probes.get(msg.subject.rsplit(".", 1)[-1])
            if transfer_id is not None:
                self._cancel(transfer_id, "client_gone")

    # ---------------------------------------------------------------- prefill

    async def _run_prefill(self, job: wire.PrefillJob, received_ns: int) -> None:
        try:
            with self._request_span(A.PREFILL, job, received_ns) as span:
                await self._prefill(job, received_ns, span)
        except asyncio.CancelledError:
            log.info("prefill cancelled", request_id=job.request_id, transfer_id=job.transfer_id)
        finally:
            self._jobs.pop(job.transfer_id, None)

    async def _prefill(self, job: wire.PrefillJob, received_ns: int, span) -> None:
        from vllm import SamplingParams

        kv_params = {"do_remote_decode": True}
        if self.connector == "kvpush":
            kv_params |= {"transfer_id": job.transfer_id, "mode": job.mode, "traceparent": current_traceparent(),
                          "decode_engine_id": job.decode_engine_id}
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": kv_params})
        first_token = None
        error = None
        last = None
        try:
            async for output in self.engine.generate(
                {"prompt_token_ids": job.prompt_token_ids}, params,
                request_id=job.engine_request_id or f"{job.request_id}-p-{job.transfer_id[:8]}",
            ):
                last = output
                if output.outputs and output.outputs[0].token_ids:
                    first_token = output.outputs[0].token_ids[0]
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("prefill failed")
            error = to_error_body(EngineFailed(f"prefill failed: {exc}"))
            span.set_status(Status(StatusCode.ERROR, error.message))
        stages = _EngineStages(last)
        stages.record(A.PREFILL_QUEUE, received_ns, stages.scheduled_ns)
        stages.record(A.PREFILL_COMPUTE, stages.scheduled_ns, stages.first_token_ns)
        handoff = wire.Handoff(
            request_id=job.request_id,
            transfer_id=job.transfer_id,
            prefill_engine_id=self.worker_id,
            first_token_id=first_token,
            prefill_started_at=received_ns / 1e9,
            prefill_finished_at=time.time(),
            error=error,
            kv_transfer_params=getattr(last, "kv_transfer_params", None),
        )
        await self.bus.publish(wire.HANDOFF_SUBJECT, wire.encode(handoff))
        log.info("prefill finished", transfer_id=job.transfer_id, prompt_tokens=len(job.prompt_token_ids))

    @contextlib.contextmanager
    def _request_span(self, name: str, job, received_ns: int):
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

    # ---------------------------------------------------------------- decode

    async def _run_decode(self, running: _Job, received_ns: int) -> None:
        job = running.job
        outcome = "error"
        probe_key = uuid.uuid4().hex
        self._probes[probe_key] = job.transfer_id
        try:
            with self._request_span(A.DECODE, job, received_ns) as span:
                outcome = await self._decode(running, received_ns, span, f"{self._probe_prefix}.{probe_key}")
        except asyncio.CancelledError:
            outcome = running.ended_by or "cancelled"
            log.info("decode stopped", request_id=job.request_id, transfer_id=job.transfer_id, why=outcome)
            instruments().requests.add(1, {"outcome": outcome})
        finally:
            self._jobs.pop(job.transfer_id, None)
            self._probes.pop(probe_key, None)
            await self._progress(job, "ended", outcome)

    async def _progress(self, job: wire.DecodeJob, stage: str, outcome: str = "") -> None:
        event = wire.RequestProgress(request_id=job.request_id, transfer_id=job.transfer_id,
                                     worker_id=self.worker_id, stage=stage, outcome=outcome)
        try:
            await self.bus.publish(wire.PROGRESS_SUBJECT, wire.encode(event))
        except Exception as exc:
            log.warning("could not report progress", error=str(exc))

    async def _decode(self, running: _Job, received_ns: int, span, probe: str) -> str:
        job = running.job
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kv_params: dict = {}
        if self.connector == "kvpush":
            kv_params = {
                "do_remote_prefill": True,
                "mode": job.mode,
                "transfer_id": job.transfer_id,
                "request_id": job.request_id,
                "prefill_engine_id": job.prefill_engine_id,
                "prefill_tp_size": 1,
                "traceparent": current_traceparent(),
            }
        kv_params |= job.kv_transfer_params
        params = SamplingParams(
            max_tokens=job.sampling.max_tokens,
            temperature=job.sampling.temperature,
            ignore_eos=job.sampling.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": kv_params},
        )
        first_at = None
        completion_tokens = 0
        finish_reason = None
        last = None
        try:
            async for output in self.engine.generate(
                {"prompt_token_ids": job.prompt_token_ids}, params,
                request_id=job.engine_request_id or f"{job.request_id}-d-{job.transfer_id[:8]}",
            ):
                last = output
                completion = output.outputs[0]
                if completion.finish_reason is not None:
                    finish_reason = completion.finish_reason
                if finish_reason == "error":  # vLLM failed it: the pushed KV did not come (policy "fail")
                    break
                if completion.token_ids:
                    if first_at is None:
                        first_at = time.time()
                        running.streaming = True
                        # Before the chunk, on the same connection: the schedulers learn that
                        # a retry would repeat tokens no later than the client sees one.
                        await self._progress(job, "streaming")
                    completion_tokens += len(completion.token_ids)
                    chunk = wire.TokenChunk(job.request_id, list(completion.token_ids), completion.text)
                    # Token chunks are not traced one by one; the final reply is. The reply
                    # subject hears "no responders" if the client has gone.
                    await self.nc.publish(job.reply_to, wire.encode_json(chunk), reply=probe)
            if finish_reason == "error":
                raise KvTransferFailed(
                    "the prompt's KV cache did not arrive from prefill, and this deployment fails such "
                    "requests (--on-kv-failure fail)")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not isinstance(exc, KvTransferFailed):
                log.exception("decode failed")
            error = to_error_body(exc if isinstance(exc, KvTransferFailed) else EngineFailed(f"decode failed: {exc}"))
            span.set_status(Status(StatusCode.ERROR, error.message))
            span.set_attribute(A.ERROR_CODE, error.code)
            instruments().failures.add(1, {"reason": error.code})
            instruments().requests.add(1, {"outcome": "error"})
            await self.bus.publish(job.reply_to, wire.encode_json(wire.ErrorReply(job.request_id, error)),
                                   template=TEMPORARY)
            return "error"
        done = time.time()
        first_at = first_at or done
        stages = _EngineStages(last)
        stages.record(A.DECODE_WAIT_KV, received_ns, stages.scheduled_ns)
        stages.record(A.DECODE_FIRST_TOKEN, stages.scheduled_ns, stages.first_token_ns)
        stages.record(A.DECODE_GENERATE, stages.first_token_ns, stages.last_token_ns)
        timings = wire.Timings(
            ttft_ms=(first_at - job.received_at) * 1000,
            tpot_ms=((done - first_at) / (completion_tokens - 1) * 1000) if completion_tokens > 1 else 0.0,
            e2e_ms=(done - job.received_at) * 1000,
        )
        span.set_attributes({A.TTFT_MS: timings.ttft_ms, A.COMPLETION_TOKENS: completion_tokens})
        metrics = instruments()
        metrics.ttft.record(timings.ttft_ms)
        if completion_tokens > 1:
            metrics.tpot.record(timings.tpot_ms)
        metrics.requests.add(1, {"outcome": "ok"})
        final = wire.FinalReply(
            request_id=job.request_id,
            finish_reason=finish_reason,
            usage=wire.Usage(len(job.prompt_token_ids), completion_tokens),
            timings=timings,
        )
        await self.bus.publish(job.reply_to, wire.encode_json(final), template=TEMPORARY)
        log.info("request finished", transfer_id=job.transfer_id, completion_tokens=completion_tokens,
                 ttft_ms=round(timings.ttft_ms, 1), finish_reason=finish_reason)
        return "ok"


class _EngineStages:
    """Wall-clock times of vLLM's per-request stages, from its engine-core timestamps
    (monotonic, same host), recorded as child spans of the current span."""

    def __init__(self, output) -> None:
        stats = getattr(output, "metrics", None) if output is not None else None
        offset_ns = time.time_ns() - time.monotonic_ns()

        def wall(ts: float) -> int | None:
            return int(ts * 1e9) + offset_ns if ts else None

        self.scheduled_ns = wall(stats.scheduled_ts) if stats else None
        self.first_token_ns = wall(stats.first_token_ts) if stats else None
        self.last_token_ns = wall(stats.last_token_ts) if stats else None

    @staticmethod
    def record(name: str, start_ns: int | None, end_ns: int | None) -> None:
        if start_ns is None or end_ns is None:
            return
        _tracer.start_span(name, start_time=start_ns).end(end_time=max(start_ns, end_ns))
