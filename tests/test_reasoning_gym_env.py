"""``reasoning_gym:TASK``: reasoning-gym's task families (the real package) as contextual environments.

The numbers are derived by hand from reasoning-gym's own curricula and configurations: ``chain_sum``'s
``num_terms`` has levels 2, 3, ..., 12 and ``num_digits`` 1, 2, ..., 10, so with the default levels (train 0-1, ood
2-3) train draws 2-3 terms of 1-2 digits and ood 4-5 terms of 3-4 digits.
"""

from __future__ import annotations

import asyncio
import re
import sys

import pytest

pytest.importorskip("reasoning_gym")

from ctxrl.config import load_config  # noqa: E402
from ctxrl.engine.scripted import ScriptedEngine  # noqa: E402
from ctxrl.envs import check_env  # noqa: E402
from ctxrl.envs.base import EnvError  # noqa: E402
from ctxrl.envs.registry import configured_env_class, get_env_class  # noqa: E402
from ctxrl.errors import ConfigError  # noqa: E402
from ctxrl.rollout.agent import run_episode  # noqa: E402
from ctxrl.rollout.spec import RolloutLimits, RolloutSpec  # noqa: E402
from ctxrl.rollout.worker import spec_env_class  # noqa: E402
from ctxrl.types import Message  # noqa: E402

FAMILIES = ["chain_sum", "leg_counting", "spell_backward"]


def _score(cls, task, text: str):
    env = cls()
    env.reset(task)
    result = asyncio.run(env.step(Message(role="assistant", content=text)))
    env.close()
    return result


@pytest.mark.parametrize("family", FAMILIES)
def test_families_pass_check_env_with_disjoint_splits(family):
    cls = get_env_class(f"reasoning_gym:{family}")
    assert check_env(cls, n_tasks=6) == []  # its own disjointness check draws 64 prompts of each split
    assert cls.splits() == ("train", "heldout", "ood")
    train, heldout = cls.sample_tasks("train", 200, 1), cls.sample_tasks("heldout", 200, 1)
    assert {t.prompt for t in train}.isdisjoint({t.prompt for t in heldout})
    space = cls.context_space
    for task in cls.sample_tasks("ood", 30, 1):  # harder: some value past the train range
        assert task.context["family"] == family and space.is_ood(task.context)
    assert not any(space.is_ood(t.context) for t in train + heldout)


def test_the_curriculum_levels_are_the_context_ranges():
    cls = get_env_class("reasoning_gym:chain_sum")
    rows = {row["name"]: row for row in cls.context_space.describe()}
    assert rows["num_terms"]["train"] == [2, 3] and rows["num_terms"]["ood"] == [4, 5]
    assert rows["num_digits"]["train"] == [1, 2] and rows["num_digits"]["ood"] == [3, 4]
    assert rows["family"]["choices"] == ["chain_sum"]
    for split in ("train", "ood"):
        for task in cls.sample_tasks(split, 20, 2):
            terms, digits = task.context["num_terms"], task.context["num_digits"]
            # the value sets both ends of the family's range: exactly that many terms of that many digits
            assert task.data["config"] == {"min_terms": terms, "max_terms": terms, "min_digits": digits,
                                           "max_digits": digits}
            numbers = re.findall(r"\d+", task.prompt.split(":", 1)[1])
            assert len(numbers) == terms and all(len(n) == digits for n in numbers)
            assert int(task.answer) == eval(task.data["expression"])  # noqa: S307 - digits and + - only


def test_the_familys_own_scorer_gives_the_reward():
    cls = get_env_class("reasoning_gym:leg_counting")
    task = cls.sample_tasks("train", 1, 0)[0]
    right = _score(cls, task, f"<answer> {task.answer} </answer>")
    assert right.reward == 1.0 and right.info["correct"] is True and right.terminated
    # leg_counting keeps reasoning-gym's default scorer: len(oracle) / len(answer) when the answer contains it
    partial = _score(cls, task, f"<answer>x{task.answer}</answer>")
    assert partial.reward == pytest.approx(len(task.answer) / (len(task.answer) + 1))
    assert partial.info["correct"] is False
    assert _score(cls, task, "no tags at all").reward == 0.0
    # the entry is regenerated from the task alone: the same question and answer
    dataset, entry = cls.entry(task)
    assert entry["question"] == task.prompt and entry["answer"] == task.answer


def test_a_mix_draws_each_family_by_weight_and_keeps_their_own_variables():
    cls = configured_env_class("reasoning_gym:chain_sum,leg_counting", {"weights": [3, 1]})
    assert check_env(cls, n_tasks=6) == []
    tasks = cls.sample_tasks("train", 400, 0)
    share = sum(t.context["family"] == "chain_sum" for t in tasks) / len(tasks)
    assert 0.68 < share < 0.82  # 3 / 4, within a few standard errors (0.022)
    keys = {t.context["family"]: set(t.context) for t in tasks}
    assert keys == {"chain_sum": {"family", "num_terms", "num_digits"},
                    "leg_counting": {"family", "num_animals", "num_instances"}}
    names = [row["name"] for row in cls.context_space.describe()]
    assert names == ["family", "chain_sum.num_terms", "chain_sum.num_digits", "leg_counting.num_animals",
                     "leg_counting.num_instances"]


