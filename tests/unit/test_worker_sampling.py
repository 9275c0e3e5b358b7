"""A request's sampling as vLLM's SamplingParams, and vLLM's logprobs as the wire's
(``kvpush.services.worker.sampling``), checked against vLLM's real classes."""

from __future__ import annotations

import json

import pytest

from kvpush.services.scheduler.validation import RequestValidator
from kvpush.services.worker.sampling import LOWEST_LOGPROB, sampling_params_kwargs, token_logprobs
from kvpush.shared import wire

VOCAB = 100
SAMPLING = dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5, frequency_penalty=-1.0,
                repetition_penalty=1.2, seed=7, min_tokens=2, logit_bias={"3": 5.0, "4": -250},
                allowed_token_ids=[3, 4, 5], bad_words=["zz"], stop_token_ids=[9], include_stop_str_in_output=True,
                logprobs=3)


def _spec(**fields) -> wire.SamplingSpec:
    validator = RequestValidator(lambda s: [ord(c) % VOCAB for c in s], VOCAB, 32)
    return validator.validate(json.dumps({"prompt": "hi", "max_tokens": 4, **fields}).encode()).sampling


def test_every_sampling_field_becomes_vllms_sampling_params_and_neutral_ones_stay_vllms_defaults():
    """The worker's mapping (services/worker/sampling.py) into vLLM's real SamplingParams:
    each field arrives under its own name, and nothing neutral overrides vLLM's default."""
    from vllm import SamplingParams

    spec = _spec(stop=["."], **SAMPLING)
    params = SamplingParams(**sampling_params_kwargs(spec))
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "min_tokens", "allowed_token_ids", "bad_words",
                 "include_stop_str_in_output", "max_tokens", "stop", "logprobs"):
        assert getattr(params, name) == getattr(spec, name), name
    assert params.logit_bias == {3: 5.0, 4: -100.0} and params.stop_token_ids == [9]
    plain = _spec(top_k=-1)
    assert sampling_params_kwargs(plain) == {"max_tokens": 4, "temperature": 0.0, "ignore_eos": False, "stop": None}
    defaults = SamplingParams(**sampling_params_kwargs(plain))
    assert (defaults.top_p, defaults.top_k, defaults.seed, defaults.logit_bias) == (1.0, 0, None, None)


@pytest.mark.parametrize("structured", [{"json": {"type": "object"}}, {"json": '{"type": "object"}'},
                                        {"regex": "[a-z]+"}, {"choice": ["a", "b"]}, {"grammar": "root ::= \"a\""},
                                        {"json_object": True, "disable_any_whitespace": True}])
def test_a_structured_output_becomes_vllms_structured_outputs_params(structured):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    spec = _spec(structured_outputs=structured)
    kwargs = sampling_params_kwargs(spec)
    params = SamplingParams(**{**kwargs, "structured_outputs": StructuredOutputsParams(**kwargs["structured_outputs"])})
    for name, value in structured.items():
        assert getattr(params.structured_outputs, name) == value


def test_vllms_logprobs_go_on_the_wire_in_its_order_with_infinity_as_its_server_writes_it():
    from vllm.logprobs import Logprob

    positions = [{7: Logprob(-0.5, rank=2, decoded_token="ab"), 3: Logprob(-0.25, rank=1, decoded_token="c")},
                 {1: Logprob(float("-inf"), rank=9, decoded_token="e")}, None]
    assert token_logprobs(positions) == [[wire.TokenLogprob(7, -0.5, 2, "ab"), wire.TokenLogprob(3, -0.25, 1, "c")],
                                         [wire.TokenLogprob(1, LOWEST_LOGPROB, 9, "e")], []]
    chunk = wire.TokenChunk("r", [7], "ab", logprobs=token_logprobs(positions[:1]))
    assert wire.decode_reply(wire.encode_json(chunk)) == chunk
