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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvpush.otel import attributes as A
from kvpush.otel.attributes import path_attributes
from kvpush.otel.messaging import TEMPORARY, current_traceparent
from kvpush.otel.metrics import instruments
from kvpush.services.ledger import Claims, ClaimState
from kvpush.services.worker.engine import EngineStages, decode_request, wake_engine
from kvpush.services.worker import path_report, tool_calling
from kvpush.services.worker.jobs import RunningJob, WorkerContext
from kvpush.services.worker.prompt_meter import PromptMeter
from kvpush.services.worker.sampling import answer_sampling, prompt_report, sampling_params_kwargs, token_logprobs
from kvpush.shared import continuation, wire
from kvpush.shared.errors import EngineFailed, InvalidField, KvTransferFailed, KvpushError, StreamLost, to_error_body

log = structlog.get_logger("kvpush.worker")
# Push: prefill's report on the prompt comes through the scheduler, after the handoff; decode
# may be done first. The first chunk of a request with prompt logprobs waits for it;
# the final waits a little for its cached-token count, then says it is unknown.
PROMPT_LOGPROBS_WAIT_S = 30.0
PROMPT_REPORT_WAIT_S = 2.0
_tracer = trace.get_tracer("kvpush.worker")


@dataclass
class _Stream:
    """What one decode request has sent so far."""

    first_at: float | None = None
    completion_tokens: int = 0  # of all answers
    first_answer_tokens: int = 0  # of the first (its TPOT)
    chunks: int = 0  # token chunks sent; the next one's seq
    finish_reason: str | None = None  # the first answer's
    finish_reasons: dict[int, str] = field(default_factory=dict)  # each answer's, by index (n > 1)
    last: object = None  # vLLM's last RequestOutput of the first answer (the one the KV came for)
    local_prompt: wire.PromptReport | None = None  # local: what our own engine said of the prompt
    kv_policy: str = "recompute"  # what it does if the prompt's KV does not arrive intact
    computed_here: bool = False  # our engine computed the prompt (local, or after a failed transfer)
    cached_here: int | None = None  # then: what our prefix cache held of it
    sent_here: bool = False  # this job sent a chunk (a migrated one continues another's stream)
    replay_left: int = 0  # outputs the engine replays (a migrated request's tokens sent): not sent again

    @classmethod
    def resuming(cls, resume: wire.Resume | None) -> "_Stream":
        """What the client has already: nothing, or a migrated request's chunks and tokens."""
        if resume is None:
            return cls()
        sent = len(resume.token_ids)
        return cls(first_at=resume.first_token_at, completion_tokens=sent, first_answer_tokens=sent,
                   chunks=resume.chunks, replay_left=len(continuation.replayed_tokens(resume)))


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
        self._probes: dict[str, str] = {}  # probe key -> transfer id
        self._probe_prefix = ""
        self.claims: Claims | None = None
        self.meter = PromptMeter()  # of the prompts it computes itself (local)

    def heartbeat_fields(self) -> dict:
        """Of the prompts it computes itself (local): what it holds and how fast it computes."""
        return {"queued_prompt_tokens": self.meter.queued_tokens, "prefill_tokens_per_s": self.meter.tokens_per_s}

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
            if running.claimed and running.cancel_error is not None:  # we answer, so we say why it ended
                final = await self._send_final(job, wire.ErrorReply(job.request_id, running.cancel_error))
        finally:
            self._probes.pop(probe_key, None)
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

    async def _tokens_sent(self, job: wire.DecodeJob, chunk: wire.TokenChunk) -> None:
        record = wire.TokensSent(request_id=job.request_id, transfer_id=job.transfer_id,
                                 worker_id=self.worker.worker_id, seq=chunk.seq, token_ids=chunk.token_ids,
                                 index=chunk.index)
        await self.worker.bus.nc.publish(wire.TOKENS_SENT(sender=self.worker.worker_id), wire.encode(record))

    async def _decode(self, running: RunningJob, received_ns: int, span, probe: str) -> tuple[str, bytes]:
        """(outcome, the final sent to the client or b"")."""
        job: wire.DecodeJob = running.job
        stream = _Stream.resuming(job.resume)
        try:
            await self._stream(running, stream, probe)
        except asyncio.CancelledError:
            raise
        except _Fenced:
            log.info("a scheduler answers this attempt (or JetStream cannot say); stopped without a word "
                     "to the client", transfer_id=job.transfer_id)
            return _not_ours(running), b""
        except Exception as exc:
            return "error", await self._fail(running, span, exc)
        if not await self._claim(running):
            return _not_ours(running), b""
        return "ok", await self._finish(running, received_ns, span, stream)

    async def _stream(self, running: RunningJob, stream: _Stream, probe: str) -> None:
        """Generate and send each chunk as it comes; if the prompt's KV does not arrive,
        compute the prompt here or fail, per the request's kv_policy."""
        job: wire.DecodeJob = running.job
        engine_request_id, kv_params = decode_request(self.worker.connector, job, current_traceparent())
        kwargs = continuation.resumed_sampling(sampling_params_kwargs(job.sampling), job.resume)
        structured = kwargs.pop("structured_outputs", None)
        if job.sampling.tool_calling is not None:  # as vLLM's server constrains a request with tools
            structured = tool_calling.structured_outputs(job.sampling.tool_calling, structured)
            kwargs["skip_special_tokens"] = False  # its hermes parser's adjustment: the call tags stay in the text
        if structured is not None:
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
        stream.kv_policy = path_report.effective_policy(job.kv_policy, self.worker.settings.faults.on_kv_failure)
        computing = job.mode == "local"  # the prompt is ours to compute
        while True:
            try:
                await self._generate(running, stream, probe, engine_request_id, kv_params, kwargs, computing)
                return
            except _KvNotArrived:
                if stream.sent_here or stream.kv_policy == "fail":
                    instruments().kv_fallbacks.add(1, {"outcome": "failed"})
                    raise KvTransferFailed(_kv_failed_message(job.kv_policy, stream.chunks)) from None
            # Recompute: nothing was sent; the same request, its prompt computed here.
            log.warning("the prompt's KV did not arrive: computing it here", transfer_id=job.transfer_id,
                        request_id=job.request_id)
            instruments().kv_fallbacks.add(1, {"outcome": "recomputed"})
            computing = True
            # Our connector tells this request's last output why the first one's load failed.
            engine_request_id, kv_params = f"{engine_request_id}-r", {wire.RECOMPUTE_OF_KEY: engine_request_id}

    async def _generate(self, running: RunningJob, stream: _Stream, probe: str, engine_request_id: str,
                        kv_params: dict, kwargs: dict, computing: bool) -> None:
        """One engine request (and its n - 1 others): with the prompt's KV from prefill
        (``kv_params``), or computing the prompt here."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        job: wire.DecodeJob = running.job
        stream.computed_here = computing
        replayed = continuation.replayed_tokens(job.resume)
        skip_special = kwargs.get("skip_special_tokens", True)

        def detokenize(token_ids: list[int]) -> str:
            return self.worker.engine.tokenizer.decode(token_ids, skip_special_tokens=skip_special)

        # Prompt logprobs come from the engine that computes the prompt: ours only when local
        # (a migrated request's client has them already).
        prompt_logprobs = job.sampling.prompt_logprobs if job.mode == "local" and job.resume is None else None
        params = SamplingParams(
            **kwargs,
            prompt_logprobs=prompt_logprobs,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": kv_params, **_replay_args(job.resume)},
        )
        # n > 1: the others are requests of this engine alone, seeded as vLLM's fan-out
        # seeds them; they find the prompt's KV in its prefix cache once the first has it.
        others = [(f"{job.request_id}-n{index}-{job.transfer_id[:8]}",
                   SamplingParams(**answer_sampling(kwargs, index), output_kind=RequestOutputKind.DELTA,
                                  extra_args={"kv_transfer_params": {}}))
                  for index in range(1, job.sampling.n)]
        prompt_tokens = len(job.prompt_token_ids)
        if computing:
            self.meter.started(prompt_tokens, time.monotonic())
        try:
            wake_engine(self.worker.settings)
            # Closed on the way out, whatever ends the loop: the other answers' engine requests are
            # aborted at once, not whenever the generator is collected.
            answers = self._answers(job, engine_request_id, params, others)
            async with contextlib.aclosing(answers):
                async for index, output in answers:
                    completion = output.outputs[0]
                    if completion.finish_reason is not None:
                        stream.finish_reasons[index] = completion.finish_reason
                    if index == 0:
                        stream.last = output
                        stream.finish_reason = stream.finish_reasons.get(0)
                        if job.mode == "local" and stream.local_prompt is None:
                            stream.local_prompt = prompt_report(output)
                        if computing and stream.cached_here is None:
                            stream.cached_here = output.num_cached_tokens or 0
                    # vLLM ended it: the KV did not come (our connector runs vLLM's policy "fail")
                    if completion.finish_reason == "error" and not computing:
                        raise _KvNotArrived()
                    if not completion.token_ids:
                        continue
                    if computing:
                        computing = False
                        self.meter.finished(prompt_tokens, time.monotonic())
                    token_ids, text, logprobs = _unreplayed(stream, index, completion, replayed, detokenize)
                    if not token_ids:
                        continue  # replayed: its client has it
                    if not stream.sent_here:
                        if not await self._claim(running):
                            raise _Fenced(job.transfer_id)
                        stream.sent_here = True
                        if stream.first_at is None:
                            stream.first_at = time.time()
                        running.streaming = True
                    stream.completion_tokens += len(token_ids)
                    if index == 0:
                        stream.first_answer_tokens += len(token_ids)
                    chunk = wire.TokenChunk(job.request_id, token_ids, text, seq=stream.chunks,
                                            logprobs=None if logprobs is None else token_logprobs(logprobs),
                                            index=index)
                    if index == 0 and stream.first_answer_tokens == len(token_ids) and job.resume is None \
                            and job.sampling.prompt_logprobs is not None:  # the first answer's first chunk
                        chunk.prompt_logprobs = await self._prompt_logprobs(running, stream)
                    stream.chunks += 1
                    # Before the chunk, on the same connection: the schedulers learn of every
                    # token no later than the client sees it (a migration resumes after it).
                    await self._tokens_sent(job, chunk)
                    # Token chunks are not traced one by one; the final reply is. The reply
                    # subject hears "no responders" if the client has gone.
                    await self.worker.bus.nc.publish(job.reply_to, wire.encode_json(chunk), reply=probe)
        except (ValueError, VLLMValidationError) as exc:  # vLLM's input checks: nothing was generated
            if stream.last is not None:
                raise
            raise InvalidField(f"the decode engine refused the request: {exc}") from exc
        finally:
            if computing:
                self.meter.finished(prompt_tokens, time.monotonic(), computed=False)

    async def _prompt_logprobs(self, running: RunningJob, stream: _Stream) -> list:
        """The prompt's logprobs, for the first chunk: our engine's when local, else
        prefill's (in the job in pull; passed on by the scheduler in push, waited for)."""
        report = stream.local_prompt if running.job.mode == "local" else \
            await running.prompt_report(PROMPT_LOGPROBS_WAIT_S)
        if report is None or report.logprobs is None:
            raise EngineFailed(f"the prompt logprobs computed with the prompt did not reach decode within "
                               f"{PROMPT_LOGPROBS_WAIT_S:g} s")
        return report.logprobs

    async def _answers(self, job: wire.DecodeJob, engine_request_id: str, params, others: list
                       ) -> AsyncIterator[tuple[int, Any]]:
        """(answer index, vLLM's output) as the engine makes them: the first answer, whose
        request carries the connector's KV, and with n > 1 the others, started once the
        first has produced a token (the prompt's KV is then in the engine's prefix cache;
        a local request starts them at once, as vLLM's own fan-out does, unless answer 0's
        first chunk must carry the prompt's logprobs)."""
        prompt = {"prompt_token_ids": job.prompt_token_ids}
        if not others:
            async for output in self.worker.engine.generate(prompt, params, request_id=engine_request_id):
                yield 0, output
            return
        outputs: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []

        async def feed(index: int, request_id: str, answer_params) -> None:
            try:
                async for output in self.worker.engine.generate(prompt, answer_params, request_id=request_id):
                    outputs.put_nowait((index, output))
            except Exception as exc:  # to the consumer, which raises it
                outputs.put_nowait((index, exc))
                return
            outputs.put_nowait((index, None))

        def start_others() -> None:
            for index, (request_id, answer_params) in enumerate(others, start=1):
                tasks.append(asyncio.create_task(feed(index, request_id, answer_params)))

        tasks.append(asyncio.create_task(feed(0, engine_request_id, params)))
        # Local: at once, as vLLM's fan-out; but a request with prompt logprobs waits, so that
        # answer 0's first chunk, which carries them, goes out before any other answer's.
        waiting_for_first = job.mode != "local" or job.sampling.prompt_logprobs is not None
        if not waiting_for_first:
            start_others()
        running = len(tasks) if waiting_for_first else 1 + len(others)
        try:
            while running:
                index, item = await outputs.get()
                if isinstance(item, Exception):
                    raise item
                if waiting_for_first and index == 0 and (item is None or item.outputs[0].token_ids):
                    waiting_for_first = False
                    start_others()
                    running += len(others)
                if item is None:
                    running -= 1
                else:
                    yield index, item
        finally:  # cancelled, failed or done: vLLM aborts what still runs
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

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

    def _path(self, job: wire.DecodeJob, stream: _Stream, prefill: wire.PromptReport | None,
              span) -> wire.PathReport:
        """The request's path report, counted in the metrics and on the span."""
        said = getattr(stream.last, "kv_transfer_params", None)  # our connector's, in the last output
        received = None if stream.computed_here else path_report.received_of(said)
        failure = path_report.load_failure_of(said) if stream.computed_here and job.mode != "local" else None
        saw = path_report.DecodeSaw(received=received, computed_here=stream.computed_here,
                                    cached_here=stream.cached_here, kv_failure=failure)
        path = path_report.path_report(job, self.worker.worker_id, saw, stream.kv_policy, prefill)
        metrics = instruments()
        metrics.paths.add(1, {"mode": path.mode, "chosen_by": path.chosen_by})
        metrics.recomputed_tokens.add(path.recomputed_tokens, {"mode": path.mode})
        span.set_attributes(path_attributes(path))
        return path

    async def _finish(self, running: RunningJob, received_ns: int, span, stream: _Stream) -> bytes:
        job: wire.DecodeJob = running.job
        done = time.time()
        first_at = stream.first_at or done
        tokens = stream.completion_tokens
        stages = EngineStages(stream.last, _tracer)
        local = job.mode == "local"  # no KV to wait for: it queued, then computed the prompt
        stages.record(A.DECODE_QUEUE if local else A.DECODE_WAIT_KV, received_ns, stages.scheduled_ns)
        stages.record(A.DECODE_FIRST_TOKEN, stages.scheduled_ns, stages.first_token_ns)
        stages.record(A.DECODE_GENERATE, stages.first_token_ns, stages.last_token_ns)
        timings = wire.Timings(
            ttft_ms=(first_at - job.received_at) * 1000,
            tpot_ms=((done - first_at) / (stream.first_answer_tokens - 1) * 1000) if stream.first_answer_tokens > 1
            else 0.0,
            e2e_ms=(done - job.received_at) * 1000,
        )
        span.set_attributes({A.TTFT_MS: timings.ttft_ms, A.COMPLETION_TOKENS: tokens,
                             A.CACHED_TOKENS: getattr(stream.last, "num_cached_tokens", None) or 0})
        metrics = instruments()
        metrics.ttft.record(timings.ttft_ms)
        metrics.e2e.record(timings.e2e_ms)
        if stream.first_answer_tokens > 1:
            metrics.tpot.record(timings.tpot_ms)
        metrics.ttft_stage.record((received_ns / 1e9 - job.received_at) * 1000, {"stage": "queue"})
        if stages.scheduled_ns is not None:
            metrics.ttft_stage.record((stages.scheduled_ns - received_ns) / 1e6,
                                      {"stage": "decode_queue" if local else "wait_kv"})
            if stages.first_token_ns is not None:
                metrics.ttft_stage.record((stages.first_token_ns - stages.scheduled_ns) / 1e6,
                                          {"stage": "first_token"})
        metrics.requests.add(1, {"outcome": "ok"})
        # The prompt's report from the engine that computed it: ours when local, else prefill's,
        # which in push may still be on its way (a short wait; unknown is not reported as a number).
        prefill = None if local else await running.prompt_report(PROMPT_REPORT_WAIT_S)
        computing_engine = stream.local_prompt if local else prefill
        final = wire.FinalReply(
            request_id=job.request_id,
            finish_reason=stream.finish_reason,
            usage=wire.Usage(_prompt_tokens(job), tokens,
                             cached_tokens=computing_engine.cached_tokens if computing_engine is not None else None),
            timings=timings,
            chunks=stream.chunks,
            finish_reasons=[stream.finish_reasons.get(i) for i in range(job.sampling.n)] if job.sampling.n > 1
            else None,
            path=self._path(job, stream, prefill, span),
        )
        data = await self._send_final(job, final)
        log.info("request finished", transfer_id=job.transfer_id, completion_tokens=tokens,
                 ttft_ms=round(timings.ttft_ms, 1), finish_reason=stream.finish_reason)
        return data


