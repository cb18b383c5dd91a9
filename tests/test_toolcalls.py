"""Parsing and writing Hermes/Qwen tool calls."""

from __future__ import annotations

import json

from ctxrl.chat.toolcalls import format_tool_call, parse_assistant, parse_tool_calls
from ctxrl.types import ToolCall


def test_one_valid_call():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
    calls, errors = parse_tool_calls(text)
    assert errors == []
    assert calls == [ToolCall(name="calculator", arguments={"expression": "3 + 4"})]


def test_two_calls_in_order():
    text = format_tool_call("a", {"x": 1}) + "\nthen\n" + format_tool_call("b", {"y": [1, 2]})
    calls, errors = parse_tool_calls(text)
    assert errors == []
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {"y": [1, 2]})]


def test_no_call():
    assert parse_tool_calls("<answer>7</answer>") == ([], [])


def test_invalid_json():
    calls, errors = parse_tool_calls("<tool_call>\n{not json}\n</tool_call>")
    assert calls == []
    assert len(errors) == 1
    assert errors[0].startswith("malformed tool call")
    assert "invalid JSON" in errors[0]


def test_missing_name():
    calls, errors = parse_tool_calls('<tool_call>{"arguments": {"x": 1}}</tool_call>')
    assert calls == []
    assert len(errors) == 1 and errors[0].startswith("malformed tool call")
    assert '"name"' in errors[0]


def test_non_string_name_and_non_object_payload():
    for body in ('{"name": 3, "arguments": {}}', "[1, 2]", '"calculator"'):
        calls, errors = parse_tool_calls(f"<tool_call>{body}</tool_call>")
        assert calls == [] and len(errors) == 1 and errors[0].startswith("malformed tool call"), body


def test_non_object_arguments():
    calls, errors = parse_tool_calls('<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>')
    assert calls == []
    assert len(errors) == 1
    assert errors[0].startswith("malformed tool call to 'calc'")
    assert "arguments" in errors[0]


def test_arguments_as_json_string_are_decoded():
    payload = json.dumps({"name": "calc", "arguments": json.dumps({"expression": "1 + 2"})})
    calls, errors = parse_tool_calls(f"<tool_call>\n{payload}\n</tool_call>")
    assert errors == []
    assert calls == [ToolCall("calc", {"expression": "1 + 2"})]


def test_arguments_as_non_json_string_is_error():
    payload = json.dumps({"name": "calc", "arguments": "not json"})
    calls, errors = parse_tool_calls(f"<tool_call>{payload}</tool_call>")
    assert calls == [] and len(errors) == 1


def test_missing_arguments_defaults_to_empty():
    calls, errors = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert errors == [] and calls == [ToolCall("now", {})]


def test_unclosed_tool_call():
    calls, errors = parse_tool_calls('<tool_call>\n{"name": "calc", "arguments": {}}')
    assert calls == []
    assert errors == ["malformed tool call: <tool_call> was not closed with </tool_call>"]


def test_unclosed_after_a_valid_call():
    text = format_tool_call("calc", {"e": "1"}) + "\n<tool_call>\n{\"name\": "
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("calc", {"e": "1"})]
    assert len(errors) == 1 and "not closed" in errors[0]


def test_format_round_trips():
    args = {"expression": "12 * (3 + 4)", "unicode": "é", "nested": {"a": [1, 2.5, None, True]}}
    text = format_tool_call("calculator", args)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    calls, errors = parse_tool_calls(text)
    assert errors == []
    assert calls == [ToolCall("calculator", args)]


def test_parse_assistant():
    text = "thinking " + format_tool_call("calc", {"e": "2"}) + "<tool_call>oops</tool_call>"
    msg = parse_assistant(text)
    assert msg.role == "assistant"
    assert msg.content == text
    assert msg.tool_calls == [ToolCall("calc", {"e": "2"})]
    assert len(msg.tool_call_errors) == 1 and msg.tool_call_errors[0].startswith("malformed tool call")
    plain = parse_assistant("<answer>5</answer>")
    assert plain.tool_calls == [] and plain.tool_call_errors == []


def test_error_texts_are_stable():
    """The errors are observations the policy reads: their exact text is part of what demos and runs tokenise."""
    assert parse_tool_calls("<tool_call>\n{not json}\n</tool_call>")[1] == [
        'malformed tool call: invalid JSON (Expecting property name enclosed in double quotes at char 1); '
        'write {"name": ..., "arguments": {...}} inside <tool_call></tool_call>']
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[1] == [
        'malformed tool call: expected a JSON object with a string "name"']
    assert parse_tool_calls('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>')[1] == [
        'malformed tool call to \'calc\': "arguments" must be a JSON object']


def test_wrappers_are_the_hermes_format():
    from ctxrl.chat.formats import get_format
    from ctxrl.chat.toolcalls import content_without_tool_calls

    hermes = get_format("hermes")
    text = "Sure.\n" + format_tool_call("a", {"x": [1, {"y": None}]}) + "\n<tool_call>oops</tool_call> done"
    assert parse_tool_calls(text) == hermes.parse(text)
    assert content_without_tool_calls(text) == hermes.content_without_calls(text) == "Sure.\n\n done"
    assert format_tool_call("a", {"x": 1}) == hermes.render([ToolCall("a", {"x": 1})])
