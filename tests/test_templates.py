"""Each family's chat template with the tiny tokenizer: the format is chosen from it, the start-up check
passes, and a calculator episode played from the environment's own solution is token-faithful.

The templates (tests/fixtures/templates) are written in each family's layout; the tiny tokenizer gets
the family's special tokens and end-of-turn token, so the renderer meets what a real checkpoint shows it.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest

from ctxrl.chat.render import ChatRenderer, TemplateError
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.rollout.agent import run_episode
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.types import Message, StepResult

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
BIG = RolloutLimits(max_turns=6, max_new_tokens=512, max_total_tokens=8192)
LLAMA_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                "<|python_tag|>"]
MISTRAL_TOKENS = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
FAMILIES = {
    # template: (special tokens to add, eos, bos, the format auto must choose)
    "qwen2_5": ([], "<|im_end|>", None, "hermes"),
    "qwen3": ([], "<|im_end|>", None, "hermes"),
    "llama3_1": (LLAMA_TOKENS, "<|eot_id|>", "<|begin_of_text|>", "llama3_json"),
    "llama3_2_pythonic": (LLAMA_TOKENS, "<|eot_id|>", "<|begin_of_text|>", "pythonic"),
    "mistral": (MISTRAL_TOKENS, "</s>", "<s>", "mistral"),
}
MALFORMED = {  # a broken call as each family's model might write it
    "hermes": '<tool_call>\n{"name": "calculator", "arguments": {"expression": }}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "calculator", "parameters": {"expression": }}',
    "pythonic": "[calculator(expression=1 +)]",
    "mistral": '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": ]',
}


def family_renderer(tokenizer, family: str) -> ChatRenderer:
    specials, eos, bos, _ = FAMILIES[family]
    tok = copy.deepcopy(tokenizer)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": specials})
    tok.eos_token = eos
    if bos is not None:
        tok.bos_token = bos
    tok.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    return ChatRenderer(tok, template_name=family, tool_format="auto")


@pytest.fixture(scope="module")
def task():
    return CalculatorEnv.sample_tasks("train", 1, seed=5)[0]


def play(renderer: ChatRenderer, task, texts: list[str], env=None, limits=BIG):
    engine = ScriptedEngine(texts, renderer)
    episode = asyncio.run(run_episode(env or CalculatorEnv(), task, engine, renderer, limits))
    return episode, engine


def tools() -> list[dict]:
    return [tool.schema() for tool in CalculatorEnv().tools]


def assert_is_fresh_rendering(renderer: ChatRenderer, ids: list[int], messages: list[Message]) -> None:
    """``ids`` are the template's rendering of ``messages``, up to what it prints after the last end of turn."""
    whole = renderer.conversation_ids(messages, tools())
    assert ids == whole[:len(ids)]
    assert renderer.decode(whole[len(ids):]).strip() == ""


def sampled_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_format_chosen_and_start_up_check_passes(tokenizer, family):
    renderer = family_renderer(tokenizer, family)
    assert renderer.tool_format.name == FAMILIES[family][3]
    renderer.verify_prefix_preserving()
    assert renderer.eos_text == FAMILIES[family][1]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_calculator_episode_is_token_faithful(tokenizer, task, family):
    renderer = family_renderer(tokenizer, family)
    fmt = renderer.tool_format
    texts = [MALFORMED[fmt.name], *CalculatorEnv.solve(task)]
    episode, engine = play(renderer, task, texts)
    assert episode.truncation is None and episode.success and episode.reward == 1.0, episode.info
    assert not episode.segments and "template_restarts" not in episode.info
    # the scripted turns were played as this family writes them, and parsed with its format
    played = [renderer.rewrite_hermes(t) for t in texts]
    assert [m.content for m in episode.messages if m.role == "assistant"] == played
    call = episode.messages[4]
    assert [(c.name, c.arguments) for c in call.tool_calls] == [("calculator", {"expression": task.data["expression"]})]
    if fmt.name != "hermes":
        assert "<tool_call>" not in played[1]
    assert episode.messages[3].content.startswith("Error: malformed tool call")
    assert [t.tool_errors for t in episode.turns] == [1, 0, 0]
    # mask 1 exactly on the sampled tokens, each turn's ids as the engine produced them
    assert sampled_runs(episode.input_ids, episode.loss_mask) == [renderer.assistant_ids(t) for t in played]
    assert all(run[-1] == renderer.eos_id for run in sampled_runs(episode.input_ids, episode.loss_mask))
    # every prompt extends the last, and the episode is the whole conversation's rendering
    for before, after in zip(engine.prompts, engine.prompts[1:]):
        assert after[:len(before)] == before
    assert_is_fresh_rendering(renderer, episode.input_ids, episode.messages)


