"""The select context manager (ECHO-style): kept turns verbatim, faithful segments, fallbacks, the limit, demos."""

from __future__ import annotations

import asyncio
import re

import pytest

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.config import ConfigError, load_config
from ctxrl.engine.base import Completion
from ctxrl.envs.fact_hunt import FactHuntEnv
from ctxrl.envs.kv_chain import KVChainEnv
from ctxrl.rollout.agent import run_episode
from ctxrl.rollout.managers import ContextPolicy, get_manager
from ctxrl.rollout.managers.select import instruction, parse_keep, preview, scripted_selection
from ctxrl.rollout.managers.stats import context_stats
from ctxrl.rollout.managers.window import split_turns
from ctxrl.rollout.messages import text_only
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.types import Message, Task, ToolCall


class FactOracle:
    """A fact_hunt policy that reads its prompt: follow ``next`` to the last page, then answer the first code
    it can still see and the last page's code. Asked which turns to keep, it keeps the start page's turn
    (``reply`` overrides that with a fixed text)."""

    policy_version = 0

    def __init__(self, renderer, reply: str | None = None, logprob: float = -0.25) -> None:
        self.renderer, self.reply, self.logprob = renderer, reply, logprob
        self.prompts: list[list[int]] = []
        self.replies: list[str] = []

    def load_weights(self, state, *, version: int) -> None:
        self.policy_version = version

    async def generate(self, prompt_ids, params) -> Completion:
        self.prompts.append(list(prompt_ids))
        text = self.renderer.decode(prompt_ids)
        start = re.search(r"P\d{4}", text).group(0)  # the task names the first page
        if params.purpose == "select":
            request = text.rsplit("Context full", 1)[1]
            listed = {page: n for n, page in re.findall(r"(\d+): read\((P\d{4})\)", request)}
            out = self.reply if self.reply is not None else f"<keep>{listed.get(start, '')}</keep>"
            self.replies.append(out)
        elif "<tool_response>" not in text:
            out = format_tool_call("read", {"page": start})
        else:
            last = text.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]
            if last.strip().endswith("end"):
                first = re.findall(r"code (\d+)", text)[0]  # the first code still in the context
                last_code = re.search(r"code (\d+)", last).group(1)
                out = f"<answer>{first} {last_code}</answer>"
            else:
                out = format_tool_call("read", {"page": re.search(r"next (P\d{4})", last).group(1)})
        ids = self.renderer.assistant_ids(out)[: params.max_new_tokens]
        return Completion(ids, [self.logprob] * len(ids), "stop" if ids[-1] == self.renderer.eos_id else "length")


def _limits(opening_tokens: int, slack: int, manager: str = "select", max_selections: int = 10,
            max_turns: int = 10) -> RolloutLimits:
    policy = ContextPolicy(manager=manager, max_context_tokens=opening_tokens + slack,
                           options={"max_summaries": max_selections, "max_tokens": 24})
    return RolloutLimits(max_turns=max_turns, max_new_tokens=32, max_total_tokens=4096, context=policy)


def _episode(renderer, *, slack: int = 300, manager: str = "select", max_selections: int = 10,
             reply: str | None = None):
    task = FactHuntEnv.sample_tasks("ood", 1, seed=3)[0]
    env = FactHuntEnv()
    opening = env.reset(task)
    tools = [t.schema() for t in env.tools]
    limits = _limits(len(renderer.prompt_ids(opening, tools)), slack, manager, max_selections,
                     max_turns=task.context["pages"] + 1)
    engine = FactOracle(renderer, reply)
    episode = asyncio.run(run_episode(FactHuntEnv(), task, engine, renderer, limits, seed=0))
    return task, opening, tools, limits, engine, episode


def _restart_turns(opening, prev, nxt, renderer, tools):
    """(kept earlier turns, the newest turn) of the prompt segment ``nxt`` restarted from after segment ``prev``."""
    first_sampled = nxt.loss_mask.index(1)
    prompt = nxt.input_ids[:first_sampled]
    j = next(j for j in range(1, len(nxt.messages) + 1) if renderer.prompt_ids(nxt.messages[:j], tools) == prompt)
    assert nxt.messages[:len(opening)] == opening
    _, turns = split_turns(nxt.messages[:j])
    return turns[:-1], turns[-1]


