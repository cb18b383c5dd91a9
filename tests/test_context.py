"""The summarize context manager: token-faithful segments, trained summaries, broadcast advantages."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from ctxrl.algo.estimators import get_estimator, token_advantages
from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.config import ConfigError, load_config
from ctxrl.engine.base import Completion
from ctxrl.envs.kv_chain import KVChainEnv
from ctxrl.prompts import BRANCH_HEADER, SUMMARY_INSTRUCTION
from ctxrl.rollout.agent import run_episode
from ctxrl.rollout.managers import ContextPolicy, get_manager
from ctxrl.rollout.managers.stats import context_stats
from ctxrl.rollout.managers.summarize import restart_messages
from ctxrl.rollout.recorder import Recorder
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.run import step as step_module
from ctxrl.types import Episode, Task


class OracleEngine:
    """A scripted kv_chain policy that reads its prompt: look up the latest key, answer the value,
    and summarise (``next KEY``) whenever the prompt ends with the summary instruction."""

    policy_version = 0

    def __init__(self, renderer, instruction: str, logprob: float = -0.25) -> None:
        self.renderer, self.instruction, self.logprob = renderer, instruction, logprob
        self.prompts: list[list[int]] = []
        self.summaries: list[str] = []

    def load_weights(self, state, *, version: int) -> None:
        self.policy_version = version

    def _latest(self, text: str) -> tuple[str, str]:
        found = [(m.start(), "key", m.group(1)) for m in re.finditer(r"(?:next|key|from) (K\d{4})", text)]
        found += [(m.start(), "value", m.group(1)) for m in re.finditer(r"value (\d+)", text)]
        _, kind, what = max(found)
        return kind, what

    async def generate(self, prompt_ids, params) -> Completion:
        self.prompts.append(list(prompt_ids))
        text = self.renderer.decode(prompt_ids)
        kind, what = self._latest(text)
        if text.rstrip().endswith("assistant") and self.instruction in text[-400:]:
            out = f"summary {len(self.summaries)}: " + (f"next {what}" if kind == "key" else f"value {what}")
            self.summaries.append(out)
        elif kind == "value":
            out = f"<answer>{what}</answer>"
        else:
            out = format_tool_call("lookup", {"key": what})
        ids = self.renderer.assistant_ids(out)[: params.max_new_tokens]
        return Completion(ids, [self.logprob] * len(ids), "stop" if ids[-1] == self.renderer.eos_id else "length")


def _episode(renderer, max_summaries: int, slack: int = 120, manager: str = "summarize"):
    task = KVChainEnv.sample_tasks("ood", 1, seed=5)[0]
    env = KVChainEnv()
    opening = env.reset(task)
    tools = [t.schema() for t in env.tools]
    budget = len(renderer.prompt_ids(opening, tools)) + slack
    policy = ContextPolicy(manager=manager, max_context_tokens=budget,
                           options={"max_summaries": max_summaries, "max_tokens": 48} if manager != "window" else {})
    limits = RolloutLimits(max_turns=task.context["hops"] + 1, max_new_tokens=64, max_total_tokens=4096,
                           context=policy)
    engine = OracleEngine(renderer, SUMMARY_INSTRUCTION)
    episode = asyncio.run(run_episode(KVChainEnv(), task, engine, renderer, limits, seed=0))
    return task, opening, tools, engine, episode


def test_segments_are_token_faithful_and_restart_from_system_task_and_summary(renderer):
    task, opening, tools, engine, episode = _episode(renderer, max_summaries=10)
    assert episode.success and episode.truncation is None
    assert len(episode.segments) >= 2 and episode.info["summaries"] == len(episode.segments)
    sequences = episode.sequences()
    for seq in sequences:
        n = len(seq.input_ids)
        assert len(seq.loss_mask) == len(seq.behavior_logprobs) == len(seq.turn_index) == n
        assert all(lp == 0.0 for lp, m in zip(seq.behavior_logprobs, seq.loss_mask) if not m)
    # every generation's prompt is a prefix of the sequence it was sampled in (prefix property)
    for prompt in engine.prompts:
        assert any(seq.input_ids[: len(prompt)] == prompt for seq in sequences)
    # segment 0 starts with the opening; segment k with exactly system + task + summary k-1, as rendered
    assert sequences[0].input_ids[: len(renderer.prompt_ids(opening, tools))] == renderer.prompt_ids(opening, tools)
    for k, summary in enumerate(engine.summaries):
        restart = renderer.prompt_ids(restart_messages(opening, summary), tools)
        nxt = sequences[k + 1]
        assert nxt.input_ids[: len(restart)] == restart and not any(nxt.loss_mask[: len(restart)])
        # the summary ends segment k as sampled tokens (mask 1, behaviour log-probs kept)
        ids = renderer.assistant_ids(summary)
        seg = sequences[k]
        assert seg.input_ids[-len(ids):] == ids and all(seg.loss_mask[-len(ids):])
        assert all(lp == -0.25 for lp in seg.behavior_logprobs[-len(ids):])
        assert seg.ended_by == "summary"
    # the working context stayed near the budget, unlike the full history
    stats = context_stats([episode])
    assert stats["summaries_per_episode"] == len(episode.segments) and stats["context_tokens_saved"] > 0


def test_summary_limit_ends_the_episode(renderer):
    _, _, _, _, capped = _episode(renderer, max_summaries=1)
    assert capped.truncation == "max_context" and capped.info["summaries"] == 1 and len(capped.segments) == 1
    _, _, _, _, none = _episode(renderer, max_summaries=0)
    assert none.truncation == "max_context" and not none.segments


def test_summary_logprobs_match_the_learner(model, tokenizer, renderer):
    """Summary tokens sampled by the real engine carry the learner's log-probs (mask 1)."""
    from ctxrl.engine.hf import HFEngine
    from ctxrl.train.learner import token_logprobs

    hf = HFEngine(model, pad_token_id=tokenizer.pad_token_id, seed=0)

    class Hybrid(OracleEngine):
        async def generate(self, prompt_ids, params):
            if self.instruction in self.renderer.decode(prompt_ids[-120:]):
                self.prompts.append(list(prompt_ids))
                return await hf.generate(prompt_ids, params)
            return await super().generate(prompt_ids, params)

    task = KVChainEnv.sample_tasks("ood", 1, seed=5)[0]
    opening = KVChainEnv().reset(task)
    tools = [t.schema() for t in KVChainEnv().tools]
    policy = ContextPolicy(manager="summarize", max_context_tokens=len(renderer.prompt_ids(opening, tools)) + 120,
                           options={"max_summaries": 1, "max_tokens": 12})
    limits = RolloutLimits(max_turns=6, max_new_tokens=64, max_total_tokens=4096, temperature=1.0, context=policy)
    engine = Hybrid(renderer, SUMMARY_INSTRUCTION)
    episode = asyncio.run(run_episode(KVChainEnv(), task, engine, renderer, limits, seed=3))
    assert episode.info["summaries"] == 1
    seq = episode.sequences()[-1] if not episode.segments else episode.segments[0]
    positions = [i for i in range(len(seq.input_ids)) if seq.loss_mask[i] and seq.behavior_logprobs[i] != -0.25]
    assert len(positions) >= 1  # the summary's sampled tokens
    ids = torch.tensor([seq.input_ids])
    with torch.no_grad():
        learner = token_logprobs(model, ids, torch.ones_like(ids))[0]  # log p(token t+1 | <= t)
    for i in positions:
        assert abs(learner[i - 1].item() - seq.behavior_logprobs[i]) < 1e-4


