"""The decode role: start generating at once (the connector registers the blocks with
prefill and holds the request until the KV has arrived) and stream tokens straight to the
client's reply subject.

Each token chunk goes out with a reply subject of our own (a probe): if the client
dropped its subscription, NATS answers "no responders" there and the request is
cancelled. The schedulers hear of each chunk just before it goes out, on the same
connection (``wire.TokensSent``: what the client has, should the stream move to another
decode), and when the request ended (``kvpush.request.progress``, with the final).

A migrated request (``job.resume``) continues a stream another decode started: its seq
goes on from the chunks sent, its final counts them, and with a replay continuation the
engine replays the tokens sent as its first outputs, which are not sent again
(``kvpush.services.worker.replay``).

Before its first message to the client, the job claims the answer (``kvpush.services.ledger``).
If a scheduler claimed it first (it retried the request elsewhere, took it over, or ended
it), the job sends nothing and stops. Once it holds the claim, it sends the final itself,
also when a scheduler cancels it (with the error the CancelJob carries).

This module is the I/O: claims, probes, token records, engine calls, spans and metrics.
The answer stream itself (seq, replay, timings, the final) is ``kvpush.services.worker.
answer``; the n > 1 fan-out of engine requests, ``kvpush.services.worker.fanout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvpush.otel import attributes as A
from kvpush.otel.attributes import path_attributes
from kvpush.otel.messaging import TEMPORARY, current_traceparent
from kvpush.otel.metrics import instruments
from kvpush.services.ledger import Claims, ClaimState
from kvpush.services.worker.answer import Answer, NewTokens
from kvpush.services.worker.kinds import strategy, wake_engine
from kvpush.services.worker.stages import EngineStages
from kvpush.services.worker.fanout import fan_out
from kvpush.services.worker import tool_calling
from kvpush.services.worker.jobs import EngineLost, RunningJob, WorkerContext
from kvpush.services.worker.prompt_meter import PromptMeter
from kvpush.services.worker.sampling import answer_sampling, sampling_params_kwargs
from kvpush.shared import continuation, wire
from kvpush.shared.errors import EngineFailed, InvalidField, KvTransferFailed, KvpushError, StreamLost, to_error_body

log = structlog.get_logger("kvpush.worker")
# Push: prefill's report on the prompt comes through the scheduler, after the handoff; decode
# may be done first. The first chunk of a request with prompt logprobs waits for it;
# the final waits a little for its cached-token count, then says it is unknown.
PROMPT_LOGPROBS_WAIT_S = 30.0
PROMPT_REPORT_WAIT_S = 2.0
_tracer = trace.get_tracer("kvpush.worker")


class _KvNotArrived(Exception):
    """vLLM ended the first answer's request before any token: its KV did not come
    (our connector runs vLLM's kv_load_failure_policy "fail"; the request's policy is ours)."""


class _Fenced(Exception):
    """A scheduler holds the claim to answer this attempt's client (or JetStream cannot say
    whether we do): send nothing."""


class DecodeRole:
    name: wire.Role = "decode"
    job_kind = wire.DecodeMessage
    job_subject = wire.DECODE_JOBS

    def __init__(self, worker: WorkerContext):
        self.worker = worker
        self.meter = PromptMeter()  # of the prompts it computes itself (local)
        self.claims: Claims | None = None
        self._probes: dict[str, str] = {}  # probe key -> transfer id
        self._probe_prefix = ""

    def heartbeat_fields(self) -> dict:
        """Of the prompts it computes itself (local): what it holds and how fast it computes."""
        return self.meter.heartbeat_fields()

    async def start(self) -> None:
        metrics = instruments()  # at 0 from the start: an alert on them needs a series before the first fallback
        for outcome in ("recomputed", "failed"):
            metrics.kv_fallbacks.add(0, {"outcome": outcome})
        metrics.recomputed_tokens.add(0, {"mode": "push"})
        self.claims = Claims(self.worker.bus.nc, wire.Claimant.decode(self.worker.worker_id))
        self._probe_prefix = self.worker.bus.nc.new_inbox()
        await self.worker.bus.subscribe_plain(f"{self._probe_prefix}.*", self._on_probe)

    async def _on_probe(self, msg) -> None:
        """NATS said nobody listens on a client's reply subject any more."""
        if msg.headers and msg.headers.get("Status") == "503":
            transfer_id = self._probes.get(msg.subject.rsplit(".", 1)[-1])
            if transfer_id is not None:
                # The client may be back: in a NATS cluster its interest vanishes while it
                # reconnects to another server. What it is told, there or by kvpush.final:
                gone = StreamLost("nobody listened on the request's reply subject (the client's connection was "
                                  "lost, or it went away), so it was stopped; the tokens sent meanwhile were lost: "
                                  "send the request again")
                self.worker.cancel(transfer_id, "client_gone", error=to_error_body(gone))

    async def serve(self, running: RunningJob, received_ns: int) -> None:
        job: wire.DecodeJob = running.job
        outcome = "error"
        probe_key = uuid.uuid4().hex
        self._probes[probe_key] = job.transfer_id
        final = b""
        try:
            with self.worker.request_span(A.DECODE, job, received_ns) as span:
                outcome, final = await self._decode(running, received_ns, span,
                                                    f"{self._probe_prefix}.{probe_key}")
        except asyncio.CancelledError:
            outcome = running.ended_by or "cancelled"
            log.info("decode stopped", request_id=job.request_id, transfer_id=job.transfer_id, why=outcome)
            instruments().requests.add(1, {"outcome": outcome})
            if running.claimed and running.cancel_error is not None and not self.worker.engine_dead:
                final = await self._send_final(job, wire.ErrorReply(job.request_id, running.cancel_error))  # why
        except EngineLost:
            log.warning("the engine died under the request: left to the schedulers", request_id=job.request_id,
                        transfer_id=job.transfer_id)
        finally:
            self._probes.pop(probe_key, None)
            if not self.worker.engine_dead:  # else silent: a scheduler moves it, as from a crashed worker
                await self._progress(job, "ended", outcome, final)

    async def _claim(self, running: RunningJob) -> bool:
        """Win the right to answer this attempt's client, or learn a scheduler has it. A
        claim JetStream cannot settle is not won: the job then sends nothing, and says so
        (``wire.UNCLAIMED``), so a scheduler tries the request again."""
        if running.claim is None or running.claim.state is ClaimState.UNKNOWN:
            running.claim = await self.claims.claim(running.job.transfer_key)
        return running.claim.won

    async def _send_final(self, job: wire.DecodeJob, final: wire.FinalReply | wire.ErrorReply) -> bytes:
        data = wire.encode_json(final)
        await self.worker.bus.publish(job.reply_to, data, template=TEMPORARY)
        return data

    async def _progress(self, job: wire.DecodeJob, stage: wire.ProgressStage, outcome: str = "",
                        final: bytes = b"") -> None:
        event = wire.RequestProgress(request_id=job.request_id, transfer_id=job.transfer_id,
                                     worker_id=self.worker.worker_id, stage=stage, outcome=outcome, final=final)
        try:
            await self.worker.bus.publish(wire.PROGRESS(sender=self.worker.worker_id), wire.encode(event))
        except Exception as exc:
            log.warning("could not report progress", error=str(exc))

    async def _decode(self, running: RunningJob, received_ns: int, span, probe: str) -> tuple[str, bytes]:
        """(outcome, the final sent to the client or b"")."""
        job: wire.DecodeJob = running.job
        answer = Answer(job, self.worker.settings.faults.on_kv_failure)
        try:
            await self._stream(running, answer, probe)
        except asyncio.CancelledError:
            raise
        except _Fenced:
            log.info("a scheduler answers this attempt (or JetStream cannot say); stopped without a word "
                     "to the client", transfer_id=job.transfer_id)
            return _not_ours(running), b""
        except Exception as exc:
            if self.worker.engine_lost(exc):
                raise EngineLost() from exc
            return "error", await self._fail(running, span, exc)
        if not await self._claim(running):
            return _not_ours(running), b""
        return "ok", await self._finish(running, received_ns, span, answer)

    async def _stream(self, running: RunningJob, answer: Answer, probe: str) -> None:
        """Generate and send each chunk as it comes; if the prompt's KV does not arrive,
        compute the prompt here or fail, per the request's kv_policy."""
        job: wire.DecodeJob = running.job
        engine_request_id, kv_params = strategy(self.worker.connector).decode_request(job, current_traceparent())
        kwargs = _engine_sampling(job)
        computing = job.mode == "local"  # the prompt is ours to compute
        while True:
            try:
                await self._generate(running, answer, probe, engine_request_id, kv_params, kwargs, computing)
                return
            except _KvNotArrived:
                if not answer.recomputes_lost_kv():
                    instruments().kv_fallbacks.add(1, {"outcome": "failed"})
                    raise KvTransferFailed(answer.kv_failed_message()) from None
            # Recompute: nothing was sent; the same request, its prompt computed here.
            log.warning("the prompt's KV did not arrive: computing it here", transfer_id=job.transfer_id,
                        request_id=job.request_id)
            instruments().kv_fallbacks.add(1, {"outcome": "recomputed"})
            computing = True
            # Our connector tells this request's last output why the first one's load failed.
            engine_request_id, kv_params = f"{engine_request_id}-r", {wire.RECOMPUTE_OF_KEY: engine_request_id}

    async def _generate(self, running: RunningJob, answer: Answer, probe: str, engine_request_id: str,
                        kv_params: dict, kwargs: dict, computing: bool) -> None:
        """One engine request (and its n - 1 others): with the prompt's KV from prefill
        (``kv_params``), or computing the prompt here."""
        from vllm.exceptions import VLLMValidationError

        job: wire.DecodeJob = running.job
        answer.computed_here = computing
        skip_special = kwargs.get("skip_special_tokens", True)

        def detokenize(token_ids: list[int]) -> str:
            return self.worker.engine.tokenizer.decode(token_ids, skip_special_tokens=skip_special)

        first, others = _engine_requests(job, engine_request_id, kv_params, kwargs)
        prompt_tokens = len(job.prompt_token_ids)
        if computing:
            self.meter.started(prompt_tokens, time.monotonic())
        try:
            wake_engine(self.worker.settings)
            # Local: the others start at once, as vLLM's fan-out; but a request with prompt logprobs
            # waits, so that answer 0's first chunk, which carries them, goes out before any other's.
            others_wait = job.mode != "local" or job.sampling.prompt_logprobs is not None
            # Closed on the way out, whatever ends the loop: the other answers' engine requests are
            # aborted at once, not whenever the generator is collected.
            outputs = fan_out(self.worker.engine.generate, {"prompt_token_ids": job.prompt_token_ids},
                              first, others, others_wait)
            async with contextlib.aclosing(outputs):
                async for index, output in outputs:
                    answer.saw(index, output, computing)
                    completion = output.outputs[0]
                    # vLLM ended it: the KV did not come (our connector runs vLLM's policy "fail")
                    if completion.finish_reason == "error" and not computing:
                        raise _KvNotArrived()
                    if not completion.token_ids:
                        continue
                    if computing:
                        computing = False
                        self.meter.finished(prompt_tokens, time.monotonic())
                    new = answer.unreplayed(index, completion, detokenize)
                    if new.token_ids:  # else replayed: its client has it
                        await self._send(running, answer, index, new, probe)
        except (ValueError, VLLMValidationError) as exc:  # vLLM's input checks: nothing was generated
            if answer.last is not None:
                raise
            raise InvalidField(f"the decode engine refused the request: {exc}") from exc
        finally:
            if computing:
                self.meter.finished(prompt_tokens, time.monotonic(), computed=False)

    async def _send(self, running: RunningJob, answer: Answer, index: int, new: NewTokens, probe: str) -> None:
        """Answer ``index``'s new tokens to the client, claiming the answer before the first."""
        job: wire.DecodeJob = running.job
        if not answer.sent_here:
            if not await self._claim(running):
                raise _Fenced(job.transfer_id)
            running.streaming = True
        carries_prompt_logprobs = answer.prompt_logprobs_due(index)
        chunk = answer.chunk(index, new, time.time())
        if carries_prompt_logprobs:
            chunk.prompt_logprobs = await self._prompt_logprobs(running, answer)
        # Before the chunk, on the same connection: the schedulers learn of every
        # token no later than the client sees it (a migration resumes after it).
        record = wire.TokensSent(request_id=job.request_id, transfer_id=job.transfer_id,
                                 worker_id=self.worker.worker_id, seq=chunk.seq, token_ids=chunk.token_ids,
                                 index=chunk.index)
        await self.worker.bus.nc.publish(wire.TOKENS_SENT(sender=self.worker.worker_id), wire.encode(record))
        # Token chunks are not traced one by one; the final reply is. The reply
        # subject hears "no responders" if the client has gone.
        await self.worker.bus.nc.publish(job.reply_to, wire.encode_json(chunk), reply=probe)

    async def _prompt_logprobs(self, running: RunningJob, answer: Answer) -> list:
        """The prompt's logprobs, for the first chunk: our engine's when local, else
        prefill's (in the job in pull; passed on by the scheduler in push, waited for)."""
        report = answer.local_prompt if running.job.mode == "local" else \
            await running.prompt_report(PROMPT_LOGPROBS_WAIT_S)
        if report is None or report.logprobs is None:
            raise EngineFailed(f"the prompt logprobs computed with the prompt did not reach decode within "
                               f"{PROMPT_LOGPROBS_WAIT_S:g} s")
        return report.logprobs

    async def _fail(self, running: RunningJob, span, exc: Exception) -> bytes:
        job: wire.DecodeJob = running.job
        if not isinstance(exc, KvpushError):
            log.exception("decode failed")
            exc = EngineFailed(f"decode failed: {exc}")
        error = to_error_body(exc)
        span.set_status(Status(StatusCode.ERROR, error.message))
        span.set_attribute(A.ERROR_CODE, error.code)
        instruments().failures.add(1, {"reason": error.code})
        instruments().requests.add(1, {"outcome": "error"})
        if not await self._claim(running):
            return b""
        return await self._send_final(job, wire.ErrorReply(job.request_id, error))

    async def _finish(self, running: RunningJob, received_ns: int, span, answer: Answer) -> bytes:
        job: wire.DecodeJob = running.job
        timings = answer.timings(time.time())
        _record_timings(answer, timings, received_ns, span)
        # The prompt's report from the engine that computed it: ours when local, else prefill's,
        # which in push may still be on its way (a short wait; unknown is not reported as a number).
        prefill = None if job.mode == "local" else await running.prompt_report(PROMPT_REPORT_WAIT_S)
        path = answer.path(self.worker.worker_id, prefill)
        metrics = instruments()
        metrics.paths.add(1, {"mode": path.mode, "chosen_by": path.chosen_by})
        metrics.recomputed_tokens.add(path.recomputed_tokens, {"mode": path.mode})
        span.set_attributes(path_attributes(path))
        data = await self._send_final(job, answer.final(timings, prefill, path))
        log.info("request finished", transfer_id=job.transfer_id, completion_tokens=answer.completion_tokens,
                 ttft_ms=round(timings.ttft_ms, 1), finish_reason=answer.finish_reason)
        return data


