"""Training an existing agent (``env.name = "harness"``): episodes recorded through the OpenAI endpoint."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from ctxrl.config import load_config
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.errors import ConfigError
from ctxrl.rollout.agent import run_episodes
from ctxrl.rollout.spec import RolloutSpec
from ctxrl.rollout.worker import spec_env_class

pytest.importorskip("fastapi")
pytest.importorskip("openai")

AGENT = "examples/harness/calculator_agent.py:rollout"
FIXTURES = "tests/fixtures/harness/agents.py"


def harness_class(harness: str = AGENT, data: str = "env:calculator") -> type:
    config = load_config(None, ["env.name=harness", f"env.harness.agent={harness!r}".replace("'", '"'),
                                f'env.data="{data}"'])
    return spec_env_class(RolloutSpec.from_config(config))


def limits(**changes):
    spec = RolloutSpec.from_config(load_config(None, []))
    return dataclasses.replace(spec.train, **changes)


def test_a_harness_episode_is_the_built_in_episode_token_for_token(renderer):
    """The example agent (plain OpenAI SDK) and the built-in calculator environment, given the same scripted
    policy, produce the same ids, masks and rewards: the endpoint adds nothing and re-tokenises nothing."""
    from ctxrl.serve.harness import run_harness

    task = CalculatorEnv.sample_tasks("train", 1, seed=3)[0]
    texts = CalculatorEnv.solve(task)  # a tool call, then the answer
    lim = limits(temperature=1.0)
    builtin_engine, harness_engine = ScriptedEngine(texts, renderer), ScriptedEngine(texts, renderer)
    [builtin] = asyncio.run(run_episodes(CalculatorEnv, [task], builtin_engine, renderer, lim, seed=5))
    [recorded] = asyncio.run(run_harness(harness_class(), [task], harness_engine, renderer, lim, seed=5))
    assert len(builtin.turns) == 2 and builtin.reward == 1.0 and builtin.turns[0].text != builtin.turns[1].text
    assert harness_engine.prompts == builtin_engine.prompts  # every call's prompt, id for id
    assert recorded.input_ids == builtin.input_ids
    assert recorded.loss_mask == builtin.loss_mask and recorded.turn_index == builtin.turn_index
    assert recorded.behavior_logprobs == builtin.behavior_logprobs
    assert recorded.segments == [] and recorded.reward == builtin.reward == 1.0 and recorded.success
    assert recorded.group_id == 0 and recorded.info["tool_calls"] == 1


def test_harness_results_and_failures(renderer):
    from ctxrl.serve.harness import run_harness

    task = CalculatorEnv.sample_tasks("train", 1, seed=3)[0]
    lim = limits(temperature=1.0, timeout_s=1.0)

    def run(name: str):
        engine = ScriptedEngine(["<answer>1</answer>"] * 4, renderer)
        return asyncio.run(run_harness(harness_class(f"{FIXTURES}:{name}"), [task], engine, renderer, lim))[0]

    rich = run("richer")
    assert rich.reward == 0.5 and rich.success and rich.info["note"] == "ok" and len(rich.turns) == 1
    broke = run("raises")
    assert broke.truncation == "error" and broke.info["error_kind"] == "step" and "the harness broke" in \
        broke.info["error"]
    assert sum(broke.loss_mask) > 0  # what it recorded before failing is kept (and left out of the loss by kind)
    text = run("returns_text")
    assert text.info["error_kind"] == "step" and "return a number" in text.info["error"]
    slow = run("sleeps")
    assert slow.info["error_kind"] == "deadline"
    nan = run("returns_nan")  # a reward that would poison the step's advantages: the harness's failure
    assert nan.info["error_kind"] == "step" and "finite" in nan.info["error"]


def test_an_error_inside_ctxrl_stops_the_run_rather_than_erroring_an_episode(renderer):
    from ctxrl.serve.harness import run_harness

    class Broken(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            raise RuntimeError("CUDA error: an illegal memory access")

    task = CalculatorEnv.sample_tasks("train", 1, seed=3)[0]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        asyncio.run(run_harness(harness_class(), [task], Broken([], renderer), renderer, limits()))


@pytest.mark.parametrize("overrides, message", [
    (["env.name=harness", 'env.data="env:calculator"'], "needs env.harness"),
    (["env.name=harness", f'env.harness.agent="{AGENT}"'], "needs env.data"),
    (["env.name=harness", 'env.data="env:calculator"', 'env.harness.agent="no/such/file.py:rollout"'], "no file"),
    (["env.name=harness", 'env.data="env:calculator"', f'env.harness.agent="{FIXTURES}:missing"'], "has no function"),
    (["env.name=harness", 'env.data="env:calculator"', f'env.harness.agent="{FIXTURES}:not_async"'], "async function"),
    (["env.name=harness", 'env.data="env:calculator"', 'env.harness.agent="rollout"'], "module:function"),
])
def test_a_misconfigured_harness_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        spec_env_class(RolloutSpec.from_config(load_config(None, overrides)))


def test_a_harness_trains_like_a_built_in_environment(tmp_path):
    from conftest import TINY

    from ctxrl.run.build import build, start_learning
    from ctxrl.run.step import rl_step

    config = load_config("examples/harness/calculator.toml", [f"model.name={TINY}", "sft.enabled=false",
                                                              "rollout.tasks_per_step=2", "rollout.group_size=2",
                                                              "rollout.max_new_tokens=8", "run.progress=false"])
    run = build(config, tmp_path)
    start_learning(run)
    row = rl_step(run, 0)
    assert row["skipped"] == 0.0 and run.worker.policy_version == 1
    assert row["errored"] == 0.0 and row["turns"] >= 1.0 and row["sampled_tokens"] > 0


def test_a_harness_with_roles_records_one_sequence_a_role_each_with_its_reward(renderer):
    """``ask_and_answer.roles = ("asker", "answerer")``: a client a role, each on a session of its own, so one
    episode a seat: its own ids (its prompt, its sampled tokens under the mask), its role, its reward, and a
    baseline group of its own role."""
    from ctxrl.serve.harness import run_harness

    task = CalculatorEnv.sample_tasks("train", 1, seed=3)[0]
    engine = ScriptedEngine([f"What is {task.prompt}?", f"<answer>{task.answer}</answer>"], renderer)
    asker, answerer = asyncio.run(run_harness(harness_class(f"{FIXTURES}:ask_and_answer"), [task], engine, renderer,
                                              limits(temperature=1.0), seed=2))
    assert (asker.role, answerer.role) == ("asker", "answerer")
    assert (asker.reward, asker.success, answerer.reward, answerer.success) == (0.5, True, 1.0, True)
    assert asker.baseline_group == (0, "asker") and answerer.baseline_group == (0, "answerer")
    assert asker.info["question"] == answerer.info["question"] == f"What is {task.prompt}?"
    for episode, said in ((asker, f"What is {task.prompt}?"), (answerer, f"<answer>{task.answer}</answer>")):
        sampled = [i for i, m in zip(episode.input_ids, episode.loss_mask) if m]
        assert renderer.decode(sampled).startswith(said) and len(episode.turns) == 1
        assert len(episode.input_ids) == len(episode.loss_mask) == len(episode.behavior_logprobs)
    assert "Ask this" in renderer.decode(asker.input_ids) and "Ask this" not in renderer.decode(answerer.input_ids)
    assert engine.prompts[0] == asker.input_ids[: len(engine.prompts[0])]  # what the engine saw, id for id
    assert engine.prompts[1] == answerer.input_ids[: len(engine.prompts[1])]

    engine = ScriptedEngine(["x"] * 4, renderer)
    bad = asyncio.run(run_harness(harness_class(f"{FIXTURES}:forgets_a_role"), [task], engine, renderer, limits()))
    assert [e.role for e in bad] == ["asker", "answerer"] and all(e.info["error_kind"] == "step" for e in bad)
    assert "its roles are ['asker', 'answerer']: one reward each" in bad[0].info["error"]
    with pytest.raises(ConfigError, match=r"roles \('alone',\) must be two or more distinct names"):
        harness_class(f"{FIXTURES}:one_role")


def test_a_harness_with_roles_trains_each_role_against_its_own_group(tmp_path):
    from conftest import TINY

    from ctxrl.run.build import build, start_learning
    from ctxrl.run.step import rl_step

    config = load_config(None, ["env.name=harness", f'env.harness.agent="{FIXTURES}:ask_and_answer"',
                                'env.data="env:calculator"', f"model.name={TINY}", "sft.enabled=false",
                                "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                                "run.progress=false", "eval.tasks=2"])
    run = build(config, tmp_path)
    start_learning(run)
    row = rl_step(run, 0)
    assert row["errored"] == 0.0 and run.worker.policy_version == 1
    assert row["success_asker"] == 1.0 and row["reward_asker"] == 0.5 and "success_answerer" in row


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_one_step_beside(harness, stop, port: int, tmp_path):
    """One RL step of a run whose ``remote:PORT`` harness is ``harness``, played in a thread until ``stop`` (a
    ``threading.Event``) is set."""
    import threading

    from conftest import TINY

    from ctxrl.run.build import build, start_learning
    from ctxrl.run.step import rl_step
    from ctxrl.serve.harness import Remote

    config = load_config(None, [f"model.name={TINY}", "env.name=harness", f'env.harness.agent="remote:{port}"',
                                'env.data="env:calculator"', "sft.enabled=false", "rollout.tasks_per_step=2",
                                "rollout.group_size=2", "rollout.max_new_tokens=6", "run.progress=false",
                                "rollout.episode_timeout_s=60"])
    thread = threading.Thread(target=harness, daemon=True)
    thread.start()
    try:
        run = build(config, tmp_path)
        start_learning(run)
        row = rl_step(run, 0)
    finally:
        stop.set()
        thread.join(timeout=10)
        Remote._servers[port].close()
    return run, row


def test_harnesses_in_another_process_train_through_the_http_server(tmp_path, monkeypatch):
    """ctxrl serve --train: the trainer opens sessions; an outside harness (here a thread speaking HTTP with the
    sync OpenAI client) claims each, plays it and finishes it with a reward."""
    import threading

    monkeypatch.delenv("CTXRL_API_KEY", raising=False)  # (no key: see the next test for one)

    import httpx
    import openai


    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    stop, played, errors = threading.Event(), [], []

    def harness() -> None:
        while not stop.is_set():
            try:
                claim = httpx.get(f"{base}/train/next", params={"wait": 0.2}, timeout=5).json()
            except httpx.HTTPError:
                continue  # the server is not up yet
            if claim["session"] is None:
                continue
            try:
                client = openai.OpenAI(base_url=base + claim["base_url"], api_key="x", max_retries=0)
                reply = client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": claim["task"]["prompt"]}], max_tokens=6)
                reward = float(len(reply.choices[0].message.content or "") % 2)
                done = httpx.post(f"{base}/sessions/{claim['session']}/finish", json={"reward": reward}, timeout=5)
                played.append((claim["session"], reward, done.status_code))
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

    run, row = train_one_step_beside(harness, stop, port, tmp_path)
    assert not errors, errors
    assert len(played) == 4 and all(code == 200 for _, _, code in played)
    assert row["skipped"] == 0.0 and run.worker.policy_version == 1
    rewards = sorted(r for _, r, _ in played)
    assert row["reward"] == pytest.approx(sum(rewards) / 4) and row["turns"] == 1.0 and row["errored"] == 0.0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/train/next", timeout=2)  # the server stopped with close()


def test_a_harness_bad_request_or_reward_never_ends_the_run_and_every_route_asks_for_the_key(tmp_path, monkeypatch):
    """ctxrl serve --train with a key (here from CTXRL_API_KEY): without it every route is a 401; with it, a
    harness that sends a malformed request, a NaN or overflowing reward and calls to a session it was not given
    gets its 4xx each time, and the step trains on the episodes it then plays properly."""
    import threading

    import httpx
    import openai


    monkeypatch.setenv("CTXRL_API_KEY", "sekrit")
    port = _free_port()
    base, key = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sekrit"}
    stop, statuses, played, errors = threading.Event(), [], [], []

    def harness() -> None:
        while not stop.is_set():
            try:
                claim = httpx.get(f"{base}/train/next", params={"wait": 0.2}, headers=key, timeout=5).json()
            except httpx.HTTPError:
                continue  # the server is not up yet
            if claim["session"] is None:
                continue
            sid = claim["session"]
            try:
                statuses.append(("no key", [
                    httpx.get(f"{base}/train/next", params={"wait": 0}, timeout=5).status_code,
                    httpx.get(f"{base}/sessions/{sid}/episode", timeout=5).status_code,
                    httpx.post(f"{base}/sessions/{sid}/finish", json={"reward": 1.0}, timeout=5).status_code,
                    httpx.post(f"{base}{claim['base_url']}/chat/completions", timeout=5,
                               json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).status_code,
                    httpx.get(f"{base}/health", timeout=5).status_code]))
                client = openai.OpenAI(base_url=base + claim["base_url"], api_key="sekrit", max_retries=0)
                user = {"role": "user", "content": claim["task"]["prompt"]}
                try:
                    client.chat.completions.create(model="policy", max_tokens=6, messages=[
                        user, {"role": "tool", "tool_call_id": {"a": 1}, "content": "4"}])
                except openai.BadRequestError as exc:
                    statuses.append(("bad request", exc.status_code))
                stranger = openai.OpenAI(base_url=f"{base}/sessions/not-{sid}/v1", api_key="sekrit", max_retries=0)
                try:  # a session the trainer did not open is not opened for a client
                    stranger.chat.completions.create(model="policy", messages=[user], max_tokens=6)
                except openai.NotFoundError as exc:
                    statuses.append(("stranger", exc.status_code))
                reply = client.chat.completions.create(model="policy", messages=[user], max_tokens=6)
                for raw in (b'{"reward": NaN}', b'{"reward": 1' + b"0" * 400 + b"}",
                            b'{"reward": 1, "turn_rewards": [Infinity]}'):
                    r = httpx.post(f"{base}/sessions/{sid}/finish", content=raw, headers=key, timeout=5)
                    statuses.append(("bad reward", r.status_code))
                reward = float(len(reply.choices[0].message.content or "") % 2)
                done = httpx.post(f"{base}/sessions/{sid}/finish", json={"reward": reward}, headers=key, timeout=5)
                played.append((sid, reward, done.status_code))
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

    run, row = train_one_step_beside(harness, stop, port, tmp_path)
    assert not errors, errors
    assert [s for kind, s in statuses if kind == "no key"] == [[401] * 5] * 4
    assert sorted({(kind, s) for kind, s in statuses if kind != "no key"}) == [
        ("bad request", 400), ("bad reward", 400), ("stranger", 404)]
    assert len(played) == 4 and all(code == 200 for _, _, code in played)
    assert row["skipped"] == 0.0 and row["errored"] == 0.0 and run.worker.policy_version == 1
    assert row["reward"] == pytest.approx(sum(r for _, r, _ in played) / 4)