def _ep(group: int, reward: float, segments: int) -> Episode:
    e = Episode(task=Task(id="t", prompt="p", answer="a"), group_id=group, reward=reward)
    rec = Recorder(e)
    for k in range(segments):
        rec.write_ids([1, 2], sampled=False, turn=-1)
        rec.write_ids([3, 4, 5], sampled=True, turn=0, logprobs=[-1.0] * 3)
        if k < segments - 1:
            rec.close_segment(ended_by="summary")
            rec.write_ids([9], sampled=False, turn=-1)
    return e


def test_advantages_are_per_episode_and_broadcast_to_every_segment():
    eps = [_ep(0, 1.0, segments=3), _ep(0, 0.0, segments=1), _ep(1, 1.0, segments=2), _ep(1, 1.0, segments=1)]
    rows = get_estimator("grpo")().estimate(eps)
    # group statistics over the episodes (2 per group), never over the 7 sequences: +-1/sqrt(2), then 0, 0
    expected = 2 ** -0.5
    assert [round(r[0].advantages[-1], 4) for r in rows] == [round(expected, 4), round(-expected, 4), 0.0, 0.0]
    # the same values the token-level path gives an unsegmented episode
    plain = [_ep(0, 1.0, 1), _ep(0, 0.0, 1)]
    assert abs(token_advantages("grpo", plain)[0][-1] - expected) < 1e-5
    seqs = [row for r in rows for row in r]
    assert [len(r) for r in rows] == [3, 1, 2, 1] and len(seqs) == 7
    for s in seqs[:3]:
        assert len(s.advantages) == len(s.input_ids)
        assert all(abs(x - expected) < 1e-5 for x, m in zip(s.advantages, s.loss_mask) if m)
        assert all(x == 0.0 for x, m in zip(s.advantages, s.loss_mask) if not m)
    # a segment without sampled tokens is not trained
    empty = _ep(0, 1.0, segments=2)
    rec = Recorder(empty)
    rec.close_segment(ended_by="summary")
    rec.write_ids([7, 7], sampled=False, turn=-1)
    assert len(get_estimator("grpo")().estimate([empty])[0]) == 2
    with pytest.raises(ValueError, match="one_per_episode"):
        get_estimator("reinforce_pp")().estimate(eps)