def test_mistral_results_carry_the_ids_of_their_calls(tokenizer, task):
    renderer = family_renderer(tokenizer, "mistral")
    episode, _ = play(renderer, task, CalculatorEnv.solve(task))
    call = episode.messages[2].tool_calls[0]
    assert call.id is not None and len(call.id) == 9 and call.id.isalnum()
    text = renderer.decode(episode.input_ids)
    assert f'"id": "{call.id}"' in text and f'"call_id": "{call.id}"' in text
    chat = renderer.chat(episode.messages)
    assert chat[3]["tool_call_id"] == call.id and "tool_calls" not in chat[2]  # the text writes the call


def test_structured_calls_render_once(tokenizer):
    """A hand-built message (calls without text) is rendered from its calls; a sampled one from its text alone."""
    renderer = family_renderer(tokenizer, "qwen2_5")
    from ctxrl.types import ToolCall

    built = [Message("user", "hi"), Message("assistant", "", tool_calls=[ToolCall("calculator", {"expression": "1"})])]
    sampled = [Message("user", "hi"), renderer.parse_assistant(renderer.tool_format.render(built[1].tool_calls))]
    assert renderer.text(built, None, add_generation_prompt=False) == \
        renderer.text(sampled, None, add_generation_prompt=False)
    assert renderer.text(sampled, None, add_generation_prompt=False).count("<tool_call>") == 1


# -- thinking templates: history rewritten at a new user message -> a new segment ---------------------

class NudgingCalculator(CalculatorEnv):
    """The calculator, with a user message after each tool result (as a human in the loop would write)."""

    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        if not result.terminated:
            result.messages.append(Message("user", "Now give the answer."))
        return result


THINK = "<think>\nI should use the calculator.\n</think>\n\n"
ANSWER_THINK = "<think>\nThe tool gave the value.\n</think>\n\n"


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_history_rewrite_starts_a_segment(tokenizer, task, family):
    renderer = family_renderer(tokenizer, family)
    call, answer = CalculatorEnv.solve(task)
    texts = [THINK + call, ANSWER_THINK + answer] if family == "qwen3" else [call, answer]
    episode, engine = play(renderer, task, texts, env=NudgingCalculator())
    assert episode.success and episode.truncation is None, episode.info
    assert episode.info["template_restarts"] == 1
    assert [s.ended_by for s in episode.segments] == ["template"]
    closed, live = episode.segments[0], episode.sequences()[1]
    played = [renderer.rewrite_hermes(t) for t in texts]
    # the closed segment keeps its sampled turn trainable; the new one is context, then the next turn
    assert sampled_runs(closed.input_ids, closed.loss_mask) == [renderer.assistant_ids(played[0])]
    assert sampled_runs(live.input_ids, live.loss_mask) == [renderer.assistant_ids(played[1])]
    start = len(engine.prompts[1])
    assert live.loss_mask[:start] == [0] * start and live.turn_index[:start] == [-1] * start
    assert live.input_ids[:start] == engine.prompts[1]
    assert all(lp == 0.0 for lp, m in zip(live.behavior_logprobs, live.loss_mask) if not m)
    # each segment is exactly a fresh rendering of the conversation it holds
    assert [m.role for m in closed.messages] == ["system", "user", "assistant"]
    assert [m.role for m in live.messages] == ["system", "user", "assistant", "tool", "user", "assistant"]
    assert_is_fresh_rendering(renderer, closed.input_ids, closed.messages)
    assert_is_fresh_rendering(renderer, live.input_ids, live.messages)
    assert engine.prompts[1] == renderer.prompt_ids(live.messages[:-1], tools())
    if family == "qwen3":  # the earlier turn's reasoning is gone from what the model sees next
        assert "I should use the calculator" in renderer.decode(closed.input_ids)
        assert "I should use the calculator" not in renderer.decode(engine.prompts[1])
    else:  # the tools and the system message moved to the new last user message
        assert renderer.decode(engine.prompts[1]).index("[AVAILABLE_TOOLS]") > \
            renderer.decode(engine.prompts[1]).index("[/INST]")


