"""The conformance harness's pure parts (tools/conformance): answers made comparable,
streamed ones gathered, differences named; the single vllm serve's flags from kvpush's
own engine arguments; the table's rows well formed."""

from __future__ import annotations

import argparse

import pytest

from kvpush.tools.conformance import compare
from kvpush.tools.conformance.run import Reply, judge, request_body, table
from kvpush.tools.conformance.single import serve_flags
from kvpush.tools.conformance.table import MODES, ROWS, Row

ROW = Row("logprobs", "completions", {"max_tokens": 2, "logprobs": 2})


def completion(text="ab", ids=(5, 6), finish="length", lp=(-0.5, -1.0), cached=None) -> dict:
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"choices": [{"index": 0, "text": text, "token_ids": list(ids), "finish_reason": finish,
                         "logprobs": {"tokens": ["a", "b"], "token_logprobs": list(lp), "text_offset": [0, 1],
                                      "top_logprobs": [{"a": lp[0], "x": -2.0}, {"b": lp[1], "y": -3.0}]}}],
            "usage": usage}


def diff(expected: dict, got: dict, **kwargs) -> list[str]:
    return compare.differences(compare.answer("completions", expected), compare.answer("completions", got), **kwargs)


def test_equal_answers_have_no_differences_and_logprobs_may_differ_by_the_tolerance():
    assert diff(completion(), completion()) == []
    assert diff(completion(), completion(lp=(-0.5 + 9e-5, -1.0))) == []
    assert diff(completion(), completion(lp=(-0.5 + 2e-4, -1.0))) == [
        "logprob 0: -0.4998, not -0.5", "top logprobs 0: values differ by more than 0.0001"]


def test_each_difference_is_named():
    found = diff(completion(), completion(text="ac", ids=(5, 7), finish="stop"))
    assert found == ["token ids [5, 7], not [5, 6]", "text 'ac', not 'ab'", "finish_reason 'stop', not 'length'"]
    no_logprobs = completion()
    no_logprobs["choices"][0]["logprobs"] = None
    assert diff(completion(), no_logprobs) == ["logprobs missing"]


def test_cached_tokens_count_only_where_the_row_asks():
    assert diff(completion(cached=48), completion()) == []
    assert diff(completion(cached=48), completion(), compare_cached=True) == ["usage cached_tokens None, not 48"]
    assert diff(completion(cached=48), completion(cached=48), compare_cached=True) == []


def test_prompt_logprobs_and_prompt_token_ids_are_compared_as_logprobs_are():
    def with_prompt(logprob: float, ids=(9, 5)) -> dict:
        body = completion()
        body["choices"][0]["prompt_token_ids"] = list(ids)
        body["choices"][0]["prompt_logprobs"] = [None, {"5": {"logprob": logprob, "rank": 1, "decoded_token": "b"}}]
        return body

    assert diff(with_prompt(-1.0), with_prompt(-1.0 + 5e-5)) == []
    assert diff(with_prompt(-1.0), with_prompt(-1.1)) == ["prompt logprobs 1: values differ by more than 0.0001"]
    assert diff(with_prompt(-1.0), with_prompt(-1.0, ids=(9, 6))) == ["prompt token ids [9, 6], not [9, 5]"]
    assert diff(with_prompt(-1.0), completion()) == ["prompt token ids None, not [9, 5]", "prompt logprobs missing"]


