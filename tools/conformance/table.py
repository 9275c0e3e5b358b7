"""The conformance table: one request per field of ``vllm serve``'s ``/v1/completions`` and
``/v1/chat/completions`` (issue 28). Each row is sent to a single ``vllm serve`` of the
model and to kvpush's gateway in push, pull and local (``kvpush.tools.conformance.run``).

Pure data. A row's prompt is its ``text``; the runner puts a salt of its own before it so
that no request meets another's prefix in either system's cache (``cached_tokens`` is
compared on the one row that repeats a prompt). Every row asks for its token ids
(vLLM's ``return_token_ids``) and most for no more than 8 tokens: the comparison is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Endpoint = Literal["completions", "chat"]

SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
# Ids 10-39 of the built models' byte-level tokenizer are "*+,-./", the digits, ":;<=>?@"
# and "A"-"G" (12 ",", 13 "-", 14 "."): an answer drawn from them meets a stop string or a
# stop token id within a few tokens.
PUNCTUATION = list(range(10, 40))
# Bounded: enums and fixed fields, so that a random-weight model closes its JSON.
PICK = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["color", "size", "count"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                   "additionalProperties": False}}}
STRICT_WEATHER_TOOL = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
# An earlier turn that called a tool, and the tool's answer: the template shows both.
CALLED_BEFORE = [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "cold and clear"}]


@dataclass(frozen=True)
class Row:
    field: str  # what the row exercises, as the API names it
    endpoint: Endpoint
    body: dict = field(default_factory=dict)  # the request, less model and prompt/messages
    text: str = "Tell me about the sea"
    repeat: bool = False  # sent twice; the second answer is compared (cached_tokens)
    after: tuple[dict, ...] = ()  # chat: messages after the user's (an earlier tool call and its answer)
    compare_cached: bool = False  # compare usage.prompt_tokens_details.cached_tokens too


def _c(name: str, **body) -> Row:
    return Row(name, "completions", {"max_tokens": 8, "temperature": 0.0, **body})


def _chat(name: str, **body) -> Row:
    return Row(name, "chat", {"max_tokens": 8, "temperature": 0.0, **body})


ROWS: list[Row] = [
    _c("max_tokens", max_tokens=5),
    _c("temperature", temperature=0.8, seed=7),
    _c("top_p", **SEEDED),
    _c("top_k", temperature=0.8, top_k=20, seed=7),
    _c("min_p", temperature=0.8, min_p=0.1, seed=7),
    _c("seed", temperature=1.0, seed=11),
    _c("presence_penalty", presence_penalty=1.5, max_tokens=12),
    _c("frequency_penalty", frequency_penalty=1.5, max_tokens=12),
    _c("repetition_penalty", repetition_penalty=1.5, max_tokens=12),
    _c("ignore_eos", ignore_eos=True, max_tokens=12),
    _c("stop", stop=[".", ","], allowed_token_ids=PUNCTUATION),
    _c("include_stop_str_in_output", stop=[".", ","], include_stop_str_in_output=True,
       allowed_token_ids=PUNCTUATION),
    _c("stop_token_ids", stop_token_ids=[12, 13, 14], allowed_token_ids=PUNCTUATION),
    _c("min_tokens", min_tokens=6, stop_token_ids=[12, 13, 14], allowed_token_ids=PUNCTUATION),
    _c("logit_bias", logit_bias={"17": 100}),
    _c("allowed_token_ids", allowed_token_ids=list(range(1000, 1050))),
    _c("bad_words", bad_words=["the", " the", "a"]),
    _c("logprobs", logprobs=3),
    _c("stream", stream=True),
    _c("stream_options", stream=True, stream_options={"include_usage": True}),
    _c("structured_outputs.choice", structured_outputs={"choice": ["yes", "no"]}),
    _c("structured_outputs.regex", structured_outputs={"regex": "[a-z]{3}-[0-9]{2}"}),
    _chat("messages"),
    _chat("max_completion_tokens", max_completion_tokens=5, max_tokens=None),
    _chat("chat: top_p", **SEEDED),
    _chat("chat: logprobs, top_logprobs", logprobs=True, top_logprobs=3),
    _chat("chat: stream", stream=True, stream_options={"include_usage": True}),
    _chat("response_format: json_object", response_format={"type": "json_object"}, max_tokens=48),
    _chat("response_format: json_schema", max_tokens=48,
          response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK}}),
    Row("usage.prompt_tokens_details.cached_tokens", "completions", {"max_tokens": 8, "temperature": 0.0},
        text="Tell me about the sea " * 40, repeat=True, compare_cached=True),
    _c("n", n=2, **SEEDED),
    _c("best_of", best_of=2, n=1, **SEEDED),
    _c("echo", echo=True),
    _c("echo: text", echo=True, return_token_ids=False),
    _c("echo, logprobs", echo=True, logprobs=2),
    _c("echo, logprobs, n", echo=True, logprobs=1, n=2, **SEEDED),
    _c("echo, logprobs, stream", echo=True, logprobs=1, stream=True),
    # vLLM 0.32's server breaks this stream off for some prompts (a KeyError in
    # _create_completion_logprobs for the second choice's echo): then nothing to compare.
    _c("echo, logprobs, n, stream", echo=True, logprobs=1, n=2, stream=True, **SEEDED),
    _c("prompt_logprobs", prompt_logprobs=2),
    _chat("chat: prompt_logprobs", prompt_logprobs=1),
    _chat("tools, tool_choice: auto", tools=[WEATHER_TOOL], tool_choice="auto"),
    _chat("tool_choice: none", tools=[WEATHER_TOOL], tool_choice="none"),
    _chat("tool_choice: required", tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", max_tokens=48),
    _chat("tool_choice: required, parallel_tool_calls: false", tools=[WEATHER_TOOL, TIME_TOOL],
          tool_choice="required", parallel_tool_calls=False, max_tokens=48),
    _chat("tool_choice: named", tools=[WEATHER_TOOL], max_tokens=48,
          tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    _chat("tools: strict", tools=[STRICT_WEATHER_TOOL], max_tokens=24,
          tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    Row("messages: an earlier tool call and its answer", "chat", {"max_tokens": 8, "temperature": 0.0,
                                                                 "tools": [WEATHER_TOOL]}, after=tuple(CALLED_BEFORE)),
]

MODES = ("push", "pull", "local")
