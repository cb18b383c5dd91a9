"""Training on trials: hand-derived attempt and reflection advantages, group statistics over trials, wiring."""

from __future__ import annotations

import math

import pytest

from ctxrl.algo.estimators import get_estimator
from ctxrl.algo.estimators.meta import MetaCreditSettings, attempt_advantages
from ctxrl.algo.estimators.meta import expand_trials as expand_rows
from ctxrl.config import ConfigError, load_config
from ctxrl.rollout.recorder import Recorder
from ctxrl.run import step as step_module
from ctxrl.types import Episode, Task, TrainSequence

R = 1 / math.sqrt(2)
PROMPT, TURN, FEEDBACK, REFLECTION = [1, 2], [3, 4, 5], [6], [7, 8]


def expand_trials(trials, values):
    """(the training rows of all trials, their advantages), flat."""
    rows = [row for per_trial in expand_rows(trials, values) for row in per_trial]
    return rows, [r.advantages for r in rows]


def trial_token_advantages(trials, num_attempts=None, **settings):
    """The meta estimator's rows and advantages, flat."""
    estimator = get_estimator("meta")(options=MetaCreditSettings(**settings), num_attempts=num_attempts)
    per_trial = estimator.estimate(trials)
    rows = [row for r in per_trial for row in r]
    return rows, [r.advantages for r in rows]


def _trial(group: int, rewards: list[float]) -> Episode:
    """A trial whose attempt k is: prompt (mask 0), one turn (mask 1), and, unless it is the last,
    feedback (mask 0) and a reflection (mask 1) starting at position 6."""
    e = Episode(task=Task(id=f"t{group}", prompt="p", answer="a"), group_id=group, reward=sum(rewards),
                success=rewards[-1] == 1.0)
    records = []
    rec = Recorder(e)
    for k, r in enumerate(rewards):
        if k:
            rec.close_segment(ended_by="reflection")
        rec.write_ids(PROMPT, sampled=False, turn=-1)
        rec.write_ids(TURN, sampled=True, turn=0, logprobs=[-1.0] * 3)
        start = None
        if k < len(rewards) - 1:
            rec.write_ids(FEEDBACK, sampled=False, turn=0)
            start = len(e.input_ids)
            rec.write_ids(REFLECTION, sampled=True, turn=1, logprobs=[-1.0] * 2)
        records.append({"reward": r, "success": r == 1.0, "reflection_start": start, "actions": []})
    e.info.update({"attempts": records, "num_attempts": 2})
    return e


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b))


def test_cross_episode_credit_by_hand():
    # group 0: failed then solved / solved at once / never (K = 2, gamma_trial = 0.5)
    # returns G: [0.5, 1], [1], [0, 0]
    # attempt 0 over the three trials: [0.5, 1, 0], mean 0.5, Bessel std 0.5 -> [0, 1, -1]
    # attempt 1 over the two trials that played it: [1, 0], mean 0.5, std 1/sqrt(2) -> [+-1/sqrt(2)]
    # group 1: solved at once / never; attempt 0 [1, 0] -> [+-1/sqrt(2)], attempt 1 has one trial -> 0
    trials = [_trial(0, [0.0, 1.0]), _trial(1, [1.0]), _trial(0, [1.0]), _trial(1, [0.0, 0.0]), _trial(0, [0.0, 0.0])]
    values = attempt_advantages(trials, credit="cross_episode", gamma_trial=0.5, num_attempts=2)
    expected = [[0.0, R], [R], [1.0], [-R, 0.0], [-1.0, -R]]
    assert all(_close(v, e) for v, e in zip(values, expected)), values
    sequences, advantages = expand_trials(trials, values)
    assert len(sequences) == 8 and all(isinstance(s, TrainSequence) for s in sequences)  # one sequence each
    # trial 0, attempt 0: its turn gets A[0] = 0, its reflection A[1] = 1/sqrt(2); context tokens 0
    assert sequences[0].input_ids == [*PROMPT, *TURN, *FEEDBACK, *REFLECTION]
    assert _close(advantages[0], [0, 0, 0, 0, 0, 0, R, R])
    assert _close(advantages[1], [0, 0, R, R, R])  # trial 0, attempt 1
    assert _close(advantages[2], [0, 0, R, R, R])  # trial 1 (solved at once): one sequence
    assert _close(advantages[3], [0, 0, 1, 1, 1])
    assert _close(advantages[4], [0, 0, -R, -R, -R, 0, 0, 0])  # group 1: attempt 1 had no baseline -> 0
    assert _close(advantages[6], [0, 0, -1, -1, -1, 0, -R, -R])
    assert _close(advantages[7], [0, 0, -R, -R, -R])
    # masked positions never carry an advantage
    assert all(a == 0.0 for s, adv in zip(sequences, advantages) for a, m in zip(adv, s.loss_mask) if not m)


