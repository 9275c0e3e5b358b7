"""A raw kvpush.generate body becomes a servable request or a RequestError with a code."""

from __future__ import annotations

import json

import pytest

from kvpush.services.scheduler.validation import DEFAULT_MAX_TOKENS, MAX_REQUEST_ID_LEN, RequestValidator, request_id_of
from kvpush.shared.errors import BadJson, EmptyPrompt, InvalidField, PromptTooLong, RequestError

VOCAB = 100
MAX_MODEL_LEN = 32


def _validator() -> RequestValidator:
    # stands in for the model's tokenizer: one token per character
    return RequestValidator(lambda s: [ord(c) % VOCAB for c in s], VOCAB, MAX_MODEL_LEN)


def _body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_a_prompt_is_tokenized_and_gets_the_default_sampling():
    request = _validator().validate(_body(prompt="hi", request_id="r-1"))
    assert request.request_id == "r-1"
    assert request.prompt_token_ids == [ord("h") % VOCAB, ord("i") % VOCAB]
    sampling = request.sampling
    # max_tokens: the room the 32-token context leaves, since that is less than 128
    assert (sampling.max_tokens, sampling.temperature, sampling.ignore_eos) == (MAX_MODEL_LEN - 2, 0.0, False)


def test_the_default_max_tokens_is_128_where_the_context_has_room():
    roomy = RequestValidator(lambda s: [ord(c) % VOCAB for c in s], VOCAB, 4096)
    assert roomy.validate(_body(prompt="hi")).sampling.max_tokens == DEFAULT_MAX_TOKENS == 128


def test_max_tokens_may_use_all_the_context_the_prompt_leaves():
    request = _validator().validate(_body(prompt="hi", max_tokens=MAX_MODEL_LEN - 2))
    assert request.sampling.max_tokens == MAX_MODEL_LEN - 2


@pytest.mark.parametrize("request_id", ["r-1", "cli-3f2a", "a/b_c=d.e", "X" * MAX_REQUEST_ID_LEN])
def test_request_ids_of_the_safe_characters_are_kept(request_id):
    assert _validator().validate(_body(prompt="hi", request_id=request_id)).request_id == request_id


def test_token_ids_and_sampling_are_taken_as_given():
    request = _validator().validate(
        _body(prompt_token_ids=[0, 5, VOCAB - 1], max_tokens=3, temperature=0.7, ignore_eos=True))
    sampling = request.sampling
    assert request.prompt_token_ids == [0, 5, VOCAB - 1]
    assert (sampling.max_tokens, sampling.temperature, sampling.ignore_eos) == (3, 0.7, True)


def test_a_request_id_is_generated_when_absent():
    validator = _validator()
    first = validator.validate(_body(prompt="hi")).request_id
    second = validator.validate(_body(prompt="hi")).request_id
    assert first and second and first != second


def test_the_longest_prompt_that_leaves_room_to_generate_is_accepted():
    request = _validator().validate(_body(prompt_token_ids=[1] * (MAX_MODEL_LEN - 1)))
    assert len(request.prompt_token_ids) == MAX_MODEL_LEN - 1