def test_reasoning_within_one_exchange_is_prefix_preserving(tokenizer, task):
    """Without a new user message Qwen3's layout keeps every turn's reasoning: one sequence."""
    renderer = family_renderer(tokenizer, "qwen3")
    call, answer = CalculatorEnv.solve(task)
    episode, _ = play(renderer, task, [THINK + call, ANSWER_THINK + answer])
    assert episode.success and not episode.segments
    assert_is_fresh_rendering(renderer, episode.input_ids, episode.messages)


def test_history_rewrite_within_an_exchange_is_refused(tokenizer):
    """Rewriting history on every tool result would restart every turn: the start-up check says so."""
    renderer = family_renderer(tokenizer, "qwen3")
    renderer.tokenizer.chat_template = renderer.tokenizer.chat_template.replace(
        "loop.index0 > ns.last_query", "loop.last")  # reasoning kept on the final message only
    with pytest.raises(TemplateError, match="within one tool exchange"):
        renderer.verify_prefix_preserving()


# -- no format in the template ------------------------------------------------------------------------

PLAIN_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + "
                "'<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PLAIN = ("{% for message in messages %}{{ '### ' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}")


def test_template_without_a_format(tokenizer, task):
    """No marker and not ChatML: no format, plain conversations render, tools are refused naming the choices."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = PLAIN
    renderer = ChatRenderer(tok, template_name="plain", tool_format="auto")
    assert not renderer.has_tool_format and renderer.notices == []
    renderer.verify_prefix_preserving()  # a plain conversation still renders
    assert renderer.parse_assistant("<tool_call>{}</tool_call>").tool_calls == []
    with pytest.raises(TemplateError, match="model.tool_format to one of hermes, mistral, pythonic, llama3_json"):
        play(renderer, task, CalculatorEnv.solve(task))
    named = ChatRenderer(tok, template_name="plain", tool_format="llama3_json")
    assert named.tool_format.name == "llama3_json"
    episode, engine = play(named, task, CalculatorEnv.solve(task))
    assert episode.success and '"parameters"' in episode.messages[2].content
    # the template ignores tools: the renderer told the policy its tools and how to call one in its format
    first = named.decode(engine.prompts[0])
    assert first.startswith("### system\n") and '{"name": "calculator", "parameters": {"expression": "..."}}' in first


def test_chatml_template_without_a_format_gets_hermes(tokenizer, task):
    """No marker but ChatML (SmolLM2's kind, tests/test_tool_prompt.py): hermes, said in a notice."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = PLAIN_CHATML
    renderer = ChatRenderer(tok, template_name="plain-chatml", tool_format="auto")
    assert renderer.tool_format.name == "hermes"
    assert [n.split(":")[0] for n in renderer.notices] == [
        "chat template 'plain-chatml' shows none of the tool-call markers ctxrl looks for, but it is ChatML "
        "(<|im_start|>)", "chat template 'plain-chatml' ignores tools"]
    renderer.verify_prefix_preserving()
    episode, _ = play(renderer, task, CalculatorEnv.solve(task))
    assert episode.success and episode.messages[2].tool_calls[0].name == "calculator"
    assert_is_fresh_rendering(renderer, episode.input_ids, episode.messages)


# -- the configured path: model.tool_format through the spec ------------------------------------------

@pytest.mark.parametrize(("tool_format", "expected"), [("auto", "hermes"), ("pythonic", "pythonic")])
def test_spec_renderer_owns_the_configured_format(tiny_path, tool_format, expected):
    from ctxrl.config import load_config
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import spec_renderer

    config = load_config(None, [f"model.name={tiny_path}", f"model.chat_template={TEMPLATES / 'qwen3.jinja'}",
                                f"model.tool_format={tool_format}"])
    renderer = spec_renderer(RolloutSpec.from_config(config))  # checked at start-up with calls in that format
    assert renderer.tool_format.name == expected
    assert "<think>" in renderer.template_text


def test_a_side_generation_after_a_rewrite_samples_in_the_new_segment(tokenizer, task):
    """A summary (or reflection) request is a user message: with Qwen3's layout the request starts a new
    segment, and the side generation is sampled there, its start pointing into the live sequence."""
    from ctxrl.engine.base import Completion
    from ctxrl.rollout.generate import sample_aside
    from ctxrl.rollout.recorder import Recorder
    from ctxrl.types import Episode

    renderer = family_renderer(tokenizer, "qwen3")
    episode = Episode(task=task)
    recorder = Recorder(episode, renderer, tools())
    recorder.prompt(CalculatorEnv().reset(task))
    text = THINK + CalculatorEnv.solve(task)[0]
    ids = renderer.assistant_ids(text)
    recorder.assistant(Completion(ids, [-0.5] * len(ids), "stop"), renderer.parse_assistant(text), 0)
    engine = ScriptedEngine([], renderer, summary=lambda: "The sum is pending.")
    ask = [Message("tool", "7", name="calculator"), Message("user", "Summarise your work so far.")]
    aside = asyncio.run(sample_aside(recorder, ask, engine, BIG, max_new_tokens=64, seed=None, counter=0,
                                     purpose="summary", turn=1))
    assert episode.info["template_restarts"] == 1 and [s.ended_by for s in episode.segments] == ["template"]
    closed = episode.segments[0]
    assert closed.loss_mask.count(1) == len(ids) and closed.behavior_logprobs[-1] == -0.5
    summary = renderer.assistant_ids("The sum is pending.")
    assert episode.input_ids[aside.start:] == summary and episode.loss_mask[aside.start:] == [1] * len(summary)
    assert episode.input_ids[:aside.start] == renderer.prompt_ids([*closed.messages, *ask], tools())
    assert_is_fresh_rendering(renderer, episode.input_ids, episode.messages)


def test_a_run_that_cannot_train_template_segments_is_warned_at_start_up(tokenizer):
    """Qwen3-style templates cut episodes with user messages into segments: the trainer says so before step 1."""
    import warnings

    from ctxrl.config import load_config
    from ctxrl.train.trainer import check_template_segments

    qwen3, qwen25 = family_renderer(tokenizer, "qwen3"), family_renderer(tokenizer, "qwen2_5")
    assert qwen3.rewrites_history() and not qwen25.rewrites_history()
    with pytest.warns(UserWarning, match="algo.advantage=reinforce_pp .* and algo.agg=seq-mean-token-mean"):
        check_template_segments(load_config(None, ["algo.advantage=reinforce_pp", "algo.agg=seq-mean-token-mean"]),
                                qwen3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_template_segments(load_config(None, ["algo.advantage=reinforce_pp"]), qwen25)  # prefix-preserving
        check_template_segments(load_config(None), qwen3)  # grpo, token-mean: segments train
        check_template_segments(load_config(None, ["meta.num_attempts=2", "algo.advantage=meta",
                                                   "env.name=minesweeper"]), qwen3)  # meta trains them too


def test_the_turn_end_is_eos_or_the_end_id_the_template_writes():
    """Gemma's templates close turns with <end_of_turn> while its eos is <eos>: the renderer ends turns with the token
    the template writes."""
    from ctxrl.chat.render import turn_end

    vocab = {"<eos>": 1, "<end_of_turn>": 106, "<other>": 7}

    class Tokenizer:
        def convert_tokens_to_ids(self, token):
            return vocab[token]

        def convert_ids_to_tokens(self, i):
            return {v: k for k, v in vocab.items()}.get(i)

    tok = Tokenizer()
    assert turn_end(tok, "{{ m.content + '<eos>' }}", "<eos>", [106]) == ("<eos>", 1)
    assert turn_end(tok, "{{ m.content + '<end_of_turn>' }}", "<eos>", [7, 106]) == ("<end_of_turn>", 106)
    assert turn_end(tok, "{{ m.content }}", "<eos>", [7, 106]) == ("<eos>", 1)  # neither: the checks will say so
    assert turn_end(tok, "", "<eos>", [106]) == ("<eos>", 1)


def test_the_chatml_template_is_the_turns_template_with_chatml_markers():
    """The tiny models' template (baked into every built tiny model) is unchanged since it became one case of
    ``turns_template``: its text's hash is the one it had before."""
    import hashlib

    from ctxrl.chat.template import CHATML_TOOLS_TEMPLATE, GEMMA_TURNS_TEMPLATE, turns_template

    assert CHATML_TOOLS_TEMPLATE == turns_template("<|im_start|>", "<|im_end|>")
    assert hashlib.sha256(CHATML_TOOLS_TEMPLATE.encode()).hexdigest()[:16] == "e87ad3fca41e8bbf"
    assert GEMMA_TURNS_TEMPLATE.startswith("{{ bos_token }}") and "<|im_" not in GEMMA_TURNS_TEMPLATE
    assert GEMMA_TURNS_TEMPLATE.count("<start_of_turn>model") == 2  # the model's turns and the generation prompt
