"""Token-faithful episodes: a scripted calculator episode through the real agent loop."""

from __future__ import annotations

import asyncio
import copy

import pytest

from ctxrl.chat.render import ChatRenderer, TemplateError
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.rollout.agent import run_episode
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.types import Message

MALFORMED = "<tool_call>\n{not json}\n</tool_call>"
BIG = RolloutLimits(max_turns=4, max_new_tokens=512, max_total_tokens=4096)


@pytest.fixture(scope="module")
def task():
    tasks = CalculatorEnv.sample_tasks("train", 20, seed=3)
    # a task with a multi-digit answer that does not occur in the prompt or the expression
    for t in tasks:
        if len(t.answer) >= 2 and t.answer not in t.prompt and t.answer not in t.data["expression"]:
            return t
    raise AssertionError("no suitable task")


def _play(renderer, task, texts, limits=BIG):
    env = CalculatorEnv()
    engine = ScriptedEngine(texts, renderer)
    episode = asyncio.run(run_episode(env, task, engine, renderer, limits))
    tools = [tool.schema() for tool in CalculatorEnv().tools]
    return episode, engine, tools


def _runs(episode, value):
    """Contiguous runs of positions whose loss_mask == value, as lists of ids."""
    runs, current = [], []
    for tok, m in zip(episode.input_ids, episode.loss_mask):
        if m == value:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


@pytest.fixture(scope="module")
def played(renderer, task):
    texts = [MALFORMED] + CalculatorEnv.solve(task)
    episode, engine, tools = _play(renderer, task, texts)
    return texts, episode, engine, tools


def test_gold_solution_succeeds(renderer, task):
    episode, engine, _ = _play(renderer, task, CalculatorEnv.solve(task))
    assert episode.truncation is None, episode.info
    assert episode.reward == 1.0 and episode.success
    assert len(episode.turns) == 2 and len(engine.prompts) == 2
    assert episode.tool_calls == 1 and episode.tool_errors == 0


def test_lengths_equal(played):
    _, ep, _, _ = played
    n = len(ep.input_ids)
    assert n > 0
    assert len(ep.loss_mask) == len(ep.behavior_logprobs) == len(ep.turn_index) == n
    assert set(ep.loss_mask) == {0, 1}
    assert all(lp == 0.0 for lp in ep.behavior_logprobs)  # scripted: log-prob 0; masked: 0 by contract


def test_sampled_ids_are_exactly_the_script(played, renderer):
    texts, ep, _, _ = played
    expected = [i for t in texts for i in renderer.assistant_ids(t)]
    assert [i for i, m in zip(ep.input_ids, ep.loss_mask) if m == 1] == expected
    runs = _runs(ep, 1)
    assert runs == [renderer.assistant_ids(t) for t in texts]
    for run, text in zip(runs, texts):
        assert renderer.decode(run) == text + "<|im_end|>"
        assert run[-1] == renderer.eos_id
    assert [t.sampled_tokens for t in ep.turns] == [len(renderer.assistant_ids(t)) for t in texts]
    assert [t.text for t in ep.turns] == texts
    assert ep.num_sampled_tokens == len(expected)


def test_tool_output_only_in_masked_tokens(played, renderer, task):
    _, ep, _, _ = played
    tool_messages = [m for m in ep.messages if m.role == "tool"]
    assert [m.content for m in tool_messages][1] == task.answer
    response = f"<tool_response>\n{task.answer}\n</tool_response>"
    for run in _runs(ep, 1):
        text = renderer.decode(run)
        assert "<tool_response>" not in text and "</tool_response>" not in text
        assert "Error:" not in text
    # the tool-calling turns never contain the value the tool returned (only the final answer does)
    for run in _runs(ep, 1)[:2]:
        assert task.answer not in renderer.decode(run)
    masked = "".join(renderer.decode(run) for run in _runs(ep, 0))
    assert response in masked
    assert masked.count("<tool_response>") == 2
    sampled = renderer.decode([i for i, m in zip(ep.input_ids, ep.loss_mask) if m])
    assert response not in sampled and "<tool_response>" not in sampled


