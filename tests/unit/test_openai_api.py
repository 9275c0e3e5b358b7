"""OpenAI request bodies as kvpush requests, replies as OpenAI objects, errors as HTTP
statuses (``kvpush.services.gateway.requests`` and ``responses``)."""

from __future__ import annotations

import pytest

from kvpush.services.gateway import requests, responses
from kvpush.shared import wire
from kvpush.shared.errors import EmptyPrompt, InvalidField, NotFound, http_status

MODEL = "small"


def test_a_completion_becomes_a_kvpush_request_with_openais_defaults():
    request = requests.parse("completion", {"model": MODEL, "prompt": "def f():"}, MODEL)
    assert request.generate == {"prompt": "def f():", "max_tokens": 16, "temperature": 1.0}
    assert not request.stream and request.messages is None


def test_token_ids_stop_ignore_eos_and_transfer_mode_pass_through():
    request = requests.parse("completion", {"prompt": [[1, 2, 3]], "stop": "\n", "ignore_eos": True,
                                              "transfer_mode": "pull", "max_tokens": 8, "temperature": 0,
                                              "stream": True, "stream_options": {"include_usage": True}}, MODEL)
    assert request.generate == {"prompt_token_ids": [1, 2, 3], "stop": ["\n"], "ignore_eos": True,
                                "transfer_mode": "pull", "max_tokens": 8, "temperature": 0.0}
    assert request.stream and request.include_usage


def test_what_vllm_bench_serve_sends_passes():
    for kind, body in [
        ("completion", {"model": MODEL, "prompt": "x", "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None,
                        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}),
        ("chat", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                  "max_completion_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}),
    ]:
        request = requests.parse(kind, body, MODEL)
        assert request.generate["max_tokens"] == 4


def test_a_chat_keeps_its_messages_for_the_template_and_prefers_max_completion_tokens():
    request = requests.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                                        "max_completion_tokens": 5}, MODEL)
    assert request.messages == [{"role": "user", "content": "hi"}]
    assert request.generate["max_tokens"] == 5
    assert "max_tokens" not in requests.parse("chat", {"messages": [{"role": "user", "content": "hi"}]},
                                                MODEL).generate  # as long as the context allows


@pytest.mark.parametrize("body, error, says", [
    ({"prompt": "x", "n": "2"}, InvalidField, "'n'"),
    ({"prompt": "x", "best_of": 3}, InvalidField, "'best_of'"),
    ({"prompt": "x", "logprobs": "5"}, InvalidField, "'logprobs'"),
    ({"prompt": "x", "echo": "yes"}, InvalidField, "'echo'"),
    ({"prompt": "x", "prompt_logprobs": 2, "stream": True}, InvalidField, "not available when 'stream'"),
    ({"prompt": "x", "prompt_logprobs": "2"}, InvalidField, "'prompt_logprobs'"),
    ({"prompt": "x", "wibble": 1}, InvalidField, "unknown field 'wibble'"),
    ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, InvalidField, "'tools'"),
    ({"prompt": ["a", "b"]}, InvalidField, "2 prompts"),
    ({"prompt": [1, "a"]}, InvalidField, "'prompt'"),
    ({"prompt": ""}, EmptyPrompt, "no prompt"),
    ({}, EmptyPrompt, "no prompt"),
    ({"prompt": "x", "max_tokens": 2.5}, InvalidField, "'max_tokens'"),
    ({"prompt": "x", "stop": 3}, InvalidField, "'stop'"),
    ({"prompt": "x", "stream": "yes"}, InvalidField, "'stream'"),
    ({"prompt": "x", "transfer_mode": "teleport"}, InvalidField, "transfer_mode"),
    ({"prompt": "x", "stream_options": {"continuous_usage_stats": True}}, InvalidField, "continuous_usage_stats"),
    ({"prompt": "x", "model": "gpt-4"}, NotFound, "'gpt-4'"),
    ([1, 2], InvalidField, "JSON object"),
], ids=lambda v: str(v)[:40])
def test_what_would_change_the_output_or_cannot_be_served_is_refused_with_a_sentence(body, error, says):
    with pytest.raises(error) as refused:
        requests.parse("completion", body, MODEL)
    assert says in refused.value.message


def test_neutral_values_and_fields_that_never_change_the_output_pass():
    body = {"prompt": "x", "n": 1, "top_p": 1.0, "top_k": -1, "frequency_penalty": 0, "presence_penalty": 0.0,
            "logprobs": None, "echo": False, "best_of": 1, "logit_bias": {}, "user": "me", "seed": 1,
            "temperature": 0}
    assert requests.parse("completion", body, MODEL).generate["prompt"] == "x"


