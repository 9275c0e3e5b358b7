"""A request's sampling (``wire.SamplingSpec``) as the keyword arguments of vLLM's
``SamplingParams``: what decode (or a local request's engine) samples the answer with.

Pure: no vLLM import; ``kvpush.services.worker.decode`` adds what is its own (the output
kind, the connector's ``kv_transfer_params``). The names are vLLM's, so this is a
one-to-one copy that leaves out what is neutral: a field vLLM does not know is a test
failure here, not a request that fails on the engine.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpush.shared import wire

# Neutral values: left out, so the engine applies its own default.
_NEUTRAL: dict[str, Any] = {"logprobs": None, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                            "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": None, "min_tokens": 0,
                            "include_stop_str_in_output": False}
_LISTS = ("allowed_token_ids", "bad_words", "stop_token_ids")


def sampling_params_kwargs(spec: wire.SamplingSpec) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"max_tokens": spec.max_tokens, "temperature": spec.temperature,
                              "ignore_eos": spec.ignore_eos, "stop": list(spec.stop) or None}
    for name, neutral in _NEUTRAL.items():
        value = getattr(spec, name)
        if value != neutral:
            kwargs[name] = value
    if spec.top_k == -1:
        kwargs.pop("top_k")  # vLLM's old spelling of "every token"
    if spec.logit_bias:
        kwargs["logit_bias"] = dict(spec.logit_bias)
    for name in _LISTS:
        if getattr(spec, name):
            kwargs[name] = list(getattr(spec, name))
    if spec.structured_outputs is not None:  # the caller makes vLLM's StructuredOutputsParams of it
        kwargs["structured_outputs"] = msgspec.structs.asdict(spec.structured_outputs)
        kwargs["structured_outputs"] = {k: v for k, v in kwargs["structured_outputs"].items()
                                        if v is not None and v is not False}
    return kwargs


def answer_sampling(kwargs: dict[str, Any], index: int) -> dict[str, Any]:
    """Answer ``index``'s of a request's n: what vLLM's own fan-out (``ParentRequest``)
    gives its child ``index``, the seed plus the index when there is a seed."""
    if kwargs.get("seed") is None or index == 0:
        return dict(kwargs)
    return {**kwargs, "seed": kwargs["seed"] + index}


LOWEST_LOGPROB = -9999.0  # what vLLM's server writes for -inf (JSON has no infinity)


def token_logprobs(positions) -> list[list[wire.TokenLogprob]]:
    """vLLM's logprobs of new tokens (one ``{token id: Logprob}`` per token, in its order)
    as the wire's."""
    return [[wire.TokenLogprob(token_id, max(lp.logprob, LOWEST_LOGPROB), lp.rank, lp.decoded_token)
             for token_id, lp in (position or {}).items()] for position in positions]


def prompt_report(output) -> wire.PromptReport:
    """What vLLM's output for a computed prompt (a ``RequestOutput``) says of it: its
    prefix-cache hits, and its prompt logprobs if they were asked for (the first position
    None, as vLLM gives it)."""
    positions = getattr(output, "prompt_logprobs", None)
    return wire.PromptReport(
        cached_tokens=getattr(output, "num_cached_tokens", None) or 0,
        logprobs=None if positions is None else [token_logprobs([position])[0] if position else None
                                                 for position in positions])
