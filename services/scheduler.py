"""The scheduler: takes ``kvpush.generate`` requests (as a queue group, so several
schedulers can share the load), validates them, and dispatches them, each attempt with a
fresh transfer id. Push: prefill and decode at the same time. Pull: prefill first, then
decode, chosen by the load at that moment."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import msgspec
import nats
import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from tokenizers import Tokenizer

from otel import attributes as A
from otel.messaging import TEMPORARY, TracedNats
from otel.metrics import instruments

from services.routing import WorkerPool
from services.tasks import BackgroundTasks
from services.validation import RequestValidator, request_id_of
from shared import wire
from shared.errors import DispatchFailed, EngineFailed, KvpushError, PayloadTooLarge, RequestError, to_error_body

log = structlog.get_logger("kvpush.scheduler")
_tracer = trace.get_tracer("kvpush.scheduler")

DISPATCH_TIMEOUT_S = 5.0
PREFILL_TIMEOUT_S = 600.0  # pull: how long a request may wait for its prefill
VLLM_CONNECTOR_MODES = {"vllm-nixl": "pull", "vllm-nixl-push": "push"}


def load_validator(model: str, max_model_len: int) -> RequestValidator:
    folder = Path(model)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    max_len = min(max_model_len, int(config.get("max_position_embeddings", max_model_len)))
    return RequestValidator(
        lambda text: tokenizer.encode(text, add_special_tokens=False).ids, vocab_size, max_len
    )


class Scheduler:
    def __init__(self, nats_url: str, model: str, max_model_len: int = 2048, scheduler_id: str | None = None,
                 mode: str = "push"):
        if mode not in ("push", "pull"):
            raise ValueError(f"mode must be push or pull, not {mode!r}")
        self.mode = mode
        self._handoffs: dict[str, asyncio.Future] = {}  # pull: transfer id -> its prefill's handoff
        self.nats_url = nats_url
        self.scheduler_id = scheduler_id or f"scheduler-{uuid.uuid4().hex[:10]}"
        self.validator = load_validator(model, max_model_len)
        self.pool = WorkerPool()
        self._requests = BackgroundTasks()
        self._closed = False
        self.nc = None

    async def __aenter__(self) -> "Scheduler":
        self.nc = await nats.connect(self.nats_url, name=self.scheduler_id, max_reconnect_attempts=-1)
        self.bus = TracedNats(self.nc)
        # Heartbeats and status polls are periodic, not part of any request: not traced.
        await self.nc.subscribe(wire.HEARTBEAT_SUBJECT, cb=self._on_heartbeat)
        await self.nc.subscribe(wire.SCHEDULER_STATUS_SUBJECT, cb=self._on_status)
        await self.bus.subscribe(wire.HANDOFF_SUBJECT, self._on_handoff)
        await self.bus.subscribe(wire.COMPLETION_SUBJECT, self._on_completion)
        await self.bus.subscribe(wire.GENERATE_SUBJECT, self._on_generate, queue=wire.SCHEDULER_QUEUE_GROUP)
        await self.nc.flush()
        log.info("scheduler ready", scheduler_id=self.scheduler_id)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.nc is not None:
            await self.nc.drain()  # stop taking requests, finish the callbacks under way
        await self._requests.close(grace_s=DISPATCH_TIMEOUT_S)
        log.info("scheduler stopped", scheduler_id=self.scheduler_id)

    # ---------------------------------------------------------------- events

    async def _on_heartbeat(self, msg) -> None:
        try:
            beat = wire.decode(msg.data, wire.WorkerHeartbeat)
        except msgspec.MsgspecError as exc:
            log.warning("ignored a malformed heartbeat", error=str(exc))
            return
        self.pool.observe(beat, time.monotonic())

    async def _on_status(self, msg) -> None:
        now = time.monotonic()
        status = wire.SchedulerStatus(
            scheduler_id=self.scheduler_id,
            prefill_workers=[b.worker_id for b in self.pool.live("prefill", now)],
            decode_workers=[b.worker_id for b in self.pool.live("decode", now)],
        )
        if msg.reply:
            await self.nc.publish(msg.reply, wire.encode_json(status))

    async def _on_handoff(self, msg) -> None:
        try:
            handoff = wire.decode(msg.data, wire.Handoff)
        except msgspec.MsgspecError as exc:
            log.warning("ignored a malformed handoff", error=str(exc))
            return
        waiting = self._handoffs.get(handoff.transfer_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(handoff)  # pull: now pick decode
        log.debug("prefill finished", request_id=handoff.request_id, transfer_id=handoff.transfer_id,
                  prefill_ms=round((handoff.prefill_finished_at - handoff.prefill_started_at) * 1000, 1))

    async def _on_completion(self, msg) -> None:
        try:
            event = wire.decode(msg.data, wire.Completion)
        except msgspec.MsgspecError as exc:
            log.warning("ignored a malformed completion event", error=str(exc))
            return
        match event:
            case wire.TransferDone():
                log.debug("kv pushed", transfer_id=event.transfer_id, order=event.order,
                          bytes=event.bytes, descriptors=event.descriptors, write_ms=round(event.write_ms, 2))
            case wire.TransferFailed():
                log.warning("kv push failed", transfer_id=event.transfer_id, code=event.code, reason=event.reason)

    async def _on_generate(self, msg) -> None:
        self._requests.spawn(self._serve(msg, time.time_ns()))

    async def _serve(self, msg, received_ns: int) -> None:
        _tracer.start_span(A.SCHEDULER_QUEUE, start_time=received_ns).end()
        if not msg.reply:
            log.warning("dropped a request without a reply subject")
            return
        try:
            request = self.validator.validate(msg.data)
        except RequestError as exc:
            await self._reply_error(msg.reply, request_id_of(msg.data), exc)
            return
        with structlog.contextvars.bound_contextvars(request_id=request.request_id), _tracer.start_as_current_span(
            A.SCHEDULER_DISPATCH,
            attributes={A.REQUEST_ID: request.request_id, A.PROMPT_TOKENS: len(request.prompt_token_ids)},
        ):
            try:
                await self._dispatch(request, msg.reply, received_ns / 1e9)
            except KvpushError as exc:
                await self._reply_error(msg.reply, request.request_id, exc)
            except Exception as exc:
                log.exception("dispatch failed")
                await self._reply_error(msg.reply, request.request_id, exc)

    async def _dispatch(self, request, reply_to: str, received_at: float) -> None:
        connector = self.pool.connector(time.monotonic())
        # vLLM's own connectors each do one mode; ours does either, per request.
        mode = VLLM_CONNECTOR_MODES.get(connector) or request.transfer_mode or self.mode
        trace.get_current_span().set_attribute(A.TRANSFER_MODE, mode)
        if mode == "pull":
            await self._dispatch_pull(request, reply_to, received_at, connector)
            return
        prefill_id, decode_id = self.pool.pick(len(request.prompt_token_ids), time.monotonic())
        transfer_id = uuid.uuid4().hex
        prefill_job = wire.PrefillJob(
            request_id=request.request_id,
            transfer_id=transfer_id,
            prompt_token_ids=request.prompt_token_ids,
            decode_engine_id=decode_id,
            received_at=received_at,
        )
        decode_job = self._decode_job(request, transfer_id, prefill_id, reply_to, received_at)
        if connector != "kvpush":
            # vLLM's push matches prefill and decode by a shared request id, and decode
            # registers with the prefill instance it is told about.
            prefill_job.engine_request_id = decode_job.engine_request_id = transfer_id
            beat = self.pool.beat(prefill_id)
            decode_job.kv_transfer_params = {
                "do_remote_prefill": True, "remote_request_id": transfer_id, **(beat.kv_params if beat else {})
            }
        trace.get_current_span().set_attributes(
            {A.TRANSFER_ID: transfer_id, A.PREFILL_WORKER: prefill_id, A.DECODE_WORKER: decode_id}
        )
        # Both at once: decode registers its blocks while prefill computes.
        await asyncio.gather(self._send(prefill_id, prefill_job), self._send(decode_id, decode_job))
        log.info("dispatched", transfer_id=transfer_id, prefill=prefill_id, decode=decode_id,
                 prompt_tokens=len(request.prompt_token_ids))

    async def _dispatch_pull(self, request, reply_to: str, received_at: float, connector: str) -> None:
        """Pull, the way vLLM's default connector is driven: prefill first; decode is chosen
        from the load at the moment prefill finished, and reads the prefill's blocks."""
        prefill_id = self.pool.pick_prefill(time.monotonic())
        transfer_id = uuid.uuid4().hex
        span = trace.get_current_span()
        span.set_attributes({A.TRANSFER_ID: transfer_id, A.PREFILL_WORKER: prefill_id})
        handoff_arrived = asyncio.get_running_loop().create_future()
        self._handoffs[transfer_id] = handoff_arrived
        try:
            await self._send(prefill_id, wire.PrefillJob(
                request_id=request.request_id,
                transfer_id=transfer_id,
                prompt_token_ids=request.prompt_token_ids,
                received_at=received_at,
                mode="pull",
                engine_request_id=transfer_id if connector != "kvpush" else "",
            ))
            with _tracer.start_as_current_span(A.SCHEDULER_WAIT_PREFILL):
                handoff: wire.Handoff = await asyncio.wait_for(handoff_arrived, PREFILL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise EngineFailed(f"prefill worker {prefill_id} did not finish within {PREFILL_TIMEOUT_S} s") from None
        finally:
            self._handoffs.pop(transfer_id, None)
        if handoff.error is not None:
            raise EngineFailed(handoff.error.message)
        decode_id = self.pool.pick_decode(len(request.prompt_token_ids), time.monotonic())
        span.set_attribute(A.DECODE_WORKER, decode_id)
        decode_job = self._decode_job(request, transfer_id, prefill_id, reply_to, received_at)
        decode_job.mode = "pull"
        # What the prefill engine returned goes to decode as is (vLLM's examples do the same).
        decode_job.kv_transfer_params = dict(handoff.kv_transfer_params or {})
        if connector != "kvpush":
            decode_job.engine_request_id = transfer_id
        await self._send(decode_id, decode_job)
        log.info("dispatched", transfer_id=transfer_id, prefill=prefill_id, decode=decode_id,
                 prompt_tokens=len(request.prompt_token_ids), mode="pull")

    @staticmethod
    def _decode_job(request, transfer_id: str, prefill_id: str, reply_to: str, received_at: float) -> wire.DecodeJob:
        return wire.DecodeJob(
            request_id=request.request_id,
            transfer_id=transfer_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            prefill_engine_id=prefill_id,
            reply_to=reply_to,
            received_at=received_at,
        )

    async def _send(self, worker_id: str, job: wire.PrefillJob | wire.DecodeJob) -> None:
        """Hand a job to a worker and wait for its ack."""
        body = wire.encode(job)
        if len(body) > self.nc.max_payload:
            raise PayloadTooLarge(
                f"the prompt makes a {len(body)}-byte job, over the NATS server's max_payload of "
                f"{self.nc.max_payload} bytes; raise max_payload or send a shorter prompt"
            )
        if isinstance(job, wire.PrefillJob):
            subject, template = wire.prefill_job_subject(worker_id), "kvpush.prefill.{worker_id}"
        else:
            subject, template = wire.decode_job_subject(worker_id), "kvpush.decode.{worker_id}"
        try:
            reply = await self.bus.request(subject, body, DISPATCH_TIMEOUT_S, template=template)
        except Exception as exc:
            raise DispatchFailed(f"worker {worker_id} did not accept the job: {type(exc).__name__}") from None
        ack = wire.decode(reply.data, wire.JobAck)
        if not ack.accepted:
            raise DispatchFailed(f"worker {worker_id} refused the job: {ack.error.message}")

    async def _reply_error(self, reply_to: str, request_id: str, exc: BaseException) -> None:
        body = to_error_body(exc)
        log.info("request rejected", request_id=request_id, code=body.code, message=body.message)
        span = trace.get_current_span()
        span.set_attributes({A.REQUEST_ID: request_id, A.ERROR_CODE: body.code})
        span.set_status(Status(StatusCode.ERROR, body.message))
        instruments().failures.add(1, {"reason": body.code})
        instruments().requests.add(1, {"outcome": "error"})
        await self.bus.publish(reply_to, wire.encode_json(wire.ErrorReply(request_id, body)), template=TEMPORARY)
