"""A request's sampling as vLLM's SamplingParams, and vLLM's logprobs as the wire's
(``kvpush.services.worker.sampling``), checked against vLLM's real classes."""

from __future__ import annotations

import json

import pytest

from kvpush.services.scheduler.validation import RequestValidator
from kvpush.services.worker.sampling import LOWEST_LOGPROB, prompt_report, sampling_params_kwargs, token_logprobs
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


def test_engines_on_cpus_keep_each_prompt_in_one_step_so_a_seed_never_needs_a_generator_offset():
    """vLLM rewinds a seeded generator after a step that computed part of a prompt; a CPU
    generator cannot rewind, so on CPUs kvpush's engines do not split prompts
    (``whole_prompt_steps``), with a budget vLLM accepts for the longest prompt."""
    import torch
    from vllm.config import SchedulerConfig

    from kvpush.services.worker.engine import engine_kwargs
    from kvpush.services.worker.engine_settings import EngineSettings, whole_prompt_steps

    with pytest.raises(RuntimeError, match="does not use offset"):
        torch.Generator(device="cpu").get_offset()  # why: what vLLM's rewind calls
    assert whole_prompt_steps(20480, on_cpu=False) == {}  # GPUs: vLLM's chunked prefill
    assert whole_prompt_steps(20480, on_cpu=True, emulated=True) == {}  # an emulated GPU too
    for length in (512, 2048, 20480):
        kwargs = whole_prompt_steps(length, on_cpu=True)
        assert kwargs["enable_chunked_prefill"] is False and kwargs["max_num_batched_tokens"] >= length
        SchedulerConfig(max_model_len=length, is_encoder_decoder=False, max_num_seqs=16, **kwargs)  # vLLM takes it
    on_this_machine = engine_kwargs(EngineSettings(model="/nonexistent", role=None, engine_id="x", nats_url=None))
    assert on_this_machine.get("enable_chunked_prefill", True) is torch.cuda.is_available()


def test_answer_i_of_n_is_sampled_as_vllms_own_fan_out_samples_its_child_i():
    """Decode starts a request's n answers itself (the first carries the KV); each must
    be sampled as vLLM's ParentRequest samples child i: its seed plus i."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.engine.parallel_sampling import ParentRequest

    from kvpush.services.worker.sampling import answer_sampling

    for seed in (7, None):
        kwargs = sampling_params_kwargs(_spec(temperature=0.8, top_p=0.9, n=4, **({} if seed is None else {"seed": seed})))
        parent = ParentRequest(SimpleNamespace(request_id="p", external_req_id="p",
                                               params=SamplingParams(n=4, **kwargs)))
        for index in range(4):
            _, child = parent.get_child_info(index)
            ours = SamplingParams(**answer_sampling(kwargs, index))
            assert (ours.seed, ours.temperature, ours.top_p, ours.n) == (child.seed, child.temperature, child.top_p, 1)


def test_what_vllm_says_of_a_computed_prompt_becomes_its_report_for_decode():
    """Prefill's (or a local decode's) RequestOutput: its prefix-cache hits, and its prompt
    logprobs with the first position empty (nothing precedes it), as vLLM gives them."""
    from vllm.logprobs import Logprob
    from vllm.outputs import RequestOutput

    positions = [None, {5: Logprob(-1.5, rank=4, decoded_token="b"), 2: Logprob(-0.1, rank=1, decoded_token="z")}]
    output = RequestOutput("r", None, [9, 5], positions, [], True, num_cached_tokens=16)
    report = prompt_report(output)
    assert report == wire.PromptReport(16, [None, [wire.TokenLogprob(5, -1.5, 4, "b"), wire.TokenLogprob(2, -0.1, 1, "z")]])
    plain = prompt_report(RequestOutput("r", None, [9, 5], None, [], True, num_cached_tokens=None))
    assert plain == wire.PromptReport(0, None)  # no logprobs asked; vLLM's None count is none cached
    assert "prompt_logprobs" not in sampling_params_kwargs(_spec(prompt_logprobs=2))  # decode adds it, when local


def test_tools_constrain_the_answer_as_vllms_server_constrains_it_for_the_hermes_parser():
    """vLLM's own builders: no constraint for ``auto`` with free arguments (the model may
    answer in text); the hermes call envelope for ``required`` and a named function; the
    arguments' schema only for a strict tool."""
    from kvpush.services.worker.tool_calling import structured_outputs

    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
    tools = [wire.ToolFunction("get_weather", "The weather", city), wire.ToolFunction("get_time")]
    assert structured_outputs(wire.ToolCalling("hermes", tools), None) is None
    assert structured_outputs(wire.ToolCalling("hermes", tools), {"json_object": True}) == {"json_object": True}
    required = json.loads(structured_outputs(wire.ToolCalling("hermes", tools, "required"), None)["structural_tag"])
    text = json.dumps(required)
    assert "<tool_call>" in text and "get_weather" in text and "get_time" in text
    assert '"Oslo"' not in text  # not strict: free arguments
    named = structured_outputs(wire.ToolCalling("hermes", tools, "function", "get_weather"), None)["structural_tag"]
    assert "get_weather" in named and "get_time" not in named
    strict = [wire.ToolFunction("get_weather", "The weather", city, strict=True)]
    held = structured_outputs(wire.ToolCalling("hermes", strict, "function", "get_weather"), None)["structural_tag"]
    assert "Oslo" in held  # the arguments' schema is in the grammar
    assert "Oslo" in structured_outputs(wire.ToolCalling("hermes", strict), None)["structural_tag"]  # auto, strict