def test_ranges_fixed_fields_and_a_calculator(renderer):
    settings = {"ranges": ["num_terms=2..3/6..7", "num_digits=2"], "fixed": ["allow_negation=true"],
                "tool": "calculator"}
    cls = configured_env_class("reasoning_gym:chain_sum", settings)
    assert [t.name for t in cls().tools] == ["calculator"] and "calculator tool" in cls.system_prompt
    ood = cls.sample_tasks("ood", 20, 0)
    assert {t.context["num_terms"] for t in ood} <= {6, 7} and {t.context["num_digits"] for t in ood} == {2}
    assert all(t.data["config"]["allow_negation"] is True for t in ood)
    task = ood[0]
    texts = cls.solve(task)
    assert len(texts) == 2 and '"calculator"' in texts[0]  # the calculator on the task's expression, then the answer
    assert cls.shortcut(task) == [f"<answer>{task.answer}</answer>"]  # imperfect demos: no tool
    episode = asyncio.run(run_episode(cls(), task, ScriptedEngine(texts, renderer), renderer,
                                      RolloutLimits(max_turns=4, max_new_tokens=96, max_total_tokens=4096), seed=0))
    assert episode.reward == 1.0 and episode.success is True and episode.turns[0].tool_calls == 1


def test_a_level_the_family_refuses_is_left_out_with_a_warning():
    with pytest.warns(UserWarning, match=r"caesar_cipher: rotation level\(s\) 3 \(50\) fail the family's own check"):
        cls = configured_env_class("reasoning_gym:caesar_cipher", {"ood_levels": [2, 4]})
    rows = {row["name"]: row for row in cls.context_space.describe()}
    assert rows["rotation"]["ood"] == [25, 25] and rows["words"]["ood"] == [25, 50]


@pytest.mark.parametrize("settings, message", [
    ({"ranges": ["num_turms=2..3"]}, "chain_sum has no curriculum attribute or numeric configuration field "
                                     "'num_turms'; attributes: num_terms, num_digits"),
    ({"ranges": ["max_terms=2..3"]}, "max_terms is set by the curriculum attribute 'num_terms'"),
    ({"ranges": ["num_terms=3..2"]}, "has LOW > HIGH"),
    ({"ranges": ["num_terms=two"]}, "must be LOW..HIGH"),
    ({"fixed": ["min_terms=3"]}, "fixed sets chain_sum's min_terms, which its context variables set"),
    ({"fixed": ["seed=3"]}, "chain_sum has no configuration field 'seed'"),
    ({"ranges": ["leg_counting.num_animals=2"]}, "names family 'leg_counting', which is not one of chain_sum"),
    ({"weights": [1, 2]}, "weights has 2 numbers for 1 families"),
    ({"ranges": ["num_terms=0..1"]}, "fails the family's own check (min_terms must be positive)"),
])
def test_bad_settings_name_the_problem(settings, message):
    with pytest.raises(EnvError, match=re.escape(message)):
        configured_env_class("reasoning_gym:chain_sum", settings)


def test_names_and_tables_are_checked_before_anything_runs(monkeypatch):
    with pytest.raises(EnvError, match="no task family 'chain_sm'; did you mean 'chain_sum'"):
        get_env_class("reasoning_gym:chain_sm")
    with pytest.raises(EnvError, match="reasoning_gym:composite is reasoning-gym's own mix"):
        get_env_class("reasoning_gym:composite")
    with pytest.raises(EnvError, match="names no task family"):
        get_env_class("reasoning_gym:")
    with pytest.raises(EnvError, match="'reasoning_gym' names a family of environments: write reasoning_gym:NAME"):
        get_env_class("reasoning_gym")
    with pytest.raises(ConfigError, match=r"\[env.reasoning_gym\]: tool must be calculator, python"):
        load_config(None, ["env.name=reasoning_gym:chain_sum", "env.reasoning_gym.tool=abacus"])
    with pytest.raises(ConfigError, match=r"one table, \[env.reasoning_gym\]"):
        load_config(None, ["env.name=reasoning_gym:chain_sum", "env.reasoning_gym:chain_sum.tool=calculator"])
    config = load_config(None, ["env.name=reasoning_gym:leg_counting", "env.reasoning_gym.train_levels=[1, 2]"])
    cls = spec_env_class(RolloutSpec.from_config(config))
    assert cls.options.train_levels == [1, 2] and config.settings_of("env", config.env.name).train_levels == [1, 2]
    assert {t.context["num_animals"] for t in cls.sample_tasks("train", 40, 0)} == {2, 3}
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    from ctxrl.envs import from_reasoning_gym

    from_reasoning_gym._family_class.cache_clear()
    with pytest.raises(EnvError, match=r"need the reasoning-gym package: pip install -e '\.\[reasoning-gym\]'"):
        get_env_class("reasoning_gym:chain_sum")
    from_reasoning_gym._family_class.cache_clear()


def test_check_env_takes_the_familys_settings(capsys):
    import json

    from ctxrl.cli import main

    code = main(["check-env", "reasoning_gym:chain_sum", "--tasks", "2", "--json", "--set", "tool=calculator",
                 "--set", 'ranges=["num_terms=2..3/6..7"]'])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["ok"] is True and report["problems"] == []
    assert main(["check-env", "reasoning_gym:chain_sum", "--set", "tool"]) == 2
    assert "--set 'tool' must look like KEY=VALUE" in capsys.readouterr().err


@pytest.mark.slow
def test_training_runs_on_a_family(tmp_path):
    import json

    from test_env_training import SMALL

    from ctxrl.train.trainer import train

    config = load_config(None, ["env.name=reasoning_gym:chain_sum", "env.reasoning_gym.tool=calculator", *SMALL])
    summary = train(config, tmp_path / "run")
    assert summary["steps"] == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r["split"] for r in rows if r["phase"] == "eval"} == {"train", "heldout", "ood"}