def test_sampling_fields_go_on_the_wire_with_vllms_names_seed_with_temperature_too():
    body = {"prompt": "x", "temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 7,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "min_tokens": 3,
            "logit_bias": {"17": -100}, "allowed_token_ids": [5, 6], "bad_words": ["no"], "stop_token_ids": [2],
            "include_stop_str_in_output": True}
    generate = requests.parse("completion", body, MODEL).generate
    assert {k: v for k, v in generate.items() if k not in ("prompt", "max_tokens")} == \
        {k: v for k, v in body.items() if k != "prompt"}
    # and the scheduler's wire type takes them as they are
    decoded = wire.decode_json(wire.encode_json(generate), wire.GenerateRequest)
    assert decoded.logit_bias == {17: -100.0} and decoded.seed == 7 and decoded.top_p == 0.9


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"]}


@pytest.mark.parametrize("body, structured", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}}, {"json": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}}, {"json_object": True}),
], ids=["json_schema", "json_object", "text", "vllm-choice", "response_format-wins"])
def test_response_format_and_vllms_structured_outputs_constrain_the_answer(body, structured):
    generate = requests.parse("chat", {"messages": [{"role": "user", "content": "x"}], **body}, MODEL).generate
    assert generate.get("structured_outputs") == structured
    if structured is not None:  # the wire type takes it as it is
        decoded = wire.decode_json(wire.encode_json(generate | {"prompt": "x"}), wire.GenerateRequest)
        assert decoded.structured_outputs.kinds() == list(structured)


@pytest.mark.parametrize("response_format, says", [
    ({"type": "json_schema"}, "needs 'json_schema'"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "needs 'json_schema'"),
    ({"type": "grammar"}, "'grammar' is not supported"),
    ("json", "must be an object"),
])
def test_a_response_format_kvpush_cannot_serve_is_refused_with_a_sentence(response_format, says):
    with pytest.raises(InvalidField) as refused:
        requests.parse("completion", {"prompt": "x", "response_format": response_format}, MODEL)
    assert says in refused.value.message


def _candidates(*entries) -> list[wire.TokenLogprob]:
    return [wire.TokenLogprob(token_id, logprob, rank, token) for token_id, logprob, rank, token in entries]