def test_select_segments_are_token_faithful_and_restart_from_opening_kept_turns_and_the_newest(renderer):
    task, opening, tools, limits, engine, episode = _episode(renderer)
    assert episode.success and episode.truncation is None  # the first code survived every selection
    selections = episode.info["selections"]
    assert selections == len(episode.segments) >= 2 and episode.info["select_fallbacks"] == 0
    sequences = episode.sequences()
    for seq in sequences:
        n = len(seq.input_ids)
        assert len(seq.loss_mask) == len(seq.behavior_logprobs) == len(seq.turn_index) == n
        assert all(lp == 0.0 for lp, m in zip(seq.behavior_logprobs, seq.loss_mask) if not m)
    for prompt in engine.prompts:  # every generation's prompt is a prefix of the sequence it was sampled in
        assert any(seq.input_ids[: len(prompt)] == prompt for seq in sequences)
    start = renderer.prompt_ids(opening, tools)
    assert sequences[0].input_ids[: len(start)] == start
    first_code = task.answer.split()[0]
    for k, (prev, nxt) in enumerate(zip(sequences, sequences[1:])):
        assert prev.ended_by == "select"
        # the segment ends with the request (context) and the reply (sampled, behaviour log-probs kept)
        assert prev.messages[-2].role == "user" and prev.messages[-2].content.startswith("Context full.")
        reply = prev.messages[-1].content
        assert reply == engine.replies[k]
        ids = renderer.assistant_ids(reply)
        assert prev.input_ids[-len(ids):] == ids and all(prev.loss_mask[-len(ids):])
        assert all(lp == -0.25 for lp in prev.behavior_logprobs[-len(ids):])
        # the next segment is a fresh rendering of: the opening, the kept turn (the first page's), the newest turn
        kept, newest = _restart_turns(opening, prev, nxt, renderer, tools)
        assert len(kept) == 1 and f"code {first_code}" in kept[0][1].content
        assert kept[0][0].tool_calls == [] and kept[0][0].content == prev.messages[len(opening)].content
        observations = prev.messages[len(opening):-2]
        unseen = observations[-1]  # the observation that did not fit, now shown
        assert newest[-1] == unseen and newest[0].content == observations[-2].content
        expected = renderer.prompt_ids([*opening, *kept[0], *(text_only(m) for m in newest)], tools)
        assert nxt.input_ids[: len(expected)] == expected and not any(nxt.loss_mask[: len(expected)])
        assert len(expected) + limits.max_new_tokens <= limits.context.max_context_tokens
    for seq in sequences:  # every action turn was generated within the budget (the selection step may pass it)
        starts = [i for i in range(len(seq.loss_mask)) if seq.loss_mask[i] and (i == 0 or not seq.loss_mask[i - 1])]
        turns = starts[:-1] if seq.ended_by == "select" else starts
        assert all(s + limits.max_new_tokens <= limits.context.max_context_tokens for s in turns)
    stats = context_stats([episode])
    assert stats["selections_per_episode"] == selections and stats["turns_kept_per_selection"] == 1.0
    assert stats["select_fallbacks_per_episode"] == 0 and stats["context_tokens_saved"] > 0


def test_window_loses_the_first_code_that_select_keeps(renderer):
    *_, window = _episode(renderer, manager="window")
    assert window.info["windows"] >= 1 and not window.success  # the first page's code was dropped


def test_turns_keep_their_episode_numbers_across_selections(renderer):
    *_, engine, episode = _episode(renderer)
    requests = [s.messages[-2].content for s in episode.segments]
    numbers = [[int(n) for n in re.findall(r"^(\d+):", r, re.M)] for r in requests]
    assert numbers[0][0] == 1 and all(ns[0] == 1 for ns in numbers)  # turn 1 (kept) is listed as 1 every time
    for ns in numbers:
        assert ns == sorted(ns) and len(set(ns)) == len(ns)
    assert all(r == "<keep>1</keep>" for r in engine.replies)


