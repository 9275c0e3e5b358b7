"""The prefill role: run the prompt with max_tokens=1 and announce the handoff. The
connector pushes the KV by itself (push), or holds the blocks for decode to read (pull)."""

from __future__ import annotations

import asyncio
import time

import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvpush.otel import attributes as A
from kvpush.otel.messaging import current_traceparent
from kvpush.otel.metrics import instruments
from kvpush.services.worker.kinds import strategy, wake_engine
from kvpush.services.worker.stages import EngineStages
from kvpush.services.worker.jobs import EngineLost, RunningJob, WorkerContext
from kvpush.services.worker.prompt_meter import PromptMeter
from kvpush.services.worker.sampling import prompt_report
from kvpush.shared import wire
from kvpush.shared.errors import EngineFailed, to_error_body

log = structlog.get_logger("kvpush.worker")
_tracer = trace.get_tracer("kvpush.worker")


class PrefillRole:
    name: wire.Role = "prefill"
    job_kind = wire.PrefillMessage
    job_subject = wire.PREFILL_JOBS

    def __init__(self, worker: WorkerContext):
        self.worker = worker
        self.meter = PromptMeter()

    async def start(self) -> None:
        return None

    def heartbeat_fields(self) -> dict:
        return self.meter.heartbeat_fields()

    async def serve(self, running: RunningJob, received_ns: int) -> None:
        job: wire.PrefillJob = running.job
        tokens = len(job.prompt_token_ids)
        self.meter.started(tokens, time.monotonic())
        computed = False
        try:
            with self.worker.request_span(A.PREFILL, job, received_ns) as span:
                computed = await self._prefill(job, received_ns, span)
        except asyncio.CancelledError:
            log.info("prefill cancelled", request_id=job.request_id, transfer_id=job.transfer_id)
        except EngineLost:  # no handoff: a scheduler finds this worker lost and tries the request again
            log.warning("the engine died under the prefill", request_id=job.request_id, transfer_id=job.transfer_id)
        finally:
            self.meter.finished(tokens, time.monotonic(), computed)

    async def _prefill(self, job: wire.PrefillJob, received_ns: int, span) -> bool:
        """Whether the engine computed the prompt."""
        from vllm import SamplingParams

        engine_request_id, kv_params = strategy(self.worker.connector).prefill_request(job, current_traceparent())
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=job.prompt_logprobs,
                                extra_args={"kv_transfer_params": kv_params})
        first_token = None
        error = None
        last = None
        try:
            wake_engine(self.worker.settings)
            async for output in self.worker.engine.generate(
                {"prompt_token_ids": job.prompt_token_ids}, params, request_id=engine_request_id,
            ):
                last = output
                if output.outputs and output.outputs[0].token_ids:
                    first_token = output.outputs[0].token_ids[0]
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self.worker.engine_lost(exc):
                raise EngineLost() from exc
            log.exception("prefill failed")
            error = to_error_body(EngineFailed(f"prefill failed: {exc}"))
            span.set_status(Status(StatusCode.ERROR, error.message))
        span.set_attribute(A.CACHED_TOKENS, getattr(last, "num_cached_tokens", None) or 0)
        prompt = prompt_report(last) if error is None and last is not None else None
        if prompt is not None and job.fetch is not None:
            prompt = fetched_report(prompt, getattr(last, "kv_transfer_params", None), span)
        stages = EngineStages(last, _tracer)
        stages.record(A.PREFILL_QUEUE, received_ns, stages.scheduled_ns)
        stages.record(A.PREFILL_COMPUTE, stages.scheduled_ns, stages.first_token_ns)
        if stages.scheduled_ns is not None and stages.first_token_ns is not None:
            instruments().prefill_duration.record((stages.first_token_ns - stages.scheduled_ns) / 1e6)
        handoff = wire.Handoff(
            request_id=job.request_id,
            transfer_id=job.transfer_id,
            prefill_engine_id=self.worker.worker_id,
            first_token_id=first_token,
            prefill_started_at=received_ns / 1e9,
            prefill_finished_at=time.time(),
            error=error,
            kv_transfer_params=getattr(last, "kv_transfer_params", None),
            prompt=prompt,
        )
        await self.worker.bus.publish(wire.HANDOFFS(sender=self.worker.worker_id), wire.encode(handoff))
        log.info("prefill finished", transfer_id=job.transfer_id, prompt_tokens=len(job.prompt_token_ids))
        return error is None


def fetched_report(prompt: wire.PromptReport, kv_params: dict | None, span) -> wire.PromptReport:
    """The prompt's report with what its fetch brought (``wire.FETCHED_KEY``): the tokens
    read from the holder, which vLLM counts as neither cached nor computed here."""
    fetched = (kv_params or {}).get(wire.FETCHED_KEY)
    if not isinstance(fetched, dict):
        return prompt
    came = wire.FetchedKv.of(fetched)
    span.set_attribute(A.FETCHED_TOKENS, came.tokens)
    if came.failure:
        log.warning("a fetched prefix did not arrive: the engine computed it", holder=came.holder_engine_id,
                    reason=came.failure)
    prompt.cached_tokens = max(prompt.cached_tokens - came.asked_tokens, 0)  # its own cache's hits only
    prompt.fetched_tokens = came.tokens
    prompt.fetched_from = came.holder_engine_id if came.tokens else ""
    return prompt