def test_logprobs_are_asked_for_as_each_api_asks_and_written_as_vllms_server_writes_them():
    completion = requests.parse("completion", {"prompt": "x", "logprobs": 2}, MODEL)
    assert completion.logprobs == 2 and completion.generate["logprobs"] == 2
    chat = requests.parse("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                     "top_logprobs": 2}, MODEL)
    assert chat.logprobs == 2 and chat.generate["logprobs"] == 2
    assert requests.parse("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
                            MODEL).logprobs == 0
    with pytest.raises(InvalidField, match="needs 'logprobs': true"):
        requests.parse("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, MODEL)
    # two tokens; the engine lists the sampled token first, then the most likely ones
    positions = [_candidates((7, -0.5, 2, "ab"), (3, -0.25, 1, "c"), (9, -3.0, 3, "d")),
                 _candidates((3, -1.0, 1, "c"), (7, -2.0, 2, "ab"), (1, -4.0, 3, "e"))]
    whole = responses.logprobs_object(completion, [7, 3], positions, text_offset=5)
    assert whole == {"tokens": ["ab", "c"], "token_logprobs": [-0.5, -1.0], "text_offset": [5, 7],
                     "top_logprobs": [{"ab": -0.5, "c": -0.25, "d": -3.0}, {"c": -1.0, "ab": -2.0, "e": -4.0}]}
    content = responses.logprobs_object(chat, [7, 3], positions)["content"]
    assert [(c["token"], c["logprob"], c["bytes"]) for c in content] == [("ab", -0.5, [97, 98]), ("c", -1.0, [99])]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["ab", "c"]  # the first two, as vLLM's chat
    assert responses.logprobs_object(requests.parse("completion", {"prompt": "x"}, MODEL), [7], positions) is None


def test_a_chat_with_images_is_refused():
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    with pytest.raises(InvalidField, match="text only"):
        requests.parse("chat", body, MODEL)


def test_replies_are_openai_objects():
    request = requests.parse("chat", {"messages": [{"role": "user", "content": "hi"}]}, MODEL)
    final = wire.FinalReply("r1", "stop", wire.Usage(prompt_tokens=4, completion_tokens=2), wire.Timings(1.0, 1.0, 2.0))
    whole = responses.response(request, "r1", [responses.Answer("ok")], final)
    assert whole["object"] == "chat.completion" and whole["id"] == "chatcmpl-r1"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    assert whole["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    first = responses.chunk(request, "r1", "o", first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "o"}
    last = responses.chunk(request, "r1", "", "stop")
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert responses.usage_chunk(request, "r1", final)["choices"] == []


def test_n_answers_are_n_choices_each_with_its_own_finish_reason():
    request = requests.parse("completion", {"prompt": "x", "n": 3, "return_token_ids": True}, MODEL)
    assert request.n == 3 and request.generate["n"] == 3
    final = wire.FinalReply("r1", "length", wire.Usage(prompt_tokens=1, completion_tokens=5),
                            wire.Timings(1.0, 1.0, 2.0), finish_reasons=["length", "stop", "length"])
    whole = responses.response(request, "r1", [responses.Answer("ab", [1, 2]), responses.Answer("c", [3]),
                                                responses.Answer("de", [4, 5])], final)
    assert [(c["index"], c["text"], c["token_ids"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "ab", [1, 2], "length"), (1, "c", [3], "stop"), (2, "de", [4, 5], "length")]
    assert whole["usage"]["completion_tokens"] == 5  # all answers' tokens, as vLLM counts them
    assert responses.chunk(request, "r1", "c", index=2)["choices"][0]["index"] == 2
    assert responses.finish_reasons(wire.FinalReply("r2", "stop", final.usage, final.timings)) == ["stop"]


def test_prompt_logprobs_are_asked_of_the_engine_echo_with_logprobs_asks_for_them_too():
    asked = requests.parse("completion", {"prompt": "x", "prompt_logprobs": 2}, MODEL)
    assert asked.prompt_logprobs == 2 and asked.generate["prompt_logprobs"] == 2
    echo = requests.parse("completion", {"prompt": "x", "echo": True, "logprobs": 3}, MODEL)
    assert echo.echo and echo.prompt_logprobs is None and echo.generate["prompt_logprobs"] == 3  # as vLLM reads it
    assert "prompt_logprobs" not in requests.parse("completion", {"prompt": "x", "echo": True}, MODEL).generate
    chat = requests.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0}, MODEL)
    assert chat.generate["prompt_logprobs"] == 0
    with pytest.raises(InvalidField, match="'echo'"):  # a chat's echo continues the last message: not served
        requests.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, MODEL)


def test_prompt_logprobs_are_written_as_vllms_server_writes_them_and_cached_tokens_go_in_usage():
    request = requests.parse("completion", {"prompt": "ab", "prompt_logprobs": 1}, MODEL)
    positions = [None, [wire.TokenLogprob(7, -0.5, 3, "b"), wire.TokenLogprob(9, float("-inf"), 1, "z")]]
    shown = responses.prompt_logprobs_object(positions)
    assert shown == [None, {"7": {"logprob": -0.5, "rank": 3, "decoded_token": "b"},
                            "9": {"logprob": -9999.0, "rank": 1, "decoded_token": "z"}}]
    final = wire.FinalReply("r1", "stop", wire.Usage(2, 1, cached_tokens=0), wire.Timings(1.0, 1.0, 2.0))
    whole = responses.response(request, "r1", [responses.Answer("c", [5])], final, shown)
    assert whole["choices"][0]["prompt_logprobs"] == shown
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # zero is a count, not absent
    unknown = wire.FinalReply("r1", "stop", wire.Usage(2, 1), wire.Timings(1.0, 1.0, 2.0))
    assert "prompt_tokens_details" not in responses.usage(unknown)  # unknown is not reported as a number
    chat = requests.parse("chat", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}, MODEL)
    assert responses.response(chat, "r1", [responses.Answer("c")], final, shown)["prompt_logprobs"] == shown


def test_an_echoed_prompts_first_token_is_scored_by_nobody():
    request = requests.parse("completion", {"prompt": "ab", "echo": True, "logprobs": 0}, MODEL)
    positions = [None, [wire.TokenLogprob(8, -1.0, 2, "b"), wire.TokenLogprob(3, -0.1, 1, "q")],
                 [wire.TokenLogprob(5, -0.2, 1, "c")]]
    logprobs = responses.logprobs_object(request, [7, 8, 5], positions, unscored={0: "a"})
    assert logprobs["tokens"] == ["a", "b", "c"] and logprobs["token_logprobs"] == [None, -1.0, -0.2]
    assert logprobs["top_logprobs"] == [None, {"b": -1.0}, {"c": -0.2}]  # the sampled (or prompt) token at 0
    assert logprobs["text_offset"] == [0, 1, 2]


@pytest.mark.parametrize("code, status", [
    ("bad_json", 400), ("invalid_field", 400), ("empty_prompt", 400), ("prompt_too_long", 400),
    ("payload_too_large", 413), ("overloaded", 429), ("no_workers", 503), ("no_scheduler", 503),
    ("deadline_exceeded", 504), ("not_found", 404), ("cancelled", 499), ("engine_failed", 500),
    ("worker_lost", 502), ("something_new", 500),
])
def test_one_mapping_from_the_error_tree_to_http_statuses(code, status):
    assert http_status(code) == status
    got, body = responses.error(code, "why")
    assert got == status and body["error"]["code"] == code and body["error"]["message"] == "why"
