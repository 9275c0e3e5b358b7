"""How a request continues on another decode after its own was lost mid-stream, and
whether it can: the rules of a migration that the scheduler (``kvpush.services.scheduler.
migrations``, which does it) and the new decode (``kvpush.services.worker.decode``) share.

Two ways to resume (``wire.Continuation``):

- ``reprefill``: the new attempt's prompt is the original prompt plus every token the
  client has; prefill computes it and the new decode samples what follows. For a greedy
  request that is what a single engine does when given that longer prompt, the best any
  re-prefill can do (a prefill of k tokens and k decode steps may round differently).
  An unseeded sampled request has no exact continuation to keep: any sample is one.
- ``replay``: the prompt stays the original; the new decode's engine replays the tokens
  sent as its first outputs (``kvpush.services.worker.replay``), one step each, so what
  depends on the output so far is where it was: a seed's generator (one draw a step), a
  grammar (structured output, tool calls), stop strings spanning the break, penalties
  and bad words counted over the output. It costs a decode step per token sent.

Pure: no NATS, no vLLM.
"""

from __future__ import annotations

from kvpush.shared import wire


def continuation_of(sampling: wire.SamplingSpec) -> tuple[wire.Continuation, str]:
    """(how a request with this sampling resumes, why: what makes it replay)."""
    needs: list[str] = []
    if sampling.temperature > 0 and sampling.seed is not None:
        needs.append("a seed (its generator advances one draw a token)")
    if sampling.structured_outputs is not None or sampling.tool_calling is not None:
        needs.append("a grammar (structured output or tool calls)")
    if sampling.stop:
        needs.append("stop strings (one may span the break)")
    if sampling.presence_penalty or sampling.frequency_penalty:
        needs.append("penalties counted over the output")
    if sampling.bad_words:
        needs.append("bad words matched over the output")
    if needs:
        return "replay", "; ".join(needs)
    return "reprefill", "greedy or unseeded: the prompt plus the tokens sent is the whole state"


def why_not_migrate(sampling: wire.SamplingSpec, migrations: int, max_migrations: int,
                    sent_known: bool) -> str | None:
    """Why a request whose decode was lost mid-stream cannot continue elsewhere (None: it can)."""
    if migrations >= max_migrations:
        return f"it moved to another decode {migrations} times already (--max-migrations {max_migrations})"
    if sampling.n > 1:
        return "it asked for n > 1 answers, whose streams interleave: only a single answer is continued"
    if not sent_known:
        return ("this scheduler does not know every token its client has (it took the request over, or a "
                "token record was lost)")
    return None


def resumed_prompt(prompt: list[int], resume: wire.Resume | None) -> list[int]:
    """The prompt the attempt computes: with a reprefill continuation, the original and every token sent."""
    if resume is None or resume.continuation != "reprefill":
        return prompt
    return prompt + resume.token_ids


def resumed_sampling(sampling: dict, resume: wire.Resume | None) -> dict:
    """vLLM's SamplingParams keywords for the attempt's engine request. ``reprefill``: the
    tokens sent are prompt now, so the answer's budget and minimum shrink by them;
    ``replay``: as the request asked (the engine replays the tokens sent: ``replayed_tokens``)."""
    if resume is None or resume.continuation != "reprefill":
        return sampling
    sent = len(resume.token_ids)
    return {**sampling, "max_tokens": max(sampling["max_tokens"] - sent, 1),
            "min_tokens": max(sampling.get("min_tokens", 0) - sent, 0)}


def replayed_tokens(resume: wire.Resume | None) -> list[int]:
    """The tokens the engine replays as its first outputs (and decode does not send again)."""
    return list(resume.token_ids) if resume is not None and resume.continuation == "replay" else []
