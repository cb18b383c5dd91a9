"""Tool-call formats: each family's calls parsed from real-looking output, rendered, and chosen from templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxrl.chat.formats import (
    MALFORMED,
    call_id,
    choose_format,
    detect_format,
    format_names,
    get_format,
    parse_assistant,
    rewrite_calls,
)
from ctxrl.chat.formats.base import FORMATS
from ctxrl.chat.toolcalls import HERMES, format_tool_call
from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.envs.check import check_env, play_solution
from ctxrl.errors import ConfigError
from ctxrl.types import Message, ToolCall

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
NESTED = {"query": "weather", "filters": {"days": [1, 2, 3], "units": {"temp": "C", "wind": None}},
          "exact": True, "limit": 2.5, "note": "é \"quoted\" [x] (y)"}


def ok(fmt, text):
    calls, errors = get_format(fmt).parse(text)
    assert errors == [], errors
    return [(c.name, c.arguments) for c in calls]


def bad(fmt, text):
    calls, errors = get_format(fmt).parse(text)
    assert errors and all(e.startswith(MALFORMED) for e in errors), errors
    return calls, errors


# -- the registry -------------------------------------------------------------------------------------------

def test_registry_names_and_unknown_name():
    assert format_names() == ["hermes", "mistral", "pythonic", "llama3_json"]
    with pytest.raises(ConfigError, match="unknown tool format 'hermez'.*did you mean 'hermes'"):
        get_format("hermez")
    for name in format_names():
        fmt = get_format(name)
        assert fmt.name == name and fmt.markers and fmt.families
        calls, errors = fmt.parse(fmt.example)  # the example a message shows is itself a valid call
        assert errors == [] and len(calls) == 1


@pytest.mark.parametrize("name", ["hermes", "mistral", "pythonic", "llama3_json"])
def test_render_parse_round_trip(name):
    fmt = get_format(name)
    calls = [ToolCall("search", NESTED), ToolCall("now", {}), ToolCall("calculator", {"expression": "12 * (3 + 4)"})]
    text = fmt.render(calls)
    parsed, errors = fmt.parse(text)
    assert errors == []
    assert [(c.name, c.arguments) for c in parsed] == [(c.name, c.arguments) for c in calls]
    assert fmt.content_without_calls(text) == ""
    assert fmt.render([]) == ""
    prose = "Let me check two things.\n" + text + "\nThen I will answer."
    assert [(c.name, c.arguments) for c in fmt.parse(prose)[0]] == [(c.name, c.arguments) for c in calls]
    assert fmt.content_without_calls(prose).split() == "Let me check two things. Then I will answer.".split()


@pytest.mark.parametrize("name", ["hermes", "mistral", "pythonic", "llama3_json"])
def test_no_calls_in_prose(name):
    for text in ["<answer>7</answer>", "The list is [1, 2] and the map {\"a\": 1}.", "", "f(x) = [x]"]:
        assert get_format(name).parse(text) == ([], []), text


# -- hermes ----------------------------------------------------------------------------------------------

def test_hermes_is_what_toolcalls_wraps():
    text = "Two at once.\n" + format_tool_call("a", {"x": 1}) + "\n" + format_tool_call("b", {"y": [1, {"z": 2}]})
    assert HERMES.parse(text) == get_format("hermes").parse(text)
    assert ok("hermes", text) == [("a", {"x": 1}), ("b", {"y": [1, {"z": 2}]})]
    assert get_format("hermes").render([ToolCall("a", {"x": 1})]) == format_tool_call("a", {"x": 1})


def test_hermes_malformed():
    assert "invalid JSON" in bad("hermes", "<tool_call>\n{\"name\": \"a\", \"arguments\": {x}}\n</tool_call>")[1][0]
    assert "not closed" in bad("hermes", "<tool_call>\n{\"name\": \"a\"")[1][0]
    calls, errors = bad("hermes", '<tool_call>{"name": "a", "arguments": 3}</tool_call>' + format_tool_call("b", {}))
    assert [c.name for c in calls] == ["b"] and "'a'" in errors[0]


# -- llama3_json ---------------------------------------------------------------------------------------

def test_llama3_json_forms():
    one = '{"name": "calculator", "parameters": {"expression": "3 + 4"}}'
    assert ok("llama3_json", one) == [("calculator", {"expression": "3 + 4"})]
    assert ok("llama3_json", "<|python_tag|>" + one) == [("calculator", {"expression": "3 + 4"})]
    arguments = '{"name": "calculator", "arguments": {"expression": "1"}}'  # "arguments" is accepted too
    assert ok("llama3_json", arguments) == [("calculator", {"expression": "1"})]
    several = ('<|python_tag|>{"name": "a", "parameters": {"x": {"y": [1, 2]}}}; {"name": "b", "parameters": {}}\n'
               '{"name": "c", "parameters": "{\\"z\\": 3}"}')
    assert ok("llama3_json", several) == [("a", {"x": {"y": [1, 2]}}), ("b", {}), ("c", {"z": 3})]
    text = "I will compute it.\n" + one
    assert get_format("llama3_json").content_without_calls(text) == "I will compute it."
    assert get_format("llama3_json").content_without_calls("<|python_tag|>" + one + "; " + one) == ""


def test_llama3_json_leaves_json_answers_alone():
    for text in ['The person is {"name": "Alice", "age": 3}.', '{"answer": 42}', '<answer>{"name": "x"}</answer>']:
        assert get_format("llama3_json").parse(text) == ([], []), text


def test_llama3_json_malformed():
    assert "invalid JSON" in bad("llama3_json", '{"name": "calculator", "parameters": {"expression": }}')[1][0]
    assert "must be a JSON object" in bad("llama3_json", '{"name": "calc", "parameters": [1, 2]}')[1][0]
    assert "python_tag" in bad("llama3_json", '<|python_tag|>brave_search.call(query="x")')[1][0]
    assert '"name"' in bad("llama3_json", '<|python_tag|>{"function": "calc"}')[1][0]
    assert "parameters" in bad("llama3_json", '<|python_tag|>{"name": "calc"}')[1][0]
    unclosed = '{"name": "a", "parameters": {"x": 1}\n{"name": "b", "parameters": {}}'
    calls, errors = bad("llama3_json", unclosed)
    assert [c.name for c in calls] == ["b"] and len(errors) == 1


# -- mistral ---------------------------------------------------------------------------------------------

def test_mistral_v3_list_with_ids():
    text = ('[TOOL_CALLS] [{"name": "a", "arguments": {"x": [1, {"y": null}]}, "id": "abc123XYZ"}, '
            '{"name": "b", "arguments": {}}]')
    calls, errors = get_format("mistral").parse(text)
    assert errors == []
    assert calls == [ToolCall("a", {"x": [1, {"y": None}]}, id="abc123XYZ"), ToolCall("b", {})]


def test_mistral_named_form_and_prose():
    text = 'Let me look.[TOOL_CALLS]search[ARGS]{"q": "x", "k": {"n": 2}}[TOOL_CALLS]now[ARGS]{}'
    assert ok("mistral", text) == [("search", {"q": "x", "k": {"n": 2}}), ("now", {})]
    assert get_format("mistral").content_without_calls(text) == "Let me look."


def test_mistral_render_writes_deterministic_ids():
    calls = [ToolCall("a", {"x": 1}), ToolCall("a", {"x": 1}), ToolCall("b", {}, id="given1234")]
    text = get_format("mistral").render(calls)
    parsed, _ = get_format("mistral").parse(text)
    ids = [c.id for c in parsed]
    assert ids == [call_id("a", {"x": 1}, 0), call_id("a", {"x": 1}, 1), "given1234"]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 3
    assert get_format("mistral").render(calls) == text  # the same text every time


def test_mistral_malformed():
    assert "invalid JSON" in bad("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {]')[1][0]
    assert "followed by the calls" in bad("mistral", "[TOOL_CALLS] I would like to call a tool")[1][0]
    assert "id must be 9" in bad("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {}, "id": "short"}]')[1][0]
    calls, errors = bad("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": 5}, {"name": "b", "arguments": {}}]')
    assert [c.name for c in calls] == ["b"] and "'a'" in errors[0]
    assert "must be a JSON object" in bad("mistral", "[TOOL_CALLS]a[ARGS][1]")[1][0]


# -- pythonic --------------------------------------------------------------------------------------------

def test_pythonic_calls():
    text = ("I'll check the weather first. [get_weather(city='Paris', days=[1, 2], opts={'units': 'C', 'x': None}),"
            " add(a=1, b=-2.5, exact=True, pair=(1, 2))] Done.")
    weather = {"city": "Paris", "days": [1, 2], "opts": {"units": "C", "x": None}}
    add = {"a": 1, "b": -2.5, "exact": True, "pair": [1, 2]}
    assert ok("pythonic", text) == [("get_weather", weather), ("add", add)]
    assert get_format("pythonic").content_without_calls(text) == "I'll check the weather first.  Done."
    assert ok("pythonic", '[note(text="a ] bracket, a ) paren")]') == [("note", {"text": "a ] bracket, a ) paren"})]


def test_pythonic_never_evaluates():
    for text, hint in [("[run(code=__import__('os').system('echo hi'))]", "literal"),
                       ("[add(a=1 + 2)]", "literal"), ("[f(x=y)]", "literal"), ("[f(x=true)]", "literal"),
                       ("[f(1, 2)]", "keyword"), ("[f(**kw)]", "kwargs"), ("[f(x={1, 2})]", "literal"),
                       ("[f(x=1,,)]", "not valid Python"), ("[f(x='a')", "not closed"),
                       ("[f(x) for x in y]", "plain list")]:
        calls, errors = bad("pythonic", text)
        assert calls == [] and hint in errors[0], (text, errors)
    calls, errors = bad("pythonic", "[f(x=1), 3]")  # each item stands alone, as each Hermes block does
    assert calls == [ToolCall("f", {"x": 1})] and "must be a call" in errors[0]


# -- rewriting demonstrations ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["hermes", "mistral", "pythonic", "llama3_json"])
def test_rewrite_hermes_keeps_prose_and_calls(name):
    target = get_format(name)
    text = "First the sum.\n" + format_tool_call("calculator", {"expression": "1 + 2"}) + "\n" + \
        format_tool_call("search", NESTED)
    rewritten = rewrite_calls(text, target, HERMES)
    assert [(c.name, c.arguments) for c in target.parse(rewritten)[0]] == \
        [("calculator", {"expression": "1 + 2"}), ("search", NESTED)]
    assert target.content_without_calls(rewritten) == "First the sum."
    for unchanged in ["<answer>3</answer>", "<tool_call>\n{not json}\n</tool_call>"]:
        assert rewrite_calls(unchanged, target, HERMES) == unchanged
    if name == "hermes":
        assert rewritten == text


@pytest.mark.parametrize("name", ["hermes", "mistral", "pythonic", "llama3_json"])
def test_check_env_in_every_format(name):
    """The gold solutions, rewritten into each format and parsed with it, still earn reward 1."""
    assert check_env(CalculatorEnv, n_tasks=2, tool_format=name) == []
    task = CalculatorEnv.sample_tasks("train", 1, seed=0)[0]
    messages, reward = play_solution(CalculatorEnv, task, tool_format=name)
    assert reward == 1.0
    first = next(m for m in messages if m.role == "assistant")
    calls = get_format(name).parse(first.content)[0]
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": task.data["expression"]})]


def test_parse_assistant_keeps_raw_text():
    text = 'Sure.\n{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": 7}'
    message = parse_assistant(get_format("llama3_json"), text)
    assert message == Message("assistant", text, tool_calls=[ToolCall("a", {"x": 1})],
                              tool_call_errors=[message.tool_call_errors[0]])
    assert message.tool_call_errors[0].startswith(f"{MALFORMED} to 'b'")
    back = Message.from_dict(json.loads(json.dumps(message.to_dict())))
    assert back == message


def test_tool_call_ids_round_trip_and_old_data_reads():
    message = Message("assistant", "x", tool_calls=[ToolCall("a", {"k": [1]}, id="abc123def")])
    reply = Message("tool", "1", name="a", tool_call_id="abc123def")
    for m in (message, reply):
        assert Message.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert message.to_chat()["tool_calls"][0] == {"id": "abc123def", "type": "function",
                                                  "function": {"name": "a", "arguments": {"k": [1]}}}
    assert reply.to_chat()["tool_call_id"] == "abc123def"
    old = {"role": "assistant", "content": "x", "tool_calls": [{"name": "a", "arguments": {}}],
           "tool_call_errors": [], "name": None}  # written before ids existed
    assert Message.from_dict(old).tool_calls == [ToolCall("a", {})]
    assert "id" not in Message("assistant", "x", tool_calls=[ToolCall("a", {})]).to_chat()["tool_calls"][0]


# -- automatic choice ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("template", "expected"), [
    ("qwen2_5.jinja", "hermes"), ("qwen3.jinja", "hermes"), ("llama3_1.jinja", "llama3_json"),
    ("mistral.jinja", "mistral"), ("llama3_2_pythonic.jinja", "pythonic")])
def test_detect_from_fixture_templates(template, expected):
    assert detect_format((TEMPLATES / template).read_text()).name == expected


def test_detect_order_and_explicit_choice():
    assert detect_format("{{ '<|python_tag|>' }} ... [func_name1(params_name1=params_value1)]").name == "pythonic"
    assert detect_format("{{ message.content }}") is None
    assert choose_format("auto", "{{ message.content }}") is None
    assert choose_format("mistral", "<tool_call>").name == "mistral"  # a name given wins over the template
    assert set(FORMATS.names()) == set(format_names())
