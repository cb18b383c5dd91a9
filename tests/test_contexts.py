"""Context spaces and splits: ranges are enforced, draws are reproducible, splits never overlap."""

from __future__ import annotations

import random

import pytest

from ctxrl.tasks import ContextError, ContextParam, ContextSpace, sample_tasks, split_of, task_id

SPACE = ContextSpace([
    ContextParam("size", "int", low=1, high=3, default=2, ood_low=5, ood_high=6),
    ContextParam("noise", "float", low=0.0, high=0.5, default=0.1),
    ContextParam("style", "choice", choices=("a", "b")),
])


def test_sample_respects_split_ranges() -> None:
    rng = random.Random(0)
    for _ in range(200):
        train = SPACE.sample("train", rng)
        ood = SPACE.sample("ood", rng)
        assert 1 <= train["size"] <= 3 and 5 <= ood["size"] <= 6
        assert 0.0 <= ood["noise"] <= 0.5  # no ood range: train range
        SPACE.validate(train, split="train")
        SPACE.validate(ood, split="ood")
        assert SPACE.is_ood(ood) and not SPACE.is_ood(train)
    assert SPACE.has_ood
    assert SPACE.defaults() == {"size": 2, "noise": 0.1, "style": "a"}


def test_validate_names_param_and_range() -> None:
    with pytest.raises(ContextError, match=r"'size'=4 must be an int in \[1, 3\], \[5, 6\]"):
        SPACE.validate({"size": 4, "noise": 0.1, "style": "a"})
    with pytest.raises(ContextError, match=r"'size'=5 .* for split 'train'"):
        SPACE.validate({"size": 5, "noise": 0.1, "style": "a"}, split="train")
    with pytest.raises(ContextError, match="'style'='c' is not one of"):
        SPACE.validate({"size": 1, "noise": 0.1, "style": "c"})
    with pytest.raises(ContextError, match=r"missing params \['style'\]"):
        SPACE.validate({"size": 1, "noise": 0.1})
    with pytest.raises(ContextError, match="unknown split"):
        SPACE.sample("test", random.Random(0))


def test_bad_param_definitions() -> None:
    with pytest.raises(ContextError, match="kind"):
        ContextParam("x", "str", low=0, high=1)
    with pytest.raises(ContextError, match="low <= high"):
        ContextParam("x", "int", low=3, high=1)
    with pytest.raises(ContextError, match="both ood_low and ood_high"):
        ContextParam("x", "int", low=0, high=1, ood_low=3)
    with pytest.raises(ContextError, match="outside the train range"):
        ContextParam("x", "int", low=0, high=1, default=7)
    with pytest.raises(ContextError, match="duplicate"):
        ContextSpace([ContextParam("x", "int", 0, 1), ContextParam("x", "int", 0, 1)])


def test_describe_is_plain_data() -> None:
    rows = SPACE.describe()
    assert rows[0]["train"] == [1, 3] and rows[0]["ood"] == [5, 6]
    assert rows[2]["choices"] == ["a", "b"]


def test_split_of_is_stable_and_proportional() -> None:
    keys = [f"prompt {i}" for i in range(4000)]
    heldout = [k for k in keys if split_of(k, 0.25) == "heldout"]
    assert 0.2 < len(heldout) / len(keys) < 0.3
    assert split_of("prompt 1", 0.25) == split_of("prompt 1", 0.25)
    assert split_of("anything", 0.0) == "train" and split_of("anything", 1.0) == "heldout"
    # Pinned so a change of hash (which would reshuffle every dataset's splits) is noticed.
    assert task_id("calc", "What is 1 plus 2?") == "calc-d5ba070acea56950"
    assert task_id("calc", "x").startswith("calc-") and len(task_id("", "x")) == 16


def _generate(context: dict, rng: random.Random) -> tuple[str, str, dict]:
    a, b = rng.randint(0, 10 ** context["size"]), rng.randint(0, 9)
    return f"{a} + {b} ({context['style']})", str(a + b), {"a": a}