def test_a_streamed_chat_answer_gathers_into_the_whole_one():
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "he"}, "token_ids": [1],
                            "finish_reason": None, "logprobs": {"content": [{"token": "he", "logprob": -1.0,
                                                                             "top_logprobs": []}]}}]},
              {"choices": [{"index": 0, "delta": {"content": "y"}, "token_ids": [2], "finish_reason": "length",
                            "logprobs": {"content": [{"token": "y", "logprob": -2.0, "top_logprobs": []}]}}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}]
    gathered = compare.answer("chat", compare.gather("chat", events))
    whole = compare.answer("chat", {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hey"}, "token_ids": [1, 2],
                     "finish_reason": "length", "logprobs": {"content": [
                         {"token": "he", "logprob": -1.0, "top_logprobs": []},
                         {"token": "y", "logprob": -2.0, "top_logprobs": []}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    assert compare.differences(whole, gathered) == []
    assert gathered.choices[0].text == "hey" and gathered.usage["total_tokens"] == 5


def test_tool_calls_compare_by_name_and_parsed_arguments():
    def chat(arguments: str) -> compare.Answer:
        return compare.answer("chat", {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "content": None, "tool_calls": [{"function": {"name": "get_weather", "arguments": arguments}}]}}]})

    assert compare.differences(chat('{"city": "Oslo"}'), chat('{"city":"Oslo"}')) == []
    assert compare.differences(chat('{"city": "Oslo"}'), chat('{"city": "Paris"}')) != []


def test_the_judgement_names_who_refused():
    ok, refused = Reply(200, completion()), Reply(400, {"error": {"message": "'n': 2 is not supported"}})
    assert judge(ROW, "push", ok, ok).outcome == "equal"
    assert (judge(ROW, "push", ok, refused).outcome, judge(ROW, "push", ok, refused).detail) == \
        ("kvpush refuses", "400: 'n': 2 is not supported")
    assert judge(ROW, "pull", refused, refused).outcome == "both refuse"
    assert judge(ROW, "pull", refused, ok).outcome == "vllm refuses"
    broke = Reply(500, {"error": {"message": "496", "code": 500}})  # a stream broken off with an error event
    assert (judge(ROW, "pull", broke, ok).outcome, judge(ROW, "pull", broke, ok).detail) == ("vllm fails", "500: 496")
    assert judge(ROW, "pull", ok, broke).outcome == "kvpush fails"
    differs = judge(ROW, "local", ok, Reply(200, completion(text="zz")))
    assert differs.outcome == "differs" and "text 'zz'" in differs.detail
    markdown = table([judge(ROW, mode, ok, ok) for mode in MODES])
    assert markdown.splitlines()[2] == "| `logprobs` | completions | equal | equal | equal |"


def test_every_row_asks_for_its_token_ids_under_a_prompt_of_its_own():
    names = [row.field for row in ROWS]
    assert len(names) == len(set(names))
    for row in ROWS:
        body = request_body(row, "m", "salt-1")
        assert body["return_token_ids"] is (row.field != "echo: text"), row.field  # the one that compares text
        assert body["model"] == "m"
        prompt = body.get("prompt") or body["messages"][0]["content"]
        assert prompt.startswith("salt-1 ")
        assert None not in body.values()


def test_the_single_vllm_serve_gets_kvpush_engines_arguments_as_flags():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvpush.services.worker.engine import engine_kwargs
    from kvpush.services.worker.engine_settings import EngineSettings

    kwargs = engine_kwargs(EngineSettings(model="/models/m", role=None, engine_id="r", nats_url=None,
                                          max_model_len=1024, json_whitespace="none"))
    flags = serve_flags(kwargs)
    parser = make_arg_parser(FlexibleArgumentParser())
    parsed = parser.parse_args(["/models/m", *flags])
    assert parsed.max_model_len == 1024 and parsed.dtype == "float32" and parsed.enforce_eager
    assert parsed.enable_prefix_caching is kwargs["enable_prefix_caching"]
    if "enable_chunked_prefill" in kwargs:  # CPUs: prompts in one step, as kvpush's engines
        assert parsed.enable_chunked_prefill is False and parsed.max_num_batched_tokens == 2048
    assert parsed.structured_outputs_config.disable_any_whitespace is True
    assert parsed.logits_processors == kwargs["logits_processors"]  # a list: one value each, not its repr


def test_the_command_registers_without_importing_vllm():
    from kvpush.tools.conformance.cli import register_conformance

    parser = argparse.ArgumentParser()
    register_conformance(parser.add_subparsers())
    args = parser.parse_args(["conformance", "--kvpush-url", "http://k", "--vllm-url", "http://v", "--strict"])
    assert args.strict and args.modes == "push,pull,local"
    with pytest.raises(SystemExit):
        parser.parse_args(["conformance", "--json-whitespace", "tabs"])