def test_eval_summary_limit_overrides_training_and_config_checks():
    from ctxrl.rollout.spec import RolloutSpec

    cfg = load_config(None, ["model.name=tiny:pretrain_steps=0", "env.name=kv_chain", "context.manager=summarize",
                             "context.max_context_tokens=300", "context.summarize.max_summaries=1",
                             "context.summarize.eval_max_summaries=4", "rollout.max_total_tokens=512",
                             "run.progress=false"])
    spec = RolloutSpec.from_config(cfg)
    train, evaluation = spec.train.context, spec.eval.context
    assert (train.phase, evaluation.phase) == ("train", "eval")
    assert train.make().options.limit(train.phase) == 1 and evaluation.make().options.limit(evaluation.phase) == 4
    assert spec.train.context.max_context_tokens == 300
    with pytest.raises(ConfigError, match="needs context.max_context_tokens > 0"):
        load_config(None, ["context.manager=summarize"])
    with pytest.raises(ConfigError, match="must not exceed rollout.max_total_tokens"):
        load_config(None, ["context.manager=summarize", "context.max_context_tokens=4096"])
    with pytest.raises(ConfigError, match="one advantage per episode or rows per segment \\(grpo, dr_grpo, rloo"):
        load_config(None, ["context.manager=summarize", "context.max_context_tokens=300", "algo.advantage=gae"])
    with pytest.raises(ConfigError, match="algo.agg=token-mean"):
        load_config(None, ["context.manager=fold", "algo.agg=seq-mean-token-mean"])
    with pytest.raises(ConfigError, match="kl_placement=loss"):
        load_config(None, ["context.manager=fold", "algo.kl_coef=0.1", "algo.kl_placement=reward"])
    with pytest.raises(ConfigError, match="must exceed rollout.max_new_tokens"):
        load_config(None, ["context.manager=window", "context.max_context_tokens=40"])
    with pytest.raises(ConfigError, match="applies to context managers with a budget"):
        load_config(None, ["context.manager=fold", "context.budget_start_tokens=300"])


