"""On-policy distillation: the reverse-KL advantage against hand-computed numbers, its masks, the teacher on the real
tiny model (a teacher identical to the student gives no signal; a perturbed one is checked against its own full
logits), the tokenizer refusal, the config's refusals, and one training step."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from ctxrl.algo.distill import distill_advantages, generation_spans, kl_breakdown, reverse_kl, token_roles
from ctxrl.algo.estimators import get_estimator
from ctxrl.algo.estimators.distill import DistillSettings
from ctxrl.config import ConfigError, load_config
from ctxrl.rollout.recorder import Recorder
from ctxrl.types import Episode, Task, Turn

TINY = "tiny:pretrain_steps=0"


def distill(**options):
    return get_estimator("distill")(options=DistillSettings(teacher="t", **options))


def tool_then_answer(group: int = 0, reward: float = 0.0) -> Episode:
    """3 prompt tokens | turn 0 (a tool call): 2 sampled | 2 observation tokens | turn 1 (an answer): 2 sampled."""
    e = Episode(task=Task(id=f"t{group}", prompt="", answer=""), group_id=group, reward=reward)
    rec = Recorder(e)
    rec.write_ids([5, 6, 7], sampled=False, turn=-1)
    rec.write_ids([10, 11], sampled=True, turn=0, logprobs=[-0.5, -1.0])
    rec.write_ids([20, 21], sampled=False, turn=0)
    rec.write_ids([12, 13], sampled=True, turn=1, logprobs=[-2.0, -0.25])
    e.turns = [Turn(index=0, prompt_tokens=3, sampled_tokens=2, finish_reason="stop", text="", tool_calls=1),
               Turn(index=1, prompt_tokens=7, sampled_tokens=2, finish_reason="stop", text="")]
    return e


TEACHER = [0.0, 0.0, 0.0, -0.25, -1.5, 0.0, 0.0, -1.0, -0.25]  # 0 where the mask is 0 (the contract)


# -- the maths -------------------------------------------------------------------------------------------------
def test_reverse_kl_and_advantage_by_hand():
    student = torch.tensor([[-0.5, -1.0, -3.0]])
    teacher = torch.tensor([[-0.25, -1.5, -0.1]])
    mask = torch.tensor([[1, 1, 0]])
    # k1 = student - teacher: -0.25, +0.5, and 0 under the mask whatever the numbers are
    assert reverse_kl(student, teacher, mask).tolist() == [[-0.25, 0.5, 0.0]]
    assert distill_advantages(student, teacher, mask, coef=2.0).tolist() == [[0.5, -1.0, -0.0]]
    with pytest.raises(ValueError, match="one shape"):
        reverse_kl(student, teacher[:, :2], mask)


def test_spans_roles_and_breakdown_by_hand():
    e = tool_then_answer()
    assert generation_spans(e.loss_mask) == [(3, 5), (7, 9)]
    roles = token_roles(e.sequences()[0], e.turns)
    assert roles == [None] * 3 + ["tool_call"] * 2 + [None] * 2 + ["answer"] * 2
    # a segment closed by a summary: its last generation is the summary, even with turn 0's index
    summary = Episode(task=e.task)
    rec = Recorder(summary)
    rec.write_ids([5], sampled=False, turn=-1)
    rec.write_ids([10], sampled=True, turn=0, logprobs=[-1.0])
    rec.write_ids([20], sampled=False, turn=0)
    rec.write_ids([30, 31], sampled=True, turn=0, logprobs=[-1.0, -1.0])
    rec.close_segment(ended_by="summary")
    assert token_roles(summary.segments[0], e.turns) == [None, "tool_call", None, "summary", "summary"]
    figures = kl_breakdown([(0.5, 0, "tool_call"), (1.5, 0, "tool_call"), (-1.0, 1, "answer"), (2.0, 0, "summary")])
    assert figures == {"teacher_kl": 0.75, "teacher_kl_turn_0": 4.0 / 3, "teacher_kl_turn_1": -1.0,
                       "teacher_kl_tool_call": 1.0, "teacher_kl_answer": -1.0, "teacher_kl_summary": 2.0,
                       "teacher_kl_tokens": 4.0}


def test_estimator_advantage_is_minus_coef_k1_on_sampled_tokens_only():
    e = tool_then_answer()
    [[row]] = distill(coef=2.0).estimate([e], teacher_logprobs=[[TEACHER]])
    # sampled tokens: behaviour -0.5, -1.0, -2.0, -0.25 against teacher -0.25, -1.5, -1.0, -0.25
    # k1 = -0.25, 0.5, -1.0, 0.0 -> A = -2 * k1 = 0.5, -1.0, 2.0, 0.0
    assert row.advantages == pytest.approx([0, 0, 0, 0.5, -1.0, 0, 0, 2.0, 0.0])
    assert row.input_ids == e.input_ids and row.loss_mask == e.loss_mask
    # values at masked positions (prompt, tool output) never reach an advantage
    noisy = [v if m else 7.0 for v, m in zip(TEACHER, e.loss_mask)]
    [[again]] = distill(coef=2.0).estimate([e], teacher_logprobs=[[noisy]])
    assert again.advantages == row.advantages


def test_a_teacher_equal_to_the_student_gives_no_signal_and_an_outcome_mixes_in():
    a, b = tool_then_answer(0, reward=1.0), tool_then_answer(0, reward=0.0)
    same = [[list(a.behavior_logprobs)], [list(b.behavior_logprobs)]]
    rows = distill().estimate([a, b], teacher_logprobs=same)
    assert all(x == 0.0 for [row] in rows for x in row.advantages)
    # outcome 0.5 with GRPO: rewards [1, 0] in one group -> +-1/sqrt(2) on every sampled token, times 0.5
    rows = distill(outcome=0.5).estimate([a, b], teacher_logprobs=same)
    half = 0.5 / math.sqrt(2)
    assert rows[0][0].advantages == pytest.approx([half * m for m in a.loss_mask], abs=1e-5)
    assert rows[1][0].advantages == pytest.approx([-half * m for m in b.loss_mask], abs=1e-5)
    # distillation alone needs no group: a lone episode trains
    assert distill().estimate([a], teacher_logprobs=[[TEACHER]])[0][0].advantages[3] == pytest.approx(0.25)


def test_segments_each_get_their_rows_and_the_bonus():
    e = tool_then_answer()
    rec = Recorder(e)
    rec.close_segment(ended_by="summary")
    rec.write_ids([5, 6], sampled=False, turn=-1)
    rec.write_ids([14], sampled=True, turn=2, logprobs=[-1.0])
    rows = distill().estimate([e], teacher_logprobs=[[TEACHER, [0.0, 0.0, -3.0]]],
                              segment_bonus=lambda seq: 0.5 if seq.ended_by == "summary" else 0.0)[0]
    assert [len(r.input_ids) for r in rows] == [9, 3]
    assert rows[0].advantages == pytest.approx([0, 0, 0, 0.75, -0.0, 0, 0, 1.5, 0.5])
    assert rows[1].advantages == pytest.approx([0, 0, -2.0])
    with pytest.raises(ValueError, match="trains 2 sequences but has 1"):
        distill().estimate([e], teacher_logprobs=[[TEACHER]])
    with pytest.raises(ValueError, match="needs teacher_logprobs"):
        distill().estimate([e])


# -- the configuration ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    ([], r"needs a teacher: set algo.distill.teacher"),
    (["algo.distill.teacher=tiny", "algo.distill.outcome=1", "rollout.group_size=1"],
     r"outcome > 0 with outcome_estimator=grpo needs rollout.group_size >= 2"),
    (["algo.distill.teacher=tiny", "rollout.top_p=0.9"], r"set rollout.top_p=1 and rollout.top_k=0"),
    (["algo.distill.teacher=tiny", "algo.distill.outcome_estimator=gae"], r"must be an outcome estimator"),
    (["algo.distill.teacher=tiny", "algo.distill.coef=0"], r"\[algo.distill\]: coef and outcome are both 0"),
    (["algo.distill.teacher=tiny", "algo.kl_coef=0.1", "algo.kl_placement=reward"], r"takes no per-token rewards"),
])
def test_the_config_refuses_what_distillation_cannot_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["algo.advantage=distill", *overrides])


def test_preflight_names_the_teacher_it_cannot_find(tmp_path):
    from ctxrl.train.preflight import preflight

    with pytest.raises(ConfigError, match=r"\[algo.distill\] teacher: model path .*/missing' does not exist"):
        preflight(load_config(None, ["algo.advantage=distill", f"algo.distill.teacher={tmp_path}/missing"]))


def test_distillation_alone_runs_with_one_episode_per_task_and_under_summaries():
    config = load_config(None, ["algo.advantage=distill", "algo.distill.teacher=tiny", "rollout.group_size=1",
                                "context.manager=summarize", "context.max_context_tokens=256"])
    assert config.settings_of("algo", "distill").teacher == "tiny"


# -- the teacher on the real tiny model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rollouts(model, renderer):
    """Four sampled calculator episodes of the tiny model through the real agent loop (temperature 0.7)."""
    from ctxrl.engine.hf import HFEngine
    from ctxrl.envs.calculator import CalculatorEnv
    from ctxrl.rollout.agent import run_episodes
    from ctxrl.rollout.spec import RolloutLimits

    engine = HFEngine(model, pad_token_id=renderer.tokenizer.pad_token_id)
    limits = RolloutLimits(max_turns=2, max_new_tokens=12, max_total_tokens=400, temperature=0.7)
    tasks = CalculatorEnv.sample_tasks("train", 2, seed=0)
    episodes = asyncio.run(run_episodes(CalculatorEnv, tasks, engine, renderer, limits, group_size=2, seed=1))
    assert all(e.truncation != "error" and e.num_sampled_tokens for e in episodes)
    return episodes


def teacher_of(module):
    from ctxrl.train.teacher import Teacher

    return Teacher(module, "test", temperature=0.7, micro_batch_size=3, chunk=4)


def test_a_teacher_identical_to_the_student_scores_no_kl(model, renderer, rollouts):
    teacher = teacher_of(model)
    scores, figures = teacher.score(rollouts, renderer.tokenizer.pad_token_id)
    rows = distill().estimate(rollouts, teacher_logprobs=scores)
    largest = max(abs(a) for [row] in rows for a in row.advantages)
    assert largest < 1e-4, largest  # the engine's cached decode against one full forward pass: rounding only
    assert abs(figures["teacher_kl"]) < 1e-5 and figures["teacher_kl_tokens"] == sum(e.num_sampled_tokens
                                                                                      for e in rollouts)
    for [row], e in zip(rows, rollouts):  # masked like the loss: nothing on prompt or tool output
        assert all(a == 0.0 for a, m in zip(row.advantages, e.loss_mask) if not m)


def test_a_perturbed_teacher_matches_its_own_full_logits(model, renderer, rollouts):
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    scores, figures = teacher_of(other).score(rollouts, renderer.tokenizer.pad_token_id)
    [rows] = [distill(coef=1.0).estimate(rollouts[:1], teacher_logprobs=scores[:1])[0]]
    e = rollouts[0]
    with torch.no_grad():  # by hand: log_softmax(logits / T) of the full forward pass, at each sampled token
        logits = other(torch.tensor([e.input_ids])).logits[0, :-1] / 0.7
        by_hand = torch.log_softmax(logits, -1).gather(1, torch.tensor(e.input_ids[1:])[:, None])[:, 0]
    for i, m in enumerate(e.loss_mask):
        if m:
            assert scores[0][0][i] == pytest.approx(float(by_hand[i - 1]), abs=1e-4)
            assert rows[0].advantages[i] == pytest.approx(float(by_hand[i - 1]) - e.behavior_logprobs[i], abs=1e-4)
        else:
            assert scores[0][0][i] == 0.0 and rows[0].advantages[i] == 0.0
    k1 = [e.behavior_logprobs[i] - scores[n][0][i] for n, e in enumerate(rollouts)
          for i, m in enumerate(e.loss_mask) if m]
    assert figures["teacher_kl"] == pytest.approx(sum(k1) / len(k1), abs=1e-6) and figures["teacher_kl"] > 0.0
    assert "teacher_kl_turn_0" in figures
    roles = {k.removeprefix("teacher_kl_") for k in figures if not k.startswith(("teacher_kl_turn", "teacher_kl_tok"))}
    assert roles - {"teacher_kl"} and roles - {"teacher_kl"} <= {"tool_call", "answer"}


def test_a_teacher_with_another_tokenizer_is_refused(tokenizer):
    from ctxrl.models.loader import load_tokenizer
    from ctxrl.train.teacher import check_teacher, tokenizer_difference

    smol = load_tokenizer("smollm2-135m-instruct")
    assert tokenizer_difference(tokenizer, tokenizer) is None
    assert "tokens, the teacher's 49152" in tokenizer_difference(tokenizer, smol)
    with pytest.raises(ConfigError, match=r"do not share a tokenizer .* ULD or GOLD"):
        check_teacher("smollm2-135m-instruct", tokenizer, student=TINY)


# -- one training step -----------------------------------------------------------------------------------------
def test_a_distillation_step_logs_the_teachers_kl(tmp_path, tiny_path):
    from ctxrl.train.trainer import train

    config = load_config(None, [f"model.name={TINY}", "algo.advantage=distill", f"algo.distill.teacher={TINY}",
                                "algo.distill.outcome=0.5", "sft.enabled=false", "train.steps=1",
                                "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                                "eval.tasks=2", "run.progress=false", "run.samples_per_step=0",
                                "train.eval_every=0"])
    train(config, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    [rl] = [r for r in rows if r.get("phase") == "rl"]
    # the teacher is the student's own checkpoint, and step 1 samples with the student before any update
    assert abs(rl["teacher_kl"]) < 1e-4 and rl["teacher_kl_tokens"] > 0 and "teacher_kl_turn_0" in rl