def test_an_unparseable_reply_falls_back_to_the_newest_turns_that_fit(renderer):
    task, opening, tools, limits, engine, episode = _episode(renderer, reply="keep the first one please")
    assert episode.info["select_fallbacks"] == episode.info["selections"] >= 1
    for prev, nxt in zip(episode.sequences(), episode.sequences()[1:]):
        kept, newest = _restart_turns(opening, prev, nxt, renderer, tools)
        _, earlier = split_turns(prev.messages[:-2])
        earlier = earlier[:-1]
        # like window: a suffix of the earlier turns, the longest that fits
        assert [t[0].content for t in kept] == [t[0].content for t in earlier[len(earlier) - len(kept):]]
        longer = [*opening, *(text_only(m) for t in earlier[len(earlier) - len(kept) - 1:] for m in t),
                  *(text_only(m) for m in newest)]
        assert len(kept) == len(earlier) or \
            len(renderer.prompt_ids(longer, tools)) + limits.max_new_tokens > limits.context.max_context_tokens
    assert not episode.success  # the first page's code was not kept


def test_kept_turns_that_do_not_fit_keep_the_newest_of_them_that_do(renderer):
    _, opening, tools, limits, engine, episode = _episode(renderer, reply="<keep>1 2 3 4 5 6 7 8 9</keep>")
    assert episode.info["select_fallbacks"] >= 1
    for prev, nxt in zip(episode.sequences(), episode.sequences()[1:]):
        kept, newest = _restart_turns(opening, prev, nxt, renderer, tools)
        restart = renderer.prompt_ids([*opening, *(m for t in kept for m in t), *newest], tools)
        assert len(restart) + limits.max_new_tokens <= limits.context.max_context_tokens
        _, earlier = split_turns(prev.messages[:-2])
        assert [t[0].content for t in kept] == [t[0].content for t in earlier[:-1][len(earlier) - 1 - len(kept):]]
    # numbers that name no listed turn are ignored: an empty choice, not a fallback
    *_, ignored = _episode(renderer, reply="<keep>99</keep>")
    assert ignored.info["select_fallbacks"] == 0 and ignored.info["turns_kept"] == 0


def test_selection_limit_ends_the_episode(renderer):
    *_, capped = _episode(renderer, max_selections=1)
    assert capped.truncation == "max_context" and capped.info["selections"] == 1 and len(capped.segments) == 1
    *_, engine, none = _episode(renderer, max_selections=0)
    assert none.truncation == "max_context" and not none.segments and not engine.replies


def test_no_room_for_the_newest_turn_ends_the_episode_without_asking(renderer):
    *_, engine, cut = _episode(renderer, slack=60)
    assert cut.truncation == "max_context" and not engine.replies and "selections" not in cut.info


def test_parse_keep_and_the_request():
    assert parse_keep("<keep>1 3</keep>") == [1, 3] and parse_keep("x <keep>2,4</keep>") == [2, 4]
    assert parse_keep("<keep></keep>") == [] and parse_keep("<keep>1</keep> then <keep>5</keep>") == [5]
    assert parse_keep("keep 1") is None and parse_keep("<keep>one</keep>") is None and parse_keep("<keep>1") is None
    call = Message("assistant", "c", tool_calls=[ToolCall("read", {"page": "P1234"})])
    assert preview(call) == "read(P1234)" and preview(Message("assistant", "x " * 40)).endswith("...")
    text = instruction([(1, [call]), (3, [Message("assistant", "thinking  out\nloud")])])
    assert "1: read(P1234)\n3: thinking out loud\n" in text and text.endswith("e.g. <keep>1 3</keep>.")