def test_rl_step_trains_on_segments(tmp_path, renderer):
    """One RL step with summaries: sequences = segments, metrics reported, the update runs."""
    from ctxrl.run.build import build, start_learning

    cfg = load_config(None, ["model.name=tiny:pretrain_steps=0", "env.name=kv_chain", "context.manager=summarize",
                             "context.max_context_tokens=300", "context.summarize.max_summaries=6", "env.max_turns=8",
                             "context.budget_start_tokens=330", "context.budget_steps=10",
                             "rollout.max_total_tokens=1024", "rollout.max_new_tokens=64", "rollout.tasks_per_step=2",
                             "rollout.group_size=2", "run.progress=false", "sft.enabled=false"])
    run = build(cfg, tmp_path)
    start_learning(run)

    summarize = cfg.settings_of("context", "summarize")
    run.worker.engine = OracleEngine(renderer, summarize.instruction)
    row = step_module.rl_step(run, 0)
    assert row["context_budget"] == 330  # step 0 of the shrinking-budget curriculum (330 -> 300 over 10 steps)
    assert row["summaries_per_episode"] > 0 and row["trained_sequences"] > row["trained_episodes"]
    # generations fit the budget; the summary step may pass it by one observation + instruction + summary
    instruction = len(renderer.encode(summarize.instruction)) + 8
    assert row["context_peak_tokens_max"] <= 330 + 30 + instruction + summarize.max_tokens
    assert row["success"] == 1.0 and row["context_tokens_saved"] > 0
    assert "loss" in row


def test_window_drops_whole_turns_and_keeps_the_budget(renderer):
    from ctxrl.rollout.managers.window import split_turns

    task, opening, tools, engine, episode = _episode(renderer, max_summaries=0, slack=200, manager="window")
    assert episode.success and episode.info["windows"] == len(episode.segments) >= 1
    assert not engine.summaries and all(s.ended_by == "window" for s in episode.segments)
    budget = len(renderer.prompt_ids(opening, tools)) + 200
    sequences = episode.sequences()
    for seq in sequences:
        assert len(seq.input_ids) <= budget  # every sequence stays within the working budget
        head, turns = split_turns(seq.messages)
        assert head == opening and all(t[0].role == "assistant" for t in turns)  # whole turns only
    for prev, nxt in zip(sequences, sequences[1:]):
        first_sampled = nxt.loss_mask.index(1)
        prompt = nxt.input_ids[:first_sampled]
        # the new segment's prompt is a fresh rendering of the opening + the newest whole turns
        j = next(j for j in range(1, len(nxt.messages) + 1) if renderer.prompt_ids(nxt.messages[:j], tools) == prompt)
        kept = nxt.messages[len(opening):j]
        _, prev_turns = split_turns(prev.messages)
        contents = [m.content for m in prev.messages]
        assert kept and kept[0].role == "assistant" and kept[0].content in contents  # an old turn kept whole
        assert prev_turns[0][0].content not in [m.content for m in nxt.messages]  # the oldest turn was dropped
        # the newest turn is always kept, with the observation the model had not seen yet
        assert kept[-1].role == "tool" and kept[-1].content not in contents
        assert kept[-2].content == prev.messages[-1].content
    # too small a budget for even the opening and one turn: the episode ends
    _, _, _, _, cut = _episode(renderer, max_summaries=0, slack=30, manager="window")
    assert cut.truncation == "max_context"


def test_budget_curriculum_shrinks_linearly_to_the_final_budget():
    from ctxrl.rollout.managers.stats import scheduled_budget

    assert [scheduled_budget(s, final=300, start=700, steps=4) for s in range(6)] == [700, 600, 500, 400, 300, 300]
    assert scheduled_budget(0, final=300) == 300 and scheduled_budget(3, final=300, start=700, steps=0) == 300
    with pytest.raises(ConfigError, match="budget_start_tokens"):
        load_config(None, ["context.manager=summarize", "context.max_context_tokens=300",
                           "context.budget_start_tokens=200"])


