"""One decode job's answer stream, kept apart from the I/O that carries it (as vLLM keeps a
request's output state, its ``RequestState``, apart from its engine loop).

What it keeps:

- what the client has (``kvpush.shared.stream.StreamSoFar``): the next chunk's seq, answer
  0's tokens and when the first went out; a migrated request's (``job.resume``) go on
  from what its client had;
- what the engine said (``saw``): each answer's finish reason, answer 0's last output
  (the connector's account of the KV, the engine's stage times), a local prompt's report,
  and what decode's prefix cache held when decode computed the prompt;
- with a replay continuation, how many of the engine's first outputs are the replayed
  tokens its client has: those are not sent again (``unreplayed``).

What it makes of them: each token chunk (``chunk``), the timings, the path report
(``kvpush.services.worker.path_report``) and the final.

Pure: no NATS, no vLLM, no asyncio. vLLM's outputs are read by attribute, as plain objects
(a ``RequestOutput``: ``outputs[0]``, ``num_cached_tokens``, ``kv_transfer_params``; a
``CompletionOutput``: ``token_ids``, ``text``, ``logprobs``, ``finish_reason``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from kvpush.services.worker import path_report
from kvpush.services.worker.sampling import prompt_report, token_logprobs
from kvpush.shared import continuation, wire
from kvpush.shared.stream import StreamSoFar


class NewTokens(NamedTuple):
    """What an output adds to its answer: tokens, their text, and vLLM's logprobs of them."""

    token_ids: list[int]
    text: str
    logprobs: list | None