def test_scripted_selection_keeps_the_turns_holding_the_summarys_numbers():
    task = Task(id="t", prompt="Read the pages from P1000 ...", answer="731 482", data={"trail": ["P1000"]})
    opening = [Message("system", "s"), Message("user", task.prompt)]
    pages = ["code 731\nother 555\nnext P2000", "other 111\ncode 222\nnext P3000", "code 482\nend"]
    messages = list(opening)
    for page in pages:
        messages += [Message("assistant", "call"), Message("tool", page, name="read")]
    script = get_manager("select").demo_script(FactHuntEnv)
    assert script(task, messages[:-2]) == "<keep>1</keep>"  # "... First code: 731. Next page: P3000."
    assert script(task, messages) == "<keep>1</keep>"  # "... First code: 731. Last code: 482." (482: newest)
    assert scripted_selection(messages, "Found 555 and 222.") == "<keep>1 2</keep>"
    assert scripted_selection(messages, "Start over at P1000.") == "<keep></keep>"  # the opening's id is no fact
    chain = get_manager("select").demo_script(KVChainEnv)
    lookups = [*opening, Message("assistant", "c"), Message("tool", "next K2000", name="lookup"),
               Message("assistant", "c"), Message("tool", "next K3000", name="lookup")]
    assert chain(task, lookups) == "<keep></keep>"  # the next key is in the newest turn
    assert get_manager("select").demo_script(type("NoHooks", (), {})) is None


def test_fact_hunt_demos_under_select_keep_the_first_page_and_answer(renderer):
    """Scripted demos (the warm start's): every selection keeps the first page's turn, and the demo succeeds."""
    from ctxrl.demos.play import build_demos

    limits = RolloutLimits(max_turns=16, max_new_tokens=32, max_total_tokens=4096,
                           context=ContextPolicy(manager="select", max_context_tokens=550,
                                                 options={"max_summaries": 8, "max_tokens": 24}))
    demos = asyncio.run(build_demos(FactHuntEnv, renderer, 20, seed=1, limits=limits))
    assert all(d.success and d.truncation is None for d in demos)
    selected = [d for d in demos if d.info.get("selections")]
    assert len(selected) >= 4 and all(d.info["select_fallbacks"] == 0 for d in selected)
    env = FactHuntEnv()
    for demo in selected:
        opening, tools = env.reset(demo.task), [t.schema() for t in env.tools]
        first_code = demo.task.answer.split()[0]
        for prev, nxt in zip(demo.sequences(), demo.sequences()[1:]):
            assert prev.ended_by == "select" and prev.messages[-1].content == "<keep>1</keep>"
            kept, _ = _restart_turns(opening, prev, nxt, renderer, tools)
            assert len(kept) == 1 and f"code {first_code}" in kept[0][1].content


def test_context_demos_and_config_checks_for_select():
    from ctxrl.envs.calculator import CalculatorEnv
    from ctxrl.train.warm_start import context_demos

    config = load_config(None, ["env.name=fact_hunt", "context.manager=select", "context.max_context_tokens=300"])
    assert context_demos(config, FactHuntEnv)  # derived from fact_hunt's summary hook
    assert not context_demos(config, CalculatorEnv)
    with pytest.raises(ConfigError, match="no select"):
        context_demos(load_config(None, ["context.manager=select", "context.max_context_tokens=300",
                                         "sft.context_demos=on"]), CalculatorEnv)
    with pytest.raises(ConfigError, match="max_context_tokens > 0"):
        load_config(None, ["context.manager=select"])
    with pytest.raises(ConfigError, match="token-mean"):
        load_config(None, ["context.manager=select", "context.max_context_tokens=300", "algo.agg=seq-mean-token-mean"])


def test_rl_step_trains_on_select_segments(tmp_path, renderer):
    """One RL step of a real run (``build``) under select on fact_hunt: segments train, the stats are logged."""
    from ctxrl.run.build import build, start_learning
    from ctxrl.run.step import rl_step

    cfg = load_config(None, ["model.name=tiny:pretrain_steps=0", "env.name=fact_hunt", "context.manager=select",
                             "context.max_context_tokens=500", "context.select.max_summaries=4", "env.max_turns=6",
                             "rollout.max_total_tokens=2048", "rollout.max_new_tokens=32", "rollout.tasks_per_step=2",
                             "rollout.group_size=2", "run.progress=false", "sft.enabled=false"])
    run = build(cfg, tmp_path)
    start_learning(run)
    run.worker.engine = FactOracle(renderer)
    row = rl_step(run, 0)
    assert row["selections_per_episode"] > 0 and row["trained_sequences"] > row["trained_episodes"]
    assert row["turns_kept_per_selection"] == 1.0 and row["select_fallbacks_per_episode"] == 0
    assert row["success"] == 1.0 and "loss" in row