@pytest.mark.slow  # minutes on a 2-core CPU: out of the default run (`-m slow` runs it)
def test_context_experiment_runs_end_to_end(tmp_path):
    """experiments/context.py on the random-init model: every manager trains, the summary sweep evaluates.

    The script runs with this checkout's ctxrl first on its path (a worktree's, not an installed copy's)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    script = root / "experiments" / "context.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(script), "--model", "tiny:pretrain_steps=0", "--steps", "1",
                           "--budget", "384", "--eval-summaries", "0,2", "--managers", "full,window,summarize,select",
                           "--out", str(tmp_path), "sft.demos=4", "sft.epochs=1", "sft.batch_size=4", "eval.tasks=2",
                           "rollout.tasks_per_step=2", "rollout.group_size=2"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "summary.json").read_text())
    assert set(results) == {"full", "window", "summarize", "select"}
    assert results["select"]["selections_per_episode"] is not None
    assert set(results["summarize"]["heldout_by_eval_summaries"]) == {"0", "2"}
    assert set(results["summarize"]["ood_by_eval_summaries"]) == {"0", "2"}
    assert set(results["select"]["heldout_by_eval_summaries"]) == {"0", "2"}  # select's limit is swept too
    assert "heldout_by_eval_summaries" not in results["window"]
    assert results["window"]["peak_context"] is not None and results["full"]["peak_context"] is None
    assert (tmp_path / "context.png").stat().st_size > 0


class FoldOracle(OracleEngine):
    """Parent: branch into 'follow the chain', then answer the branch's result. Branch: look up, then return."""

    def __init__(self, renderer, misuse: bool = False) -> None:
        super().__init__(renderer, instruction="\x00")
        self.misuse = misuse

    async def generate(self, prompt_ids, params) -> Completion:
        self.prompts.append(list(prompt_ids))
        text = self.renderer.decode(prompt_ids)
        if BRANCH_HEADER.strip() in text:  # inside the branch
            kind, what = self._latest(text)
            if self.misuse and "Error: a branch cannot" not in text:
                out = format_tool_call("branch", {"goal": "nested"})
            else:
                out = format_tool_call("return", {"result": what}) if kind == "value" else \
                    format_tool_call("lookup", {"key": what})
        elif "<tool_response>" in text:  # the branch came back (or a misuse was answered)
            if self.misuse and "Error: return is only" not in text:
                out = format_tool_call("return", {"result": "too early"})
            elif "Error: return is only" in text.rsplit("<tool_response>", 1)[1]:
                _, start = self._latest(text.split("<tool_response>")[0])
                out = format_tool_call("branch", {"goal": f"follow the chain from {start} to its value"})
            else:
                out = f"<answer>{text.rsplit('<tool_response>', 1)[1].split('</tool_response>')[0].strip()}</answer>"
        else:
            _, start = self._latest(text)
            out = format_tool_call("branch", {"goal": f"follow the chain from {start} to its value"})
        ids = self.renderer.assistant_ids(out)[: params.max_new_tokens]
        return Completion(ids, [self.logprob] * len(ids), "stop" if ids[-1] == self.renderer.eos_id else "length")


def _fold_episode(renderer, misuse: bool = False):
    task = KVChainEnv.sample_tasks("ood", 1, seed=5)[0]
    limits = RolloutLimits(max_turns=task.context["hops"] + 6, max_new_tokens=64, max_total_tokens=4096,
                           context=ContextPolicy(manager="fold"))
    engine = FoldOracle(renderer, misuse)
    return task, engine, asyncio.run(run_episode(KVChainEnv(), task, engine, renderer, limits, seed=0))