def test_relative_credit_by_hand():
    # group 0 as above, baseline = leave-one-out mean of the same attempt, gamma_trial = 0.5:
    # attempt 0 rewards [0, 1, 0]: D = [0 - 0.5, 1 - 0, 0 - 0.5]; attempt 1 rewards [1, 0]: D = [1, -1]
    # A = D + 0.5 * A_next: [-0.5 + 0.5, 1], [1], [-0.5 - 0.5, -1]
    trials = [_trial(0, [0.0, 1.0]), _trial(0, [1.0]), _trial(0, [0.0, 0.0])]
    values = attempt_advantages(trials, credit="relative", gamma_trial=0.5, baseline="loo", num_attempts=2)
    assert all(_close(v, e) for v, e in zip(values, [[0.0, 1.0], [1.0], [-1.0, -1.0]])), values
    sequences, advantages = trial_token_advantages(trials, credit="relative", gamma_trial=0.5, num_attempts=2)
    assert _close(advantages[0], [0, 0, 0, 0, 0, 0, 1, 1]) and _close(advantages[3], [0, 0, -1, -1, -1, 0, -1, -1])
    with pytest.raises(ValueError, match="credit must be one of"):
        attempt_advantages(trials, credit="lamer", gamma_trial=1.0)


def test_one_attempt_is_grpo_and_rloo():
    from ctxrl.algo.estimators import token_advantages as episode_advantages

    def plain(group: int, reward: float) -> Episode:
        e = Episode(task=Task(id="t", prompt="p", answer="a"), group_id=group, reward=reward)
        Recorder(e).write_ids(PROMPT, sampled=False, turn=-1)
        Recorder(e).write_ids(TURN, sampled=True, turn=0, logprobs=[-1.0] * 3)
        return e

    episodes = [plain(0, 1.0), plain(0, 0.0), plain(0, 0.0), plain(1, 1.0), plain(1, 0.5)]
    for credit, estimator in (("cross_episode", "grpo"), ("relative", "rloo")):
        _, advantages = trial_token_advantages(episodes, credit=credit, gamma_trial=1.0, num_attempts=1)
        reference = episode_advantages(estimator, episodes)
        assert all(_close(a, b) for a, b in zip(advantages, reference)), (credit, advantages, reference)


def test_records_must_match_the_sequences():
    trial = _trial(0, [0.0, 1.0])
    trial.info["attempts"].pop()
    with pytest.raises(ValueError, match="one per attempt"):
        expand_trials([trial], [[0.0]])


def test_the_rl_step_trains_attempts_and_reflections_with_credit_over_trials(tmp_path, monkeypatch):
    from ctxrl.run.build import build, start_learning

    config = load_config(None, ["model.name=tiny:pretrain_steps=0", "env.name=minesweeper", "sft.enabled=false",
                                "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                                "rollout.max_total_tokens=1024", "meta.num_attempts=2", "algo.advantage=meta",
                                "meta.reflection_max_tokens=4", "algo.meta.gamma_trial=0.5", "run.progress=false"])
    run = build(config, tmp_path)
    start_learning(run)
    seen = {}

    def update(_run, rows, step):
        seen["sequences"], seen["advantages"] = rows, [r.advantages for r in rows]
        return {}

    monkeypatch.setattr(step_module, "update", update)  # (the step looks its phases up in ctxrl.run.step)
    rollouts = {}
    original = run.collector.rollout_round

    def rollout_round(step, round_):
        rollouts["trials"] = original(step, round_)
        for i, trial in enumerate(rollouts["trials"]):  # hand-set rewards: group 0 [0, 1] / [1], group 1 [0, 0] x2
            rewards = [[0.0, 1.0], [1.0], [0.0, 0.0], [0.0, 0.0]][i]
            del trial.info["attempts"][len(rewards):]
            for record, r in zip(trial.info["attempts"], rewards):
                record["reward"], record["success"] = r, r == 1.0
            trial.segments = trial.segments[: len(rewards) - 1]
        return rollouts["trials"]

    run.collector.rollout_round = rollout_round
    row = step_module.rl_step(run, 0)
    trials = rollouts["trials"]
    assert [t.group_id for t in trials] == [0, 0, 1, 1]
    # attempt 0 of group 0: returns [0.5, 1] -> -+1/sqrt(2); attempt 1 has one trial -> 0; group 1 all 0
    values = attempt_advantages(trials, credit="cross_episode", gamma_trial=0.5, num_attempts=2)
    assert all(_close(v, e) for v, e in zip(values, [[-R, 0.0], [R], [0.0, 0.0], [0.0, 0.0]]))
    sequences, advantages = expand_trials(trials, values)
    assert [s.input_ids for s in seen["sequences"]] == [s.input_ids for s in sequences]
    assert seen["advantages"] == advantages
    record = trials[0].info["attempts"][0]
    start = record["reflection_start"]  # the reflection of trial 0 gets attempt 1's advantage, 0; its turns -1/sqrt(2)
    assert start is not None and all(a == 0.0 for a in seen["advantages"][0][start:])
    assert _close([a for a, m in zip(seen["advantages"][0][:start], seen["sequences"][0].loss_mask) if m],
                  [-R] * sum(seen["sequences"][0].loss_mask[:start]))
    assert row["trained_episodes"] == 4 and row["trained_sequences"] == len(sequences)
    assert {"success_at_1", "success_by_2", "reflections_per_trial"} <= set(row)
    run.writer.close()


