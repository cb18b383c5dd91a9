"""Lone surrogates (issue 51, finding 1): ``"\\ud800"`` is valid JSON and valid UTF-8 as an escape, but no text.

A policy that samples one inside a tool call's JSON used to stop the training run (``call_id`` and the chat
template's rendering encode the arguments as UTF-8, the tokenizer refuses the text), and a resume with the same
seed sampled it again; a task file holding one was a traceback. Now a policy's call keeps going with U+FFFD in
the surrogate's place, and a task file is refused in one line naming its line and field. (``ctxrl serve``'s half
is in ``test_attacks_serve.py``.) Deeply nested JSON in a call, the same kind of input, is a malformed call.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxrl.chat.formats import call_id, format_names, get_format
from ctxrl.chat.surrogates import REPLACEMENT, find_surrogate, replace_surrogates, without_surrogates
from ctxrl.envs import EnvError
from ctxrl.envs.jsonl_tools import JsonlToolsEnv
from ctxrl.types import Message, ToolCall

ROOT = Path(__file__).resolve().parents[1]
LONE = "\\ud800"  # (as the policy writes it: six characters of JSON escape)
CALLS = {  # one call of each format, its argument a lone surrogate
    "hermes": '<tool_call>{"name": "calculator", "arguments": {"expression": "1+%s"}}</tool_call>',
    "mistral": '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "1+%s"}}]',
    "pythonic": '[calculator(expression="1+%s")]',
    "llama3_json": '{"name": "calculator", "parameters": {"expression": "1+%s"}}',
}


def test_the_helpers_replace_and_find_lone_surrogates_and_leave_pairs_alone():
    assert replace_surrogates("a\ud800b\udfff") == f"a{REPLACEMENT}b{REPLACEMENT}"
    pair = json.loads('"\\ud83d\\ude00"')
    assert replace_surrogates(pair) == pair == "\U0001f600"
    value = {"messages": [{"content": "ok"}, {"content": ["x", "y\udc00"]}]}
    assert find_surrogate(value) == "messages[1].content[1]" and find_surrogate({"k": pair}) is None
    assert without_surrogates(value)["messages"][1]["content"][1] == f"y{REPLACEMENT}"
    assert find_surrogate({"\ud800": 1}) == "a key of the value"


@pytest.mark.parametrize("name", format_names())
def test_a_sampled_call_with_a_lone_surrogate_is_parsed_rendered_and_given_an_id(name):
    tool_format = get_format(name)
    calls, errors = tool_format.parse(CALLS[name] % LONE)
    assert not errors and calls == [ToolCall("calculator", {"expression": f"1+{REPLACEMENT}"})]
    text = tool_format.render(calls)
    text.encode()  # (the crash: UnicodeEncodeError, surrogates not allowed)
    assert [(c.name, c.arguments) for c in tool_format.parse(text)[0]] == [(c.name, c.arguments) for c in calls]
    assert len(call_id("calculator", {"expression": "\ud800"}, 0)) == 9  # a call built by hand: an id, no crash


@pytest.mark.parametrize("name", ["hermes", "mistral", "llama3_json"])
def test_a_call_nested_past_what_json_reads_is_a_malformed_call(name):
    deep = "[" * 5000 + "]" * 5000
    calls, errors = get_format(name).parse((CALLS[name] % "x").replace('"1+x"', deep))
    assert not calls and len(errors) == 1 and errors[0].startswith("malformed tool call") and "nested" in errors[0]


def test_the_renderer_tokenises_a_conversation_holding_lone_surrogates(tokenizer_renderer):
    renderer = tokenizer_renderer
    sampled = renderer.parse_assistant(CALLS["hermes"] % LONE)
    messages = [Message("user", "hi \ud800"), sampled, Message("tool", "2\udfff", name="calculator")]
    ids = renderer.prompt_ids(messages, None)
    assert REPLACEMENT in renderer.decode(ids) and renderer.encode("a\ud800") == renderer.encode(f"a{REPLACEMENT}")


@pytest.fixture(scope="module")
def tokenizer_renderer():
    from ctxrl.config import load_config
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import spec_renderer

    config = load_config(str(ROOT / "examples" / "calculator_tiny.toml"), ["model.device=cpu"])
    return spec_renderer(RolloutSpec.from_config(config))


# -- task files: one line naming the line and the field -------------------------------------------------------
GOOD = '{"prompt": "What is 2 + 3?", "answer": "5"}'
BAD_LINES = [  # (the second line of a task file, what the error says)
    ('{"prompt": "What is \\ud800?", "answer": "5"}', r":2: \"prompt\" holds a lone surrogate"),
    ('{"prompt": "What is 2 + 2?", "answer": "\\udfff"}', r":2: \"answer\" holds a lone surrogate"),
    ('{"prompt": "What is 2 + 2?", "answer": "4", "id": "q\\ud800"}', r":2: \"id\" holds a lone surrogate"),
    ('{"prompt": "What is 2 + 2?", "answer": "4", "tools": ["calc\\ud800"]}', r":2: \"tools\[0\]\" holds"),
    ('{"prompt": "What is 2 + 2?", "answer": "4", "context": {"\\ud800": 1}}', r":2: a key of \"context\" holds"),
    ('{"prompt": "What is 2 + 2?", "answer": %s}' % ("9" * 5000), r":2: a number of more than 4300 digits"),
    ('{"prompt": "What is 2 + 3?", "answer": "5", "id": "q1"}\n{"prompt": "Other", "answer": "1", "id": "q1"}',
     r":3: task id 'q1' is taken already, by line 2"),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_a_task_file_with_a_lone_surrogate_a_huge_number_or_a_repeated_id_is_refused_in_one_line(tmp_path, line,
                                                                                                  message):
    path = tmp_path / "tasks.jsonl"
    path.write_text(f"{GOOD}\n{line}\n")
    with pytest.raises(EnvError, match=message) as caught:
        JsonlToolsEnv.configure(data=str(path), tools="calculator")
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)