class Answer:
    """The stream of one decode job's answers (with n > 1, all of them)."""

    def __init__(self, job: wire.DecodeJob, worker_kv_policy: str = "recompute"):
        self.job = job
        self.so_far = StreamSoFar.resuming(job.resume)
        self.completion_tokens = len(self.so_far.tokens)  # of every answer
        self.finish_reasons: dict[int, str] = {}  # each answer's, by index
        self.last: Any = None  # vLLM's last RequestOutput of answer 0 (the one the KV came for)
        self.local_prompt: wire.PromptReport | None = None  # local: what our own engine said of the prompt
        # What it does if the prompt's KV does not arrive intact: the request's policy,
        # unless the worker runs ``--on-kv-failure fail``.
        self.kv_policy = path_report.effective_policy(job.kv_policy, worker_kv_policy)
        self.computed_here = False  # our engine computes the prompt (local, or after a failed transfer)
        self.cached_here: int | None = None  # then: what our prefix cache held of it
        self.sent_here = False  # this job sent a chunk (a migrated one continues another's stream)
        self._replayed = continuation.replayed_tokens(job.resume)
        self.replay_left = len(self._replayed)  # the engine's outputs still to come that replay them

    @property
    def finish_reason(self) -> str | None:
        """Answer 0's."""
        return self.finish_reasons.get(0)

    @property
    def answer_tokens(self) -> int:
        """Answer 0's tokens its client has (its TPOT counts them)."""
        return len(self.so_far.tokens)

    @property
    def prompt_tokens(self) -> int:
        """The request's prompt (a reprefill migration computes the tokens sent as prompt
        too: they count as completion, not prompt)."""
        resume = self.job.resume
        if resume is not None and resume.continuation == "reprefill":
            return len(self.job.prompt_token_ids) - len(resume.token_ids)
        return len(self.job.prompt_token_ids)

    def saw(self, index: int, output: Any, computing: bool) -> None:
        """Answer ``index``'s engine output, before its tokens are sent: its finish
        reason, and of answer 0 what the final and the path report need (``computing``:
        our engine computes the prompt and has produced no token yet)."""
        completion = output.outputs[0]
        if completion.finish_reason is not None:
            self.finish_reasons[index] = completion.finish_reason
        if index != 0:
            return
        self.last = output
        if self.job.mode == "local" and self.local_prompt is None:
            self.local_prompt = prompt_report(output)
        if computing and self.cached_here is None:
            self.cached_here = output.num_cached_tokens or 0

    def unreplayed(self, index: int, completion: Any, detokenize: Callable[[list[int]], str]) -> NewTokens:
        """An output's tokens, text and logprobs less what the engine replayed (a migrated
        request's tokens its client has). When the engine's outputs coalesce steps (its
        consumer was slow), one may straddle the end of the replay; the engine does not
        say which characters came from which token, so the new tokens' text is the text
        of all the tokens less that of the replayed ones (``detokenize``)."""
        token_ids, logprobs = list(completion.token_ids), completion.logprobs
        if index != 0 or not self.replay_left:
            return NewTokens(token_ids, completion.text, logprobs)
        replayed = min(self.replay_left, len(token_ids))
        self.replay_left -= replayed
        if replayed == len(token_ids):
            return NewTokens([], "", None)
        new = token_ids[replayed:]
        before = detokenize(self._replayed)
        after = detokenize(self._replayed + new)
        text = after[len(before):] if after.startswith(before) else completion.text
        return NewTokens(new, text, None if logprobs is None else logprobs[replayed:])

    def prompt_logprobs_due(self, index: int) -> bool:
        """Answer ``index``'s next chunk is answer 0's first of a request that asked for
        the prompt's logprobs: it carries them (a migrated request's client has them)."""
        return (index == 0 and not self.so_far.tokens and self.job.resume is None
                and self.job.sampling.prompt_logprobs is not None)

    def chunk(self, index: int, new: NewTokens, now_wall: float) -> wire.TokenChunk:
        """Answer ``index``'s next chunk, counted as sent (its seq follows the last one's)."""
        seq = self.so_far.chunks
        self.so_far.add(seq, index, new.token_ids, now_wall)
        self.completion_tokens += len(new.token_ids)
        self.sent_here = True
        return wire.TokenChunk(self.job.request_id, new.token_ids, new.text, seq=seq, index=index,
                               logprobs=None if new.logprobs is None else token_logprobs(new.logprobs))

    def recomputes_lost_kv(self) -> bool:
        """The prompt's KV did not arrive: compute the prompt here (nothing was sent, and
        the policy allows it), or fail."""
        return not self.sent_here and self.kv_policy != "fail"

    def kv_failed_message(self) -> str:
        """Why the request failed when its prompt's KV did not arrive."""
        if self.so_far.chunks:
            return "the prompt's KV cache was found lost after tokens went out"
        why = "the request's kv_policy is fail" if self.job.kv_policy == "fail" else \
            "this decode worker fails such requests whatever they ask (--on-kv-failure fail)"
        return (f"the prompt's KV cache did not arrive intact from prefill (its transfer failed or timed out, or "
                f"it differed from prefill's checksum), and {why}; nothing was recomputed")

    def timings(self, done: float) -> wire.Timings:
        """Its timings, the last token sent at ``done`` (wall clock): TTFT from the
        request's arrival at a scheduler, TPOT over answer 0's tokens."""
        first_at = self.so_far.first_token_at or done
        tokens = self.answer_tokens
        return wire.Timings(ttft_ms=(first_at - self.job.received_at) * 1000,
                            tpot_ms=(done - first_at) / (tokens - 1) * 1000 if tokens > 1 else 0.0,
                            e2e_ms=(done - self.job.received_at) * 1000)

    def path(self, worker_id: str, prefill: wire.PromptReport | None) -> wire.PathReport:
        """The request's path report (``prefill``: prefill's report on the prompt, if it came)."""
        said = getattr(self.last, "kv_transfer_params", None)  # our connector's, in the last output
        local = self.job.mode == "local"
        saw = path_report.DecodeSaw(
            received=None if self.computed_here else path_report.received_of(said),
            computed_here=self.computed_here, cached_here=self.cached_here,
            kv_failure=path_report.load_failure_of(said) if self.computed_here and not local else None)
        return path_report.path_report(self.job, worker_id, saw, self.kv_policy, prefill)

    def final(self, timings: wire.Timings, prefill: wire.PromptReport | None,
              path: wire.PathReport | None) -> wire.FinalReply:
        """The final: usage, timings, the chunks sent, each answer's finish reason with
        n > 1. Its cached tokens are the computing engine's (ours when local, else
        prefill's: unknown when its report did not come)."""
        computing_engine = self.local_prompt if self.job.mode == "local" else prefill
        n = self.job.sampling.n
        return wire.FinalReply(
            request_id=self.job.request_id,
            finish_reason=self.finish_reason,
            usage=wire.Usage(self.prompt_tokens, self.completion_tokens,
                             cached_tokens=None if computing_engine is None else computing_engine.cached_tokens),
            timings=timings,
            chunks=self.so_far.chunks,
            finish_reasons=[self.finish_reasons.get(i) for i in range(n)] if n > 1 else None,
            path=path,
        )