def test_sample_tasks_reproducible_and_disjoint() -> None:
    train = sample_tasks(_generate, SPACE, "train", 200, seed=3, id_prefix="toy")
    again = sample_tasks(_generate, SPACE, "train", 200, seed=3, id_prefix="toy")
    other = sample_tasks(_generate, SPACE, "train", 200, seed=4, id_prefix="toy")
    heldout = sample_tasks(_generate, SPACE, "heldout", 200, seed=3, id_prefix="toy")
    assert [t.to_dict() for t in train] == [t.to_dict() for t in again]
    assert [t.prompt for t in train] != [t.prompt for t in other]
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    assert all(t.split == "train" for t in train) and all(t.split == "heldout" for t in heldout)
    assert all(split_of(t.prompt, 0.2) == "heldout" for t in heldout)
    # A shorter draw is a prefix of a longer one.
    again = sample_tasks(_generate, SPACE, "train", 20, seed=3, id_prefix="toy")
    assert [t.id for t in again] == [t.id for t in train[:20]]
    ood = sample_tasks(_generate, SPACE, "ood", 20, seed=3)
    assert all(SPACE.is_ood(t.context) for t in ood)


def test_sample_tasks_unique_and_exhaustion() -> None:
    tiny = ContextSpace([ContextParam("size", "int", low=0, high=0)])

    def constant(context: dict, rng: random.Random) -> tuple[str, str, dict]:
        return f"task {rng.randint(0, 2)}", "0", {}

    tasks = sample_tasks(constant, tiny, "train", 10, seed=0, heldout_fraction=0.0)
    assert len(tasks) == 10
    with pytest.raises(ContextError, match="drew only"):
        sample_tasks(constant, tiny, "train", 10, seed=0, heldout_fraction=0.0, unique=True, max_attempts=500)
    with pytest.raises(ContextError, match="heldout_fraction is 0"):
        sample_tasks(constant, tiny, "heldout", 1, seed=0, heldout_fraction=0.0)


def test_context_ranges_narrow_train_and_heldout_and_keep_ood():
    from ctxrl.tasks.space import ContextError, ContextParam, ContextSpace, parse_ranges

    assert parse_ranges("") == {} and parse_ranges("pages=3-4, filler=5") == {"pages": (3, 4), "filler": (5, 5)}
    for bad in ("pages", "pages=3to4", "=3-4", "pages=3-4,pages=2-3"):
        with pytest.raises(ContextError, match="NAME=LOW-HIGH"):
            parse_ranges(bad)
    space = ContextSpace([ContextParam("pages", "int", low=2, high=4, default=2, ood_low=6, ood_high=8),
                          ContextParam("filler", "int", low=0, high=12)])
    narrow = space.narrowed({"pages": (3, 4)})
    pages = narrow.params[0]
    assert (pages.low, pages.high, pages.default, pages.range("ood")) == (3, 4, 3, (6, 8))
    assert narrow.params[1] == space.params[1]
    with pytest.raises(ContextError, match="within its train range"):
        space.narrowed({"pages": (1, 4)})
    with pytest.raises(ContextError, match="unknown params"):
        space.narrowed({"page": (3, 4)})


def test_an_environment_draws_only_the_ranges_its_table_asks_for():
    from ctxrl.config import ConfigError, load_config
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import spec_env_class

    def env_class(*overrides):
        return spec_env_class(RolloutSpec.from_config(load_config(None, ["env.name=fact_hunt", *overrides])))

    cls = env_class("env.fact_hunt.context_ranges=pages=3-4")
    for split, allowed in (("train", {3, 4}), ("heldout", {3, 4}), ("ood", {6, 7, 8})):
        assert {len(t.data["trail"]) for t in cls.sample_tasks(split, 60, 1)} <= allowed
    assert {len(t.data["trail"]) for t in env_class().sample_tasks("train", 60, 1)} == {2, 3, 4}
    with pytest.raises(ConfigError, match=r"\[env.fact_hunt\]: context ranges name unknown params \['page'\]"):
        env_class("env.fact_hunt.context_ranges=page=3-4")
    with pytest.raises(ConfigError, match="NAME=LOW-HIGH"):
        load_config(None, ["env.name=fact_hunt", "env.fact_hunt.context_ranges=pages:3"])