BAD = [
    ("not-json", b"{this is not json", BadJson, "bad_json"),
    ("not-utf8", b'{"prompt": "\xff\xfe"}', BadJson, "bad_json"),
    ("empty-body", b"", BadJson, "bad_json"),
    ("not-an-object", b"[1, 2, 3]", InvalidField, "invalid_field"),
    ("a-string", b'"hi"', InvalidField, "invalid_field"),
    ("unknown-field", _body(prompt="hi", max_tokenz=3), InvalidField, "invalid_field"),
    ("wrong-type", _body(prompt="hi", max_tokens="ten"), InvalidField, "invalid_field"),
    ("float-max-tokens", _body(prompt="hi", max_tokens=2.5), InvalidField, "invalid_field"),
    ("both-prompts", _body(prompt="a", prompt_token_ids=[1]), InvalidField, "invalid_field"),
    ("prompt-number", _body(prompt=5), InvalidField, "invalid_field"),
    ("token-ids-strings", _body(prompt_token_ids=["a", "b"]), InvalidField, "invalid_field"),
    ("token-ids-not-a-list", _body(prompt_token_ids=7), InvalidField, "invalid_field"),
    ("out-of-vocab", _body(prompt_token_ids=[1, VOCAB]), InvalidField, "invalid_field"),
    ("far-out-of-vocab", _body(prompt_token_ids=[1, VOCAB + 5]), InvalidField, "invalid_field"),
    ("negative-token", _body(prompt_token_ids=[-1]), InvalidField, "invalid_field"),
    ("max-tokens-zero", _body(prompt="hi", max_tokens=0), InvalidField, "invalid_field"),
    ("max-tokens-negative", _body(prompt="hi", max_tokens=-3), InvalidField, "invalid_field"),
    ("max-tokens-past-the-context", _body(prompt="hi", max_tokens=MAX_MODEL_LEN - 1), InvalidField,
     "invalid_field"),
    ("max-tokens-over-2-to-the-64", _body(prompt="hi", max_tokens=2**64 + 1), InvalidField, "invalid_field"),
    ("negative-temperature", _body(prompt="hi", temperature=-0.1), InvalidField, "invalid_field"),
    ("temperature-string", _body(prompt="hi", temperature="hot"), InvalidField, "invalid_field"),
    ("ignore-eos-string", _body(prompt="hi", ignore_eos="yes"), InvalidField, "invalid_field"),
    ("unknown-transfer-mode", _body(prompt="hi", transfer_mode="teleport"), InvalidField, "invalid_field"),
    ("request-id-number", _body(prompt="hi", request_id=7), InvalidField, "invalid_field"),
    ("empty-request-id", _body(prompt="hi", request_id=""), InvalidField, "invalid_field"),
    ("request-id-with-a-space", _body(prompt="hi", request_id="my request"), InvalidField, "invalid_field"),
    ("request-id-wildcard", _body(prompt="hi", request_id="r.>"), InvalidField, "invalid_field"),
    ("request-id-star", _body(prompt="hi", request_id="*"), InvalidField, "invalid_field"),
    ("request-id-newline", _body(prompt="hi", request_id="r\n1"), InvalidField, "invalid_field"),
    ("long-request-id", _body(prompt="hi", request_id="x" * (MAX_REQUEST_ID_LEN + 1)),
     InvalidField, "invalid_field"),
    ("no-prompt", _body(max_tokens=3), EmptyPrompt, "empty_prompt"),
    ("empty-prompt", _body(prompt=""), EmptyPrompt, "empty_prompt"),
    ("empty-token-ids", _body(prompt_token_ids=[]), EmptyPrompt, "empty_prompt"),
    ("fills-the-context", _body(prompt_token_ids=[1] * MAX_MODEL_LEN), PromptTooLong, "prompt_too_long"),
    ("token-ids-past-the-context", _body(prompt_token_ids=[1] * (MAX_MODEL_LEN + 10)), PromptTooLong,
     "prompt_too_long"),
    ("past-the-context", _body(prompt="x" * (MAX_MODEL_LEN + 5)), PromptTooLong, "prompt_too_long"),
]


@pytest.mark.parametrize("name,data,error,code", BAD, ids=[b[0] for b in BAD])
def test_a_bad_request_is_refused_with_its_code_and_a_sentence(name, data, error, code):
    validator = _validator()
    with pytest.raises(error) as caught:
        validator.validate(data)
    assert type(caught.value) is error and isinstance(caught.value, RequestError)
    assert caught.value.code == code
    message = caught.value.message
    assert len(message) > 10 and message[0].isalpha() and " " in message, message


def test_a_prompt_with_no_tokens_is_empty():
    validator = RequestValidator(lambda s: [], VOCAB, MAX_MODEL_LEN)
    body = _body(prompt="   ")
    with pytest.raises(EmptyPrompt) as caught:
        validator.validate(body)
    assert caught.value.code == "empty_prompt"


