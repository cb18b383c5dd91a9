"""``verifiers:ID``: verifiers environments (the real package) played end to end by ctxrl's agent loop.

The environments are written for these tests (``tests/fixtures/verifiers``): a single-turn one with a train and an
eval dataset, a ``ToolEnv`` with a tool that adds and one that raises, and a multi-turn game whose ``env_response``
answers each guess and whose stop condition and rubric end and score it. Every episode goes through
``run_episode`` with a scripted policy, so what is checked is what a training run does.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap

import pytest

pytest.importorskip("verifiers")

from ctxrl.config import load_config  # noqa: E402
from ctxrl.engine.scripted import ScriptedEngine  # noqa: E402
from ctxrl.envs import check_env  # noqa: E402
from ctxrl.envs.base import EnvError  # noqa: E402
from ctxrl.envs.registry import configured_env_class, get_env_class  # noqa: E402
from ctxrl.errors import ConfigError  # noqa: E402
from ctxrl.rollout.agent import run_episode  # noqa: E402
from ctxrl.rollout.spec import RolloutLimits, RolloutSpec  # noqa: E402
from ctxrl.rollout.worker import spec_env_class  # noqa: E402

FIXTURES = "tests/fixtures/verifiers"
SINGLE, TOOLS, GAME = (f"verifiers:{FIXTURES}/{name}.py" for name in ("arith_single", "adder_tools", "guess_game"))
LIMITS = RolloutLimits(max_turns=8, max_new_tokens=64, max_total_tokens=4096)


def _play(env_cls, task, texts, renderer, limits=LIMITS):
    return asyncio.run(run_episode(env_cls(), task, ScriptedEngine(texts, renderer), renderer, limits, seed=0))


def _observations(episode, renderer) -> str:
    """The text of the episode's context tokens after the prompt (loss mask 0): what the environment said."""
    first = episode.loss_mask.index(1)
    return renderer.decode([t for t, m in zip(episode.input_ids[first:], episode.loss_mask[first:]) if m == 0])


@pytest.mark.parametrize("name", [SINGLE, TOOLS, GAME])
def test_the_test_environments_pass_check_env(name):
    notes: list[str] = []
    assert check_env(get_env_class(name), n_tasks=4, notes=notes) == []
    assert any("'ood'" in note for note in notes)  # a verifiers environment has no ood split


def test_single_turn_prompts_splits_and_rubric(renderer):
    cls = get_env_class(SINGLE)
    assert cls.splits() == ("train", "heldout")  # its dataset and its eval dataset
    train, heldout = cls.loaded().tasks["train"], cls.loaded().tasks["heldout"]
    assert len(train) == 40 and len(heldout) == 10
    assert {t.prompt for t in train}.isdisjoint({t.prompt for t in heldout})
    task = next(t for t in train if t.prompt == "What is 5 + 8?")
    env = cls()
    opening = env.reset(task, seed=0)
    env.close()
    assert [(m.role, m.content) for m in opening] == [("system", "Reply with <answer>N</answer>."),
                                                      ("user", "What is 5 + 8?")]
    right = _play(cls, task, ["<answer>\n13\n</answer>"], renderer)
    assert right.reward == 1.0 and right.success is True and right.truncation is None
    wrong = _play(cls, task, ["<answer>12</answer>"], renderer)
    assert wrong.reward == 0.0 and wrong.success is False
    assert [len(e.turns) for e in (right, wrong)] == [1, 1]


def test_tool_env_runs_its_tools_and_shows_their_errors(renderer):
    cls = get_env_class(TOOLS)
    env = cls()
    assert [t.name for t in env.tools] == ["add", "broken"]
    # ``note: str | None`` is an anyOf in verifiers' schema: shown as a type list, which means the same
    assert env.tools[1].parameters["properties"]["note"]["type"] == ["string", "null"]
    task = next(t for t in cls.loaded().tasks["train"] + cls.loaded().tasks["heldout"] if t.answer == "41")
    assert task.prompt == "Use the add tool: what is 10 + 31?"
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 10, "b": 31}}\n</tool_call>'
    broken = '<tool_call>\n{"name": "broken", "arguments": {"note": "x"}}\n</tool_call>'
    episode = _play(cls, task, [broken, call, "<answer>41</answer>"], renderer)
    assert episode.reward == 1.0 and len(episode.turns) == 3
    said = _observations(episode, renderer)
    assert "the broken tool broke" in said and "41" in said
    assert [t.tool_calls for t in episode.turns] == [1, 1, 0]
    # a turn without a call ends a ToolEnv (its no_tools_called stop condition), scored by its rubric
    early = _play(cls, task, ["<answer>40</answer>"], renderer)
    assert early.reward == 0.0 and len(early.turns) == 1 and early.truncation is None