def test_fold_branch_tokens_never_enter_the_parent(renderer):
    from ctxrl.rollout.managers.fold import FOLD_TOOL_SCHEMAS, branch_messages

    task, engine, episode = _fold_episode(renderer)
    assert episode.success and episode.truncation is None and episode.info["branches"] == 1
    (branch,), parent = episode.segments, episode.sequences()[-1]
    assert branch.ended_by == "fold"
    opening = KVChainEnv().reset(task)
    tools = [t.schema() for t in KVChainEnv().tools] + FOLD_TOOL_SCHEMAS
    goal = next(c.arguments["goal"] for m in parent.messages if m.role == "assistant" for c in m.tool_calls)
    start = renderer.prompt_ids(branch_messages(opening, goal), tools)
    assert branch.input_ids[: len(start)] == start  # the branch starts from the short context, exactly
    # nothing the branch saw or sampled is in the parent: only the branch call, its result, the answer
    assert [m.role for m in parent.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert parent.messages[3].content == task.answer and parent.messages[3].name == "branch"
    child_calls = [renderer.encode(m.content) for m in branch.messages if m.role == "assistant"]
    joined = ",".join(map(str, parent.input_ids))
    assert all(",".join(map(str, ids)) not in joined for ids in child_calls)
    assert "next K" not in renderer.decode(parent.input_ids)
    # both sequences train: sampled tokens carry their behaviour log-probs
    assert sum(branch.loss_mask) > 0 and sum(parent.loss_mask) > 0
    assert context_stats([episode])["branches_per_episode"] == 1


def test_fold_misuse_is_an_error_observation(renderer):
    from ctxrl.engine.scripted import ScriptedEngine

    task = KVChainEnv.sample_tasks("ood", 1, seed=5)[0]
    *lookups, answer = KVChainEnv.solve(task)
    texts = [format_tool_call("return", {"result": "too early"}),          # return outside a branch
             format_tool_call("branch", {"goal": "follow the chain"}),
             format_tool_call("branch", {"goal": "nested"}),                # a branch inside a branch
             *lookups, format_tool_call("return", {"result": task.answer}), answer]
    limits = RolloutLimits(max_turns=len(texts), max_new_tokens=64, max_total_tokens=4096,
                           context=ContextPolicy(manager="fold", options={"max_branches": 1}))
    episode = asyncio.run(run_episode(KVChainEnv(), task, ScriptedEngine(texts, renderer), renderer, limits, seed=0))
    assert episode.success and episode.info["branches"] == 1
    tool_texts = [m.content for s in episode.sequences() for m in s.messages if m.role == "tool"]
    assert any("return is only for ending a branch" in t for t in tool_texts)
    assert any("a branch cannot open another branch" in t for t in tool_texts)
    assert [t.tool_errors for t in episode.turns[:3]] == [1, 0, 1]


def test_fold_appends_nothing_on_the_last_turn_and_never_branches_there(renderer):
    from ctxrl.engine.scripted import ScriptedEngine

    task = KVChainEnv.sample_tasks("train", 1, seed=2)[0]
    *lookups, _ = KVChainEnv.solve(task)
    texts = [format_tool_call("branch", {"goal": "follow the chain"}), *lookups,
             format_tool_call("return", {"result": task.answer})]
    limits = RolloutLimits(max_turns=len(texts), max_new_tokens=64, max_total_tokens=4096,
                           context=ContextPolicy(manager="fold"))
    episode = asyncio.run(run_episode(KVChainEnv(), task, ScriptedEngine(texts, renderer), renderer, limits, seed=0))
    parent = episode.sequences()[-1]
    assert episode.truncation == "max_turns" and parent.loss_mask[-1] == 1  # no unseen observation trained
    # a branch asked for on the last turn is refused, and leaves no empty segment behind
    late = RolloutLimits(max_turns=1, max_new_tokens=64, max_total_tokens=4096, context=ContextPolicy(manager="fold"))
    one = asyncio.run(run_episode(KVChainEnv(), task, ScriptedEngine(texts[:1], renderer), renderer, late, seed=0))
    assert not one.segments and one.turns[0].tool_errors == 1 and one.sequences()[-1].loss_mask[-1] == 1


def test_branch_reward_goes_to_the_tokens_of_branches_that_returned_a_result(renderer):
    """Hand-made segments: only the branch that returned a result (ended_by fold) gets the reward."""
    from ctxrl.algo.estimators import broadcast
    from ctxrl.engine.scripted import ScriptedEngine

    e = Episode(task=Task(id="t", prompt="p", answer="a"))
    rec = Recorder(e)
    rec.write_ids([1, 2], sampled=False, turn=-1)
    for ended_by in ("fold", "fold-empty", "fold-unfinished"):
        rec.write_ids([3, 4], sampled=True, turn=0, logprobs=[-1.0, -1.0])
        rec.close_segment(ended_by=ended_by)
        rec.write_ids([1, 2], sampled=False, turn=-1)
    rec.write_ids([5], sampled=True, turn=1, logprobs=[-1.0])
    fold = get_manager("fold")
    paying = ContextPolicy(manager="fold", options={"branch_reward": 0.1})
    rows = broadcast(e, 0.5, lambda s: fold.segment_bonus(s, paying))
    assert [len(r.input_ids) for r in rows] == [4, 4, 4, 3]
    expected = [[0, 0, 0.6, 0.6], [0, 0, 0.5, 0.5], [0, 0, 0.5, 0.5], [0, 0, 0.5]]
    assert [r.advantages == pytest.approx(want) for r, want in zip(rows, expected)] == [True] * 4
    off = broadcast(e, 0.5, lambda s: fold.segment_bonus(s, ContextPolicy(manager="fold")))
    assert off[0].advantages == [0.0, 0.0, 0.5, 0.5]  # off by default

    # a branch that returns nothing ends as fold-empty, and does not count as returned
    task = KVChainEnv.sample_tasks("train", 1, seed=2)[0]
    *lookups, answer = KVChainEnv.solve(task)
    texts = [format_tool_call("branch", {"goal": "follow the chain"}), format_tool_call("return", {"result": " "}),
             format_tool_call("branch", {"goal": "follow the chain"}), *lookups,
             format_tool_call("return", {"result": task.answer}), answer]
    limits = RolloutLimits(max_turns=len(texts), max_new_tokens=64, max_total_tokens=4096,
                           context=ContextPolicy(manager="fold"))
    episode = asyncio.run(run_episode(KVChainEnv(), task, ScriptedEngine(texts, renderer), renderer, limits, seed=0))
    assert episode.success and [s.ended_by for s in episode.segments] == ["fold-empty", "fold"]
    stats = context_stats([episode])
    assert stats["branches_per_episode"] == 2 and stats["branches_returned_per_episode"] == 1


def test_rl_step_credits_the_branch_reward_to_branch_tokens(tmp_path, renderer, monkeypatch):
    from ctxrl.run.build import build, start_learning

    cfg = load_config(None, ["model.name=tiny:pretrain_steps=0", "env.name=kv_chain", "context.manager=fold",
                             "context.fold.branch_reward=0.25", "env.max_turns=10", "rollout.max_total_tokens=1024",
                             "rollout.max_new_tokens=64", "rollout.tasks_per_step=2", "rollout.group_size=2",
                             "run.progress=false", "sft.enabled=false"])
    run = build(cfg, tmp_path)
    start_learning(run)
    seen = {}
    update = step_module.update

    def capture(run, rows, step):
        seen["rows"] = list(rows)
        return update(run, rows, step)

    monkeypatch.setattr(step_module, "update", capture)  # (the step looks its phases up in ctxrl.run.step)
    run.worker.engine = FoldOracle(renderer)
    row = step_module.rl_step(run, 0)
    assert row["success"] == 1.0 and row["branches_returned_per_episode"] == 1.0
    # every episode succeeded: the outcome advantage is 0, so what is left is the branch reward, on branches only
    branch_rows = [r for r in seen["rows"] if BRANCH_HEADER.strip() in renderer.decode(r.input_ids)]
    parent_rows = [r for r in seen["rows"] if BRANCH_HEADER.strip() not in renderer.decode(r.input_ids)]
    assert len(branch_rows) == len(parent_rows) == 4
    for r in seen["rows"]:
        expected = 0.25 if BRANCH_HEADER.strip() in renderer.decode(r.input_ids) else 0.0
        assert all(abs(a - expected * m) < 1e-6 for a, m in zip(r.advantages, r.loss_mask))
    with pytest.raises(ConfigError, match="applies to context.manager=fold only"):
        load_config(None, ["context.fold.branch_reward=0.1"])
    with pytest.raises(ConfigError, match="branch_reward must be >= 0"):
        load_config(None, ["context.manager=fold", "context.fold.branch_reward=-0.1"])


def test_an_environment_tool_named_like_the_context_managers_is_refused_before_the_episode(renderer):
    """fold's own tools are ``branch`` and ``return``: an environment (or MCP server) offering a ``branch`` would be
    shown beside it and every call taken by fold, so the run stops naming the tool and the fix."""
    from types import SimpleNamespace

    from ctxrl.errors import ConfigError
    from ctxrl.rollout.agent import episode_tools
    from ctxrl.rollout.managers.base import ContextPolicy
    from ctxrl.tools.base import Tool

    def tool(name):
        return Tool(name=name, description="d", parameters={"type": "object", "properties": {}}, fn=lambda: "")

    fold = ContextPolicy(manager="fold").make()
    offered = episode_tools(SimpleNamespace(tools=[tool("search")]), fold, renderer)
    assert [t["function"]["name"] for t in offered] == ["search", "branch", "return"]
    with pytest.raises(ConfigError, match=r"tool named 'branch', as context.manager=fold does.*env.mcp_tools"):
        episode_tools(SimpleNamespace(tools=[tool("branch")]), fold, renderer)