@pytest.mark.parametrize("data,expected", [
    (_body(prompt=5, request_id="mine"), "mine"),
    (_body(request_id="y" * 500), "y" * MAX_REQUEST_ID_LEN),
    (_body(request_id=7), ""),
    (b"[1, 2]", ""),
    (b"{broken", ""),
    (b"\xff\xfe", ""),
])
def test_request_id_of_recovers_what_the_client_sent(data, expected):
    assert request_id_of(data) == expected


def test_a_text_prompt_too_long_in_bytes_is_refused_before_the_tokenizer_sees_it():
    """The scheduler tokenizes on one thread: a 1M-token prompt held it for seconds, and
    every request behind it waited (issue 24, point 6). One that cannot fit the context at
    the vocabulary's longest token is refused before tokenizing."""
    seen: list[int] = []

    def tokenize(text: str) -> list[int]:
        seen.append(len(text))
        return [ord(c) % VOCAB for c in text]

    validator = RequestValidator(tokenize, VOCAB, MAX_MODEL_LEN, max_token_bytes=4)
    huge = json.dumps({"prompt": "x " * 1_000_000}).encode()
    with pytest.raises(PromptTooLong, match="bytes"):
        validator.validate(huge)
    assert seen == []
    validator.validate(json.dumps({"prompt": "x" * 8, "max_tokens": 1}).encode())  # a short one still is
    assert seen == [8]


def test_the_byte_bound_is_the_longest_token_of_the_real_tokenizer(model_dir):
    from transformers import AutoTokenizer

    from kvpush.services.scheduler.validation import max_token_bytes

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bound = max_token_bytes(tokenizer)
    assert bound >= max(len(tokenizer.decode([i]).encode()) for i in range(len(tokenizer)))


SAMPLING = dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5, frequency_penalty=-1.0,
                repetition_penalty=1.2, seed=7, min_tokens=2, logit_bias={"3": 5.0, "4": -250},
                allowed_token_ids=[3, 4, 5], bad_words=["zz"], stop_token_ids=[9], include_stop_str_in_output=True)


def test_sampling_fields_are_taken_with_vllms_meaning_a_bias_clamped_as_vllm_clamps():
    sampling = _validator().validate(_body(prompt="hi", max_tokens=4, **SAMPLING)).sampling
    assert (sampling.top_p, sampling.top_k, sampling.min_p, sampling.seed, sampling.min_tokens) == (0.9, 40, 0.05, 7, 2)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1.0, 1.2)
    assert sampling.logit_bias == {3: 5.0, 4: -100.0}
    assert sampling.allowed_token_ids == [3, 4, 5] and sampling.bad_words == ["zz"] and sampling.stop_token_ids == [9]
    assert sampling.include_stop_str_in_output


@pytest.mark.parametrize("field, value, says", [
    ("temperature", 2.5, "temperature must be in [0, 2]"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
    ("top_k", -2, "top_k must be 0"),
    ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0, "repetition_penalty must be greater than 0"),
    ("seed", 2**63, "seed must be a 64-bit signed integer"),
    ("min_tokens", 5, "min_tokens must be in [0, max_tokens = 4]"),
    ("logit_bias", {"100": 1.0}, "logit_bias: token id 100 is outside"),
    ("logit_bias", {"x": 1.0}, "invalid request"),
    ("allowed_token_ids", [], "allowed_token_ids must hold at least one"),
    ("allowed_token_ids", [1, 100], "allowed_token_ids: token id 100"),
    ("stop_token_ids", [-1], "stop_token_ids: token id -1"),
    ("bad_words", [""], "bad_words takes at most"),
    ("top_p", "0.9", "invalid request"),
    ("logprobs", 21, "logprobs must be in [0, 20]"),
    ("logprobs", -1, "logprobs must be in [0, 20]"),
    ("prompt_logprobs", -1, "prompt_logprobs must be in [0, 20]"),
    ("prompt_logprobs", 21, "prompt_logprobs must be in [0, 20]"),
], ids=lambda v: str(v)[:24])
def test_sampling_out_of_vllms_bounds_is_refused_before_any_engine(field, value, says):
    with pytest.raises(InvalidField) as refused:
        _validator().validate(_body(prompt="hi", max_tokens=4, **{field: value}))
    assert says in refused.value.message