def test_multi_turn_game_replies_stops_and_scores(renderer):
    cls = get_env_class(GAME)
    task = next(t for t in cls.loaded().tasks["train"] if t.answer == "8")
    episode = _play(cls, task, ["<guess>3</guess>", "<guess>12</guess>", "<guess>8</guess>"], renderer)
    said = _observations(episode, renderer)
    assert "higher" in said and "lower" in said and "Correct!" not in said  # the final reply is never shown
    assert episode.reward == pytest.approx(1 / 3)  # the rubric: 1 / turns for a win
    assert episode.success is False  # below the environment's pass_threshold (0.5)
    quick = _play(cls, task, ["<guess>5</guess>", "<guess>8</guess>"], renderer)
    assert quick.reward == 0.5 and quick.success is True
    # the environment's own max_turns (6) ends a game before ctxrl's limit (8), and the rubric still scores it
    lost = _play(cls, task, ["<guess>1</guess>"] * 6, renderer)
    assert lost.reward == 0.0 and len(lost.turns) == 6 and lost.truncation is None
    # ctxrl's own, lower limit ends it first: no rubric, reward 0 (docs/verifiers.md), and its cleanup still runs
    cleaned = cls.loaded().module.CLEANED
    before = len(cleaned)
    cut = _play(cls, task, ["<guess>1</guess>"] * 2, renderer, RolloutLimits(max_turns=2, max_total_tokens=4096))
    assert cut.truncation == "max_turns" and cut.reward == 0.0 and cleaned[before:] == ["8"]


def test_a_rewritten_history_is_an_errored_episode(renderer):
    cls = configured_env_class(GAME, {"args": ["rewrite=true"]})
    task = next(t for t in cls.loaded().tasks["train"] if t.answer == "8")
    episode = _play(cls, task, ["<guess>3</guess>", "<guess>8</guess>"], renderer)
    assert episode.truncation == "error" and episode.info["error_kind"] == "step"
    assert "rewrote the conversation in get_prompt_messages" in episode.info["error"]


def test_settings_reach_load_environment_and_signal_handlers_stay(tmp_path):
    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        config = load_config(None, [f"env.name={SINGLE}", "env.verifiers.args=[\"num_train=6\"]",
                                    "env.verifiers.max_examples=4"])
        cls = spec_env_class(RolloutSpec.from_config(config))
        assert cls.options.args == ["num_train=6"]
        assert len(cls.loaded().tasks["train"]) == 4 and len(cls.loaded().tasks["heldout"]) == 4
        assert signal.getsignal(signal.SIGTERM) is mine  # vf.Environment installs its own; ctxrl's come back
    finally:
        signal.signal(signal.SIGTERM, before)
    with pytest.raises(ConfigError, match=r"\[env.verifiers\]: args entry '6' must look like NAME=VALUE"):
        load_config(None, [f"env.name={SINGLE}", "env.verifiers.args=[\"6\"]"])


def _module(tmp_path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text("import verifiers as vf\nfrom datasets import Dataset\n\n" + textwrap.dedent(body))
    return f"verifiers:{path}"


def test_what_cannot_be_mapped_is_refused_naming_why(tmp_path):
    rows = 'Dataset.from_list([{"question": "q", "answer": "a"}])'
    group = _module(tmp_path, "group", f"""
        def load_environment():
            rubric = vf.Rubric()
            async def best(states) -> list[float]:
                return [1.0 for _ in states]
            rubric.add_reward_func(best)
            return vf.SingleTurnEnv(dataset={rows}, rubric=rubric)
        """)
    with pytest.raises(EnvError, match="group reward functions.*scores each episode alone"):
        get_env_class(group).loaded()
    own_model = _module(tmp_path, "own_model", f"""
        class Asks(vf.SingleTurnEnv):
            async def get_model_response(self, state, prompt, **kwargs):
                return await super().get_model_response(state, prompt, **kwargs)
        def load_environment():
            return Asks(dataset={rows})
        """)
    with pytest.raises(EnvError, match="overrides get_model_response: its model calls are its own"):
        get_env_class(own_model).loaded()
    missing = _module(tmp_path, "nothing", "X = 1\n")
    with pytest.raises(EnvError, match="has no load_environment"):
        get_env_class(missing).loaded()
    with pytest.raises(EnvError, match="verifiers:ID"):
        get_env_class("verifiers:")
    with pytest.raises(EnvError, match="cannot import its module"):
        get_env_class("verifiers:no_such_verifiers_env_anywhere").loaded()


def test_without_the_package_the_name_says_which_extra(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(EnvError, match=r"need the verifiers package: pip install -e '\.\[verifiers\]'"):
        get_env_class("verifiers:anything")
    v1_only = types.ModuleType("verifiers")  # what verifiers 0.4 is: no vf.Environment API at its root
    v1_only.__version__ = "0.4.0"
    monkeypatch.setitem(sys.modules, "verifiers", v1_only)
    with pytest.raises(EnvError, match=r"verifiers 0.4.0 has no vf.Environment API .*installs the release ctxrl maps"):
        get_env_class("verifiers:anything")


@pytest.mark.slow
def test_training_runs_on_a_verifiers_tool_env(tmp_path):
    from test_env_training import SMALL

    from ctxrl.train.trainer import train

    config = load_config(None, [f"env.name={TOOLS}", *SMALL, "env.max_turns=4"])
    summary = train(config, tmp_path / "run")
    assert summary["steps"] == 1 and 0.0 <= summary["heldout_success_after"] <= 1.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r["split"] for r in rows if r["phase"] == "eval"} == {"train", "heldout"}  # no ood split
    assert [r["tokens"] > 0 for r in rows if r["phase"] == "rl"] == [True]