def _engine_sampling(job: wire.DecodeJob) -> dict:
    """vLLM's SamplingParams keywords for the request (a reprefill migration's shrunk by
    the tokens sent), its structured output made vLLM's."""
    kwargs = continuation.resumed_sampling(sampling_params_kwargs(job.sampling), job.resume)
    structured = kwargs.pop("structured_outputs", None)
    if job.sampling.tool_calling is not None:  # as vLLM's server constrains a request with tools
        structured = tool_calling.structured_outputs(job.sampling.tool_calling, structured)
        kwargs["skip_special_tokens"] = False  # its hermes parser's adjustment: the call tags stay in the text
    if structured is not None:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
    return kwargs


def _engine_requests(job: wire.DecodeJob, engine_request_id: str, kv_params: dict, kwargs: dict) -> tuple:
    """(answer 0's engine request, the n - 1 others'), each (request id, SamplingParams)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    replayed = continuation.replayed_tokens(job.resume)  # a migrated request's tokens sent, replayed
    # Prompt logprobs come from the engine that computes the prompt: ours only when local
    # (a migrated request's client has them already).
    prompt_logprobs = job.sampling.prompt_logprobs if job.mode == "local" and job.resume is None else None
    params = SamplingParams(
        **kwargs,
        prompt_logprobs=prompt_logprobs,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_params, **({wire.REPLAY_KEY: replayed} if replayed else {})},
    )
    # n > 1: the others are requests of this engine alone, seeded as vLLM's fan-out
    # seeds them; they find the prompt's KV in its prefix cache once the first has it.
    others = [(f"{job.request_id}-n{index}-{job.transfer_id[:8]}",
               SamplingParams(**answer_sampling(kwargs, index), output_kind=RequestOutputKind.DELTA,
                              extra_args={"kv_transfer_params": {}}))
              for index in range(1, job.sampling.n)]
    return (engine_request_id, params), others


def _record_timings(answer: Answer, timings: wire.Timings, received_ns: int, span) -> None:
    """The request's engine stages as spans, its timings on its span and in the metrics."""
    job = answer.job
    stages = EngineStages(answer.last, _tracer)
    local = job.mode == "local"  # no KV to wait for: it queued, then computed the prompt
    stages.record(A.DECODE_QUEUE if local else A.DECODE_WAIT_KV, received_ns, stages.scheduled_ns)
    stages.record(A.DECODE_FIRST_TOKEN, stages.scheduled_ns, stages.first_token_ns)
    stages.record(A.DECODE_GENERATE, stages.first_token_ns, stages.last_token_ns)
    span.set_attributes({A.TTFT_MS: timings.ttft_ms, A.COMPLETION_TOKENS: answer.completion_tokens,
                         A.CACHED_TOKENS: getattr(answer.last, "num_cached_tokens", None) or 0})
    metrics = instruments()
    metrics.ttft.record(timings.ttft_ms)
    metrics.e2e.record(timings.e2e_ms)
    if answer.answer_tokens > 1:
        metrics.tpot.record(timings.tpot_ms)
    metrics.ttft_stage.record((received_ns / 1e9 - job.received_at) * 1000, {"stage": "queue"})
    if stages.scheduled_ns is not None:
        metrics.ttft_stage.record((stages.scheduled_ns - received_ns) / 1e6,
                                  {"stage": "decode_queue" if local else "wait_kv"})
        if stages.first_token_ns is not None:
            metrics.ttft_stage.record((stages.first_token_ns - stages.scheduled_ns) / 1e6,
                                      {"stage": "first_token"})
    metrics.requests.add(1, {"outcome": "ok"})


def _not_ours(running: RunningJob) -> str:
    """The outcome of a job that sent nothing because it does not hold the answer's claim."""
    unknown = running.claim is not None and running.claim.state is ClaimState.UNKNOWN
    return wire.UNCLAIMED if unknown else "fenced"