@pytest.mark.parametrize("structured, says", [
    ({}, "exactly one of json, regex, choice, grammar or json_object, got 0"),
    ({"regex": "a", "choice": ["a"]}, "got 2 (regex, choice)"),
    ({"json": "[1, 2]"}, "must be a JSON schema"),
    ({"json": "{not json"}, "must be a JSON schema"),
    ({"choice": []}, "non-empty strings"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"regex": ""}, "must not be empty"),
    ({"json_object": False}, "must be true"),
    ({"grammar": "x" * (64 * 1024)}, "bytes; at most"),
    ({"json": {"type": "object"}, "wibble": 1}, "invalid request"),
], ids=lambda v: str(v)[:30])
def test_a_structured_output_of_the_wrong_shape_is_refused_before_any_engine(structured, says):
    with pytest.raises(InvalidField) as refused:
        _validator().validate(_body(prompt="hi", max_tokens=4, structured_outputs=structured))
    assert says in refused.value.message


def test_n_answers_are_bounded_by_what_the_decode_engine_runs_at_once():
    assert _validator().validate(_body(prompt="hi", max_tokens=4, n=4, seed=7, temperature=0.8)).sampling.n == 4
    assert _validator().validate(_body(prompt="hi", max_tokens=4)).sampling.n == 1
    for n in (0, 17):
        with pytest.raises(InvalidField, match=r"n must be in \[1, 16\]"):
            _validator().validate(_body(prompt="hi", max_tokens=4, n=n))
    with pytest.raises(InvalidField, match="seed \\+ n - 1"):  # answer i is seeded seed + i
        _validator().validate(_body(prompt="hi", max_tokens=4, n=2, seed=2**63 - 1))


def test_prompt_logprobs_are_bounded_by_what_one_chunk_carries_back():
    assert _validator().validate(_body(prompt="hi", max_tokens=4, prompt_logprobs=3)).sampling.prompt_logprobs == 3
    validator = RequestValidator(lambda s: [ord(c) % VOCAB for c in s], VOCAB, 8192)
    long_prompt = [1, 2, 3] * 1200  # 3600 tokens x (4 + 1) entries: over the bound
    with pytest.raises(InvalidField, match="makes 18000 entries, over kvpush's 16384; ask for fewer"):
        validator.validate(_body(prompt_token_ids=long_prompt, max_tokens=4, prompt_logprobs=4))
    assert validator.validate(_body(prompt_token_ids=long_prompt, max_tokens=4, prompt_logprobs=3)).sampling


@pytest.mark.parametrize("calling, says", [
    ({"parser": "mistral", "tools": [{"name": "a"}]}, "not one kvpush reads"),
    ({"parser": "hermes", "tools": []}, "must hold 1 to 128 functions"),
    ({"parser": "hermes", "tools": [{"name": "a"}, {"name": "a"}]}, "a name of its own"),
    ({"parser": "hermes", "tools": [{"name": "a"}], "choice": "function"}, "exactly when the choice"),
    ({"parser": "hermes", "tools": [{"name": "a"}], "choice": "function", "function": "b"}, "not among the tools"),
    ({"parser": "hermes", "tools": [{"name": "a", "description": "x" * 70000}]}, "at most 65536"),
], ids=lambda v: str(v)[:30])
def test_tool_calling_of_the_wrong_shape_is_refused_before_any_engine(calling, says):
    with pytest.raises(InvalidField, match=says):
        _validator().validate(_body(prompt="hi", max_tokens=4, tool_calling=calling))
    good = {"parser": "hermes", "tools": [{"name": "a"}], "choice": "function", "function": "a"}
    assert _validator().validate(_body(prompt="hi", max_tokens=4, tool_calling=good)).sampling.tool_calling.function == "a"