def test_prompts_are_prefix_extensions(played, renderer):
    texts, ep, engine, _ = played
    prompts = engine.prompts
    assert len(prompts) == len(texts) == 3
    assert prompts[0] == ep.input_ids[: len(prompts[0])]
    for k in range(len(prompts) - 1):
        head = prompts[k] + renderer.assistant_ids(texts[k])
        assert prompts[k + 1][: len(head)] == head
        assert len(prompts[k + 1]) > len(head)  # plus the observation
        assert [t.prompt_tokens for t in ep.turns][k + 1] == len(prompts[k + 1])
    # the last prompt plus the last turn is the whole episode
    assert prompts[-1] + renderer.assistant_ids(texts[-1]) == ep.input_ids


def test_ids_equal_whole_rendering(played, renderer):
    _, ep, _, tools = played
    whole = renderer.conversation_ids(ep.messages, tools)
    assert ep.input_ids == whole[: len(ep.input_ids)]
    tail = renderer.decode(whole[len(ep.input_ids):])
    assert tail == "\n"  # ChatML's newline after the final <|im_end|>
    # the template's text exactly; only the ids of the tags in the malformed call's error (a tool message) differ
    # from encoding that text whole: text a tool returns cannot make tags (ctxrl.chat.guard)
    whole_text = renderer.text(ep.messages, tools, add_generation_prompt=False)
    assert renderer.decode(whole) == whole_text and "<tool_call></tool_call>" in ep.messages[3].content
    assert renderer.decode(ep.input_ids) + tail == whole_text


def test_initial_prompt_is_rendered_prompt(played, renderer, task):
    _, ep, engine, tools = played
    env = CalculatorEnv()
    first = renderer.prompt_ids(env.reset(task), tools)
    assert engine.prompts[0] == first
    assert renderer.decode(first).endswith("<|im_start|>assistant\n")


