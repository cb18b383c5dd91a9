"""``openenv:NAME``: OpenEnv environments (the real ``openenv_core``) played by ctxrl's agent loop, and ``nemo_gym:``
refused with its reason.

Two environments: the echo environment that OpenEnv's own ``openenv init`` writes (its template: ``reset()`` without a
seed, ``step`` never done), and a guessing game written against ``openenv_core`` with a seeded ``reset``
(``tests/fixtures/openenv/guess_env.py``). Every episode goes through ``run_episode`` with a scripted policy."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openenv_core")

from ctxrl.chat.toolcalls import format_tool_call  # noqa: E402
from ctxrl.engine.scripted import ScriptedEngine  # noqa: E402
from ctxrl.envs import check_env  # noqa: E402
from ctxrl.envs.base import EnvError  # noqa: E402
from ctxrl.envs.registry import configured_env_class, get_env_class  # noqa: E402
from ctxrl.rollout.agent import run_episode  # noqa: E402
from ctxrl.rollout.spec import RolloutLimits  # noqa: E402

GUESS = "openenv:tests/fixtures/openenv/guess_env.py:GuessEnvironment"
LIMITS = RolloutLimits(max_turns=6, max_new_tokens=64, max_total_tokens=4096)


def play(env_cls, task, texts, renderer):
    return asyncio.run(run_episode(env_cls(), task, ScriptedEngine(texts, renderer), renderer, LIMITS, seed=0))


def test_a_seeded_environment_plays_with_train_and_heldout_seeds(renderer):
    sys.path.insert(0, "tests/fixtures/openenv")
    from guess_env import secret_of

    env_cls = get_env_class(GUESS)
    assert env_cls.splits() == ("train", "heldout") and env_cls.tool_name == "guess_action"
    assert env_cls.action_schema["properties"] == {"guess": {"type": "integer"}}
    train = {t.data["seed"] for t in env_cls.sample_tasks("train", 50, 0)}
    assert not train & {t.data["seed"] for t in env_cls.sample_tasks("heldout", 50, 0)}
    task = env_cls.sample_tasks("train", 1, 3)[0]
    secret = secret_of(task.data["seed"])
    wrong = secret % 8 + 1
    episode = play(env_cls, task, [format_tool_call("guess_action", {"guess": 99}),
                                   format_tool_call("guess_action", {"guess": wrong}),
                                   format_tool_call("guess_action", {"guess": secret})], renderer)
    assert episode.reward == 1.0 and episode.success and not episode.info.get("error_kind")
    text = renderer.decode(episode.input_ids)
    assert "Error: ValueError: guess from 1 to 8" in text and ("higher" in text or "lower" in text)
    lost = play(env_cls, task, [format_tool_call("guess_action", {"guess": wrong}), "I give up."], renderer)
    assert lost.reward == 0.0 and not lost.success
    problems = check_env(env_cls, n_tasks=2)
    assert all("solve" in p or "gold" in p or "scripted solution" in p for p in problems), problems


def test_the_echo_environment_openenv_init_writes(tmp_path, renderer):
    cli = shutil.which("openenv") or str(Path(sys.executable).with_name("openenv"))
    subprocess.run([cli, "init", "echo_env", "--output-dir", str(tmp_path)], check=True, capture_output=True)
    source = tmp_path / "echo_env" / "server" / "echo_env_environment.py"
    sys.path.insert(0, str(tmp_path / "echo_env"))  # (its server imports `models`, as OpenEnv's own servers do)
    env_cls = get_env_class(f"openenv:{source}:EchoEnvironment")
    assert env_cls.splits() == ("train",)  # reset() takes no seed: no held-out seeds to draw
    task = env_cls.sample_tasks("train", 1, 0)[0]
    episode = play(env_cls, task, [format_tool_call(env_cls.tool_name, {"message": "hello"}),
                                   format_tool_call(env_cls.tool_name, {"message": "hi"}), "done"], renderer)
    assert episode.reward == pytest.approx(0.5 + 0.2)  # its reward: 0.1 a character
    assert "echoed_message: hello" in renderer.decode(episode.input_ids)


def test_what_cannot_be_mapped_is_refused_naming_why():
    with pytest.raises(EnvError, match="one episode at a time"):
        get_env_class("openenv:http://127.0.0.1:8000")
    with pytest.raises(EnvError, match="not an OpenEnv Environment"):
        get_env_class("openenv:ctxrl.envs.calculator:CalculatorEnv")
    with pytest.raises(EnvError, match="Python >= 3.12"):
        get_env_class("nemo_gym:math_with_judge")
    with pytest.raises(EnvError, match="no scripted solution"):
        configured_env_class(GUESS).solve(None)