@pytest.mark.parametrize("overrides, message", [
    (["meta.num_attempts=3"], "set algo.advantage=meta"),
    (["meta.num_attempts=3", "algo.advantage=meta", "context.manager=window", "context.max_context_tokens=300"],
     "set context.manager=full"),
    (["algo.advantage=meta", "algo.agg=seq-mean-token-mean"], "algo.agg=token-mean"),
    (["algo.advantage=meta", "algo.kl_coef=0.1", "algo.kl_placement=reward"], "kl_placement=loss"),
    (["algo.advantage=meta", "algo.void_turn_filter=true"], "void_turn_filter"),
    (["algo.advantage=meta", "reward.format_weight=0.1"], "reward shaping"),
    (["algo.meta.gamma_trial=1.5"], r"algo.meta.gamma_trial must be in \[0, 1\]"),
    (["meta.carry=episodes"], "meta.carry must be one of reflections, attempts"),
    (["meta.context=attempts", "meta.carry=attempts"], "keep only meta.carry"),
    (["meta.num_attempts=0"], "meta.num_attempts must be > 0"),
    (["meta.eval_trials=4"], "set meta.eval_attempts"),
])
def test_bad_meta_configs_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_meta_configs_that_are_allowed():
    # the in-context RL baseline: trials at evaluation only, no training, any estimator
    config = load_config(None, ["meta.num_attempts=3", "train.steps=0", "meta.carry=attempts", "meta.reflect=false"])
    assert config.meta.num_attempts == 3 and config.algo.advantage == "grpo"
    # single-episode RL evaluated with trials
    assert load_config(None, ["meta.eval_attempts=3"]).meta.eval_attempts == 3
    assert load_config(None, ["algo.advantage=meta"]).meta.num_attempts == 1


def test_a_renamed_key_is_read_under_its_new_name_with_a_warning():
    """meta.context (before meta.carry) in an older config or a run's saved config.toml still loads."""
    with pytest.warns(DeprecationWarning, match="meta.context was renamed meta.carry"):
        config = load_config(None, ["meta.context=attempts"])
    assert config.meta.carry == "attempts"


def test_an_attempt_cut_into_segments_by_its_template_trains_every_segment_with_its_credit():
    """A history-rewriting chat template can cut an attempt in two (``ended_by="template"``): both segments
    carry the attempt's advantage, and the reflection (in the attempt's last segment) its own."""
    e = Episode(task=Task(id="t0", prompt="p", answer="a"), group_id=0, reward=1.0, success=True)
    rec = Recorder(e)
    rec.write_ids(PROMPT, sampled=False, turn=-1)
    rec.write_ids(TURN, sampled=True, turn=0, logprobs=[-1.0] * 3)
    rec.close_segment(ended_by="template")  # attempt 0, first segment
    rec.write_ids(PROMPT, sampled=False, turn=-1)
    rec.write_ids(TURN, sampled=True, turn=1, logprobs=[-1.0] * 3)
    rec.write_ids(FEEDBACK, sampled=False, turn=1)
    start = len(e.input_ids)
    rec.write_ids(REFLECTION, sampled=True, turn=2, logprobs=[-1.0] * 2)
    rec.close_segment(ended_by="reflection")  # attempt 0, second segment (with the reflection)
    rec.write_ids(PROMPT, sampled=False, turn=-1)
    rec.write_ids(TURN, sampled=True, turn=0, logprobs=[-1.0] * 3)  # attempt 1
    e.info.update({"attempts": [{"reward": 0.0, "reflection_start": start, "segments": 2},
                                {"reward": 1.0, "reflection_start": None, "segments": 1}], "num_attempts": 2})
    [rows] = expand_rows([e], [[-0.5, 0.5]])
    assert len(rows) == 3
    first, second, last = ([a for a, m in zip(r.advantages, r.loss_mask) if m] for r in rows)
    assert first == [-0.5] * 3  # attempt 0's advantage in its first segment
    assert second == [-0.5] * 3 + [0.5] * 2  # ... and in its second, whose reflection gets attempt 1's
    assert last == [0.5] * 3
    e.info["attempts"][0]["segments"] = 1  # records that do not account for every segment are refused
    with pytest.raises(ValueError, match="one per attempt"):
        expand_rows([e], [[-0.5, 0.5]])