def test_malformed_call_is_shown_and_counted(played):
    _, ep, _, _ = played
    assert [m.role for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    first_obs = ep.messages[3]
    assert first_obs.content.startswith("Error:")
    assert "malformed tool call" in first_obs.content
    assert ep.messages[2].tool_call_errors and not ep.messages[2].tool_calls
    assert ep.turns[0].tool_errors >= 1 and ep.turns[0].tool_calls == 1
    assert ep.turns[1].tool_errors == 0 and ep.turns[1].tool_calls == 1
    assert ep.tool_errors >= 1
    assert ep.reward == 1.0 and ep.success and ep.truncation is None
    assert [t.reward for t in ep.turns] == [0.0, 0.0, 1.0]
    assert [t.finish_reason for t in ep.turns] == ["stop"] * 3


def test_error_is_visible_to_model(played, renderer):
    _, ep, engine, _ = played
    # the model sees the error text in the prompt of turn 1
    assert "Error: malformed tool call" in renderer.decode(engine.prompts[1])
    assert ep.messages[3].content in renderer.decode(engine.prompts[1])


def test_turn_index(played, renderer):
    texts, ep, engine, _ = played
    prompt_len = len(engine.prompts[0])
    assert ep.turn_index[:prompt_len] == [-1] * prompt_len
    assert -1 not in ep.turn_index[prompt_len:]
    for k in range(len(texts)):
        sampled = [ti for ti, m in zip(ep.turn_index, ep.loss_mask) if m == 1]
        assert sampled.count(k) == len(renderer.assistant_ids(texts[k]))
        start = len(engine.prompts[k])
        n = len(renderer.assistant_ids(texts[k]))
        assert ep.turn_index[start:start + n] == [k] * n
        assert ep.loss_mask[start:start + n] == [1] * n
        if k + 1 < len(texts):  # the observation answering turn k carries k, with mask 0
            obs = slice(start + n, len(engine.prompts[k + 1]))
            assert set(ep.turn_index[obs]) == {k}
            assert set(ep.loss_mask[obs]) == {0}
    assert ep.turn_index == sorted(ep.turn_index)


def test_truncation_max_turns(renderer, task):
    texts = [MALFORMED] + CalculatorEnv.solve(task)
    ep, engine, _ = _play(renderer, task, texts, RolloutLimits(max_turns=2, max_new_tokens=512, max_total_tokens=4096))
    assert ep.truncation == "max_turns"
    assert len(ep.turns) == 2 and len(engine.prompts) == 2
    assert ep.reward == 0.0 and not ep.success
    assert ep.loss_mask[-1] == 1  # ends right after the last sampled turn


def test_truncation_max_new_tokens(renderer, task):
    texts = CalculatorEnv.solve(task)
    n = len(renderer.assistant_ids(texts[0]))
    ep, _, _ = _play(renderer, task, texts, RolloutLimits(max_turns=4, max_new_tokens=n - 3, max_total_tokens=4096))
    assert ep.truncation == "max_new_tokens"
    assert len(ep.turns) == 1
    assert ep.turns[0].finish_reason == "length"
    assert ep.turns[0].sampled_tokens == n - 3 == ep.num_sampled_tokens
    assert ep.input_ids[-1] != renderer.eos_id
    assert ep.reward == 0.0


def test_truncation_max_total_tokens_during_turn(renderer, task):
    texts = CalculatorEnv.solve(task)
    prompt = renderer.prompt_ids(CalculatorEnv().reset(task), [t.schema() for t in CalculatorEnv().tools])
    limit = len(prompt) + 5
    ep, engine, _ = _play(renderer, task, texts, RolloutLimits(max_turns=4, max_new_tokens=512, max_total_tokens=limit))
    assert ep.truncation == "max_total_tokens"
    assert len(ep.input_ids) == limit
    assert ep.num_sampled_tokens == 5
    assert engine.prompts == [prompt]


def test_truncation_max_total_tokens_at_observation(renderer, task):
    texts = CalculatorEnv.solve(task)
    prompt = renderer.prompt_ids(CalculatorEnv().reset(task), [t.schema() for t in CalculatorEnv().tools])
    limit = len(prompt) + len(renderer.assistant_ids(texts[0])) + 3  # turn fits, observation does not
    ep, _, _ = _play(renderer, task, texts, RolloutLimits(max_turns=4, max_new_tokens=512, max_total_tokens=limit))
    assert ep.truncation == "max_total_tokens"
    assert ep.turns[0].finish_reason == "stop"
    assert len(ep.input_ids) <= limit


def test_truncation_prompt_too_long(renderer, task):
    ep, engine, _ = _play(renderer, task, CalculatorEnv.solve(task),
                          RolloutLimits(max_turns=4, max_new_tokens=512, max_total_tokens=10))
    assert ep.truncation == "max_total_tokens"
    assert ep.turns == [] and engine.prompts == [] and ep.num_sampled_tokens == 0


def test_verify_prefix_preserving_passes(renderer):
    renderer.verify_prefix_preserving()


LAST_TWO = ("{% for message in messages[-2:] %}{{ '<|im_start|>' + message.role + '\\n' + message.content"
            " + '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
STRIP_HISTORY = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\\n<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("template", [LAST_TWO, STRIP_HISTORY], ids=["last-two", "strip-history"])
def test_verify_prefix_preserving_rejects(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    bad = ChatRenderer(tok, template_name="my-bad-template")
    with pytest.raises(TemplateError) as info:
        bad.verify_prefix_preserving()
    assert "my-bad-template" in str(info.value)
    assert "prefix-preserving" in str(info.value)
    assert tokenizer.chat_template != template  # the session tokenizer is untouched


def test_non_prefix_template_mid_episode_stops_the_rollout(tokenizer, task):
    """A template that is not prefix-preserving is the user's to fix, not an episode's error: it propagates
    (the run stops with a one-line message naming the template) instead of erroring every episode silently."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = STRIP_HISTORY
    bad = ChatRenderer(tok, template_name="strip")
    with pytest.raises(TemplateError, match="chat template 'strip' is not prefix-preserving"):
        _play(bad, task, CalculatorEnv.solve(task))


def test_continuation_requires_assistant_history(renderer):
    with pytest.raises(ValueError):
        renderer.continuation_ids([Message("user", "hi")], [Message("tool", "x")], None)


def test_continuation_unclosed_adds_eos(renderer):
    history = [Message("user", "hi"), Message("assistant", "partial")]
    new = [Message("user", "go on")]
    closed = renderer.continuation_ids(history, new, None, closed=True)
    unclosed = renderer.continuation_ids(history, new, None, closed=False)
    assert unclosed == [renderer.eos_id] + closed
    assert renderer.decode(closed) == "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