def _kv_failed_message(requested: str, chunks: int) -> str:
    if chunks:
        return "the prompt's KV cache was found lost after tokens went out"
    why = "the request's kv_policy is fail" if requested == "fail" else \
        "this decode worker fails such requests whatever they ask (--on-kv-failure fail)"
    return (f"the prompt's KV cache did not arrive intact from prefill (its transfer failed or timed out, or it "
            f"differed from prefill's checksum), and {why}; nothing was recomputed")


def _replay_args(resume: wire.Resume | None) -> dict:
    """A migrated request's extra_args for the engine: the tokens it replays, if any."""
    replayed = continuation.replayed_tokens(resume)
    return {wire.REPLAY_KEY: replayed} if replayed else {}


def _unreplayed(stream: _Stream, index: int, completion, replayed_tokens: list[int],
                detokenize: Callable[[list[int]], str]) -> tuple[list[int], str, list | None]:
    """An output's tokens, text and logprobs less what the engine replayed (a migrated
    request's tokens its client has: ``replayed_tokens``). When the engine's outputs
    coalesce steps (its consumer was slow), one may straddle the end of the replay; the
    engine does not say which characters came from which token, so the new tokens' text
    is the text of all the tokens less that of the replayed ones (``detokenize``)."""
    token_ids, logprobs = list(completion.token_ids), completion.logprobs
    if index != 0 or not stream.replay_left:
        return token_ids, completion.text, logprobs
    replayed = min(stream.replay_left, len(token_ids))
    stream.replay_left -= replayed
    if replayed == len(token_ids):
        return [], "", None
    new = token_ids[replayed:]
    before = detokenize(replayed_tokens)
    after = detokenize(replayed_tokens + new)
    text = after[len(before):] if after.startswith(before) else completion.text
    return new, text, None if logprobs is None else logprobs[replayed:]


def _prompt_tokens(job: wire.DecodeJob) -> int:
    """The request's prompt (a reprefill migration computes the tokens sent as prompt too)."""
    resume = job.resume
    if resume is not None and resume.continuation == "reprefill":
        return len(job.prompt_token_ids) - len(resume.token_ids)
    return len(job.prompt_token_ids)


def _not_ours(running: RunningJob) -> str:
    """The outcome of a job that sent nothing because it does not hold the answer's claim."""
    unknown = running.claim is not None and running.claim.state is ClaimState.UNKNOWN
    return wire.UNCLAIMED if unknown else "fenced"
