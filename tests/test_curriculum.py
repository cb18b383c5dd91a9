"""Curricula: fixed equals the env's sampler, the horizon schedule, self-paced weighting, the loop hook."""

from __future__ import annotations

from collections import Counter

import pytest

from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.tasks.curriculum import FixedCurriculum, HorizonCurriculum, SelfPacedCurriculum, context_key, make_curriculum
from ctxrl.types import Episode


def test_fixed_is_the_env_train_sampler():
    c = FixedCurriculum()
    assert c.sample_tasks(CalculatorEnv, 5, 9, step=3) == CalculatorEnv.sample_tasks("train", 5, 9)
    assert c.max_turns(0, 4) == 4 and c.update([]) == {}


def test_horizon_schedule():
    c = HorizonCurriculum(start_turns=2, warmup_steps=30, stages=3)
    # stages at steps 0-9, 10-19, 20-29: caps 2, 2 + 6/3 = 4, 2 + 12/3 = 6; from step 30: the limit 8
    assert [c.max_turns(s, 8) for s in (0, 9, 10, 19, 20, 29, 30, 100)] == [2, 2, 4, 4, 6, 6, 8, 8]
    assert c.max_turns(0, 2) == 2 and c.max_turns(0, 1) == 1  # never above the configured limit
    with pytest.raises(ValueError):
        HorizonCurriculum(0, 10)


def _episodes(context: dict, successes: list[bool]) -> list[Episode]:
    tasks = [t for t in CalculatorEnv.sample_tasks("train", 200, 0) if t.context == context][:1]
    return [Episode(task=tasks[0], success=s) for s in successes]


def test_self_paced_prefers_intermediate_success():
    c = SelfPacedCurriculum(pool_factor=4, floor=0.02)
    easy, hard, mid = {"digits": 1, "ops": 1}, {"digits": 3, "ops": 2}, {"digits": 2, "ops": 1}
    stats = c.update(_episodes(easy, [True] * 40) + _episodes(hard, [False] * 40) + _episodes(mid, [True, False] * 20))
    assert stats == {"curriculum_contexts": 3.0, "curriculum_mid_contexts": 1.0}
    # Beta(1,1) estimates: easy 41/42, hard 1/42, mid 21/42 -> weights p(1-p): 0.023, 0.023, 0.25
    assert c.success_rate(mid) == pytest.approx(0.5) and c.weight(mid) == pytest.approx(0.25)
    assert c.weight(easy) == pytest.approx(41 / 42 / 42) and c.weight(hard) == pytest.approx(41 / 42 / 42)
    c.counts[context_key(easy)] = [400, 400]
    assert c.weight(easy) == pytest.approx(0.02)  # 401/402 * 1/402 is below the floor
    unseen = {"digits": 2, "ops": 2}
    assert c.weight(unseen) == pytest.approx(0.25)  # untried contexts count as uncertain
    counts = Counter()
    for step in range(30):
        for t in c.sample_tasks(CalculatorEnv, 8, seed=step, step=step):
            counts[context_key(t.context)] += 1
    assert counts[context_key(mid)] > 5 * max(counts[context_key(easy)], 1)
    assert counts[context_key(mid)] > 5 * max(counts[context_key(hard)], 1)
    # reproducible for a seed and step, and drawn from the train split only
    a = c.sample_tasks(CalculatorEnv, 8, seed=1, step=2)
    assert a == c.sample_tasks(CalculatorEnv, 8, seed=1, step=2) and {t.split for t in a} == {"train"}


def test_make_curriculum_and_the_loop_hook(tmp_path):
    from ctxrl.config import CurriculumConfig, load_config
    from ctxrl.run.build import build, start_learning
    from ctxrl.run.step import rl_step

    assert isinstance(make_curriculum(CurriculumConfig(kind="horizon")), HorizonCurriculum)
    with pytest.raises(ValueError, match="unknown curriculum"):
        make_curriculum(CurriculumConfig(kind="random"))
    config = load_config(None, ["model.name=tiny:pretrain_steps=0", "sft.enabled=false", "rollout.tasks_per_step=2",
                                "rollout.group_size=2", "rollout.max_new_tokens=8", "run.progress=false",
                                "curriculum.kind=horizon", "curriculum.horizon.start_turns=1",
                                "curriculum.horizon.warmup_steps=4", "env.max_turns=3"])
    run = build(config, tmp_path / "run")
    start_learning(run)
    rows = [rl_step(run, step) for step in (0, 4)]
    assert [r["max_turns"] for r in rows] == [1, 3]
    assert all(r["turns"] <= 1 for r in rows[:1])


def test_a_curriculum_reads_its_own_table():
    """``[curriculum.NAME]`` is the curriculum's ``Settings`` (``curriculum.kind`` names a registered curriculum)."""
    from ctxrl.config import ConfigError, load_config

    config = load_config(None, ["curriculum.kind=self_paced", "curriculum.self_paced.pool=6",
                                "curriculum.horizon.stages=2"])  # (an unused curriculum's table is only checked)
    curriculum = make_curriculum(config.curriculum, config.settings_of("curriculum", "self_paced"))
    assert isinstance(curriculum, SelfPacedCurriculum) and (curriculum.pool_factor, curriculum.floor) == (6, 0.02)
    with pytest.raises(ConfigError, match="curriculum.horizon.start_turns must be > 0"):
        load_config(None, ["curriculum.horizon.start_turns=0"])
    with pytest.raises(ConfigError, match="curriculum.kind must be one of fixed, horizon, self_paced"):
        load_config(None, ["curriculum.kind=horizn"])
