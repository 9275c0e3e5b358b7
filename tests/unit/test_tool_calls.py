"""Tools in the gateway (``kvpush.services.gateway.tool_calls``): OpenAI's tools and tool
choice as kvpush's ToolCalling, and the calls read out of an answer as vLLM 0.32's server
reads them with its hermes parser, whole and streamed; the model's chat template shows the
tools and earlier calls in the format that parser reads."""

from __future__ import annotations

import json

import pytest

from kvpush.services.gateway import requests, tool_calls
from kvpush.services.launch.model import CHAT_TEMPLATE
from kvpush.shared import wire
from kvpush.shared.errors import InvalidField

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CHAT = [{"role": "user", "content": "weather?"}]


def _parse(**body) -> requests.OpenAiRequest:
    return requests.parse("chat", {"messages": CHAT, **body}, "small", "hermes")


def test_tools_and_each_tool_choice_go_on_the_wire_for_decode():
    auto = _parse(tools=[WEATHER])
    assert auto.tool_calling.choice == "auto" and auto.generate["tool_calling"]["tools"][0]["name"] == "get_weather"
    assert auto.tools == [WEATHER]  # for the chat template
    required = _parse(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert (required.tool_calling.choice, required.tool_calling.parallel) == ("required", False)
    named = _parse(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (named.tool_calling.choice, named.tool_calling.function) == ("function", "get_weather")
    none = _parse(tools=[WEATHER], tool_choice="none")
    assert none.tool_calling is None and none.tools == [WEATHER]  # shown to the model, nothing read back


@pytest.mark.parametrize("body, says", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": [{"type": "retrieval"}]}, "function tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "a tool's function"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "'parallel_tool_calls'"),
], ids=lambda v: str(v)[:40])
def test_tools_of_the_wrong_shape_are_refused_with_a_sentence(body, says):
    with pytest.raises(InvalidField, match=says):
        _parse(**body)


def test_without_the_models_tool_call_format_tools_are_refused_as_vllm_serve_refuses_them():
    with pytest.raises(InvalidField, match="--tool-call-parser"):
        requests.parse("chat", {"messages": CHAT, "tools": [WEATHER]}, "small", None)
    assert requests.parse("chat", {"messages": CHAT, "tools": [WEATHER], "tool_choice": "none"}, "small",
                            None).tool_calling is None


def test_calls_are_read_as_vllms_hermes_parser_reads_them():
    content, calls = tool_calls.read('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                     '</tool_call>')
    assert content == "Sure. " and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    two = tool_calls.read('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
                          '<tool_call>{"name": "b", "arguments": 7}</tool_call>')
    assert two[0] is None and [(c.name, c.arguments) for c in two[1]] == [("a", '{"x": 1}'), ("b", "7")]
    open_ended = tool_calls.read('<tool_call>{"name": "a", "arguments": {"é": 1}}')  # cut off: read to the end
    assert [(c.name, c.arguments) for c in open_ended[1]] == [("a", '{"é": 1}')]
    broken = 'x <tool_call>{"name": "a", "arguments": {'
    assert tool_calls.read(broken) == (broken, [])  # unreadable: the whole text is content
    assert tool_calls.read("no calls") == ("no calls", [])


def test_the_message_and_finish_reason_follow_vllms_server():
    auto = wire.ToolCalling("hermes", [wire.ToolFunction("a")])
    message, finish = tool_calls.message(auto, ' <tool_call>{"name": "a", "arguments": {}}</tool_call>', "stop")
    assert message["content"] is None and message["tool_calls"][0]["function"] == {"name": "a", "arguments": "{}"}
    assert message["tool_calls"][0]["id"].startswith("chatcmpl-tool-") and finish == "tool_calls"
    assert tool_calls.message(auto, "just text", "length") == ({"role": "assistant", "content": "just text"}, "length")
    required = wire.ToolCalling("hermes", [wire.ToolFunction("a")], choice="required")
    message, finish = tool_calls.message(required, '<tool_call>{"name": "a", "arguments": 7}</tool_call>', "stop")
    assert message["content"] == "" and finish == "tool_calls"
    assert tool_calls.message(required, "", "length")[1] == "length"
    named = wire.ToolCalling("hermes", [wire.ToolFunction("a")], choice="function", function="a")
    assert tool_calls.message(named, '<tool_call>{"name": "a", "arguments": 7}</tool_call>', "stop")[1] == "stop"
    single = wire.ToolCalling("hermes", [wire.ToolFunction("a")], parallel=False)
    text = '<tool_call>{"name": "a", "arguments": 1}</tool_call><tool_call>{"name": "a", "arguments": 2}</tool_call>'
    assert len(tool_calls.message(single, text, "stop")[0]["tool_calls"]) == 1


def test_a_streamed_answer_streams_its_text_and_holds_back_what_may_start_a_call():
    stream = tool_calls.StreamedCalls(wire.ToolCalling("hermes", [wire.ToolFunction("a")]))
    assert stream.feed("Hello <tool") == "Hello "  # "<tool" may become "<tool_call>"
    assert stream.feed("_call>{\"name\": \"a\", ") == ""
    assert stream.feed('"arguments": {}}</tool_call>') == ""
    rest, deltas, finish = stream.finish("stop")
    assert rest == "" and finish == "tool_calls"
    assert deltas[0]["index"] == 0 and deltas[0]["function"] == {"name": "a", "arguments": "{}"}
    plain = tool_calls.StreamedCalls(wire.ToolCalling("hermes", [wire.ToolFunction("a")]))
    assert plain.feed("a <b") == "a <b" and plain.feed(" c <") == " c "
    assert plain.finish("length") == ("<", [], "length")  # the held-back tail, at the end


def test_the_built_models_chat_template_shows_the_tools_and_earlier_calls_as_the_parser_reads_them():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = _compile_jinja_template(CHAT_TEMPLATE)
    assert template.render(messages=CHAT, add_generation_prompt=True) == "user: weather?\nassistant:"  # as before
    history = requests._messages([*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}])
    shown = template.render(messages=history, tools=[WEATHER], add_generation_prompt=True)
    assert shown.startswith("system: You may call these functions.")
    assert json.loads(shown.split("<tools>")[1].split("\n")[0])["name"] == "get_weather"
    call = shown.split("assistant: ")[1].split("\n")[0]
    _, calls = tool_calls.read(call)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert "tool: <tool_response>cold</tool_response>\nassistant:" in shown
