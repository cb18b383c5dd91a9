"""Rollouts on Ray (``distributed.backend = "ray"``): the same episodes as one process, workers that die,
asynchronous training whose staleness stays within its bound. A local Ray on this machine's CPUs."""

from __future__ import annotations

import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from conftest import TINY, alternating_sign  # noqa: E402

from ctxrl.config import load_config  # noqa: E402
from ctxrl.distributed.pool import RayRolloutPool, WorkerFailure, shards  # noqa: E402
from ctxrl.envs.calculator import CalculatorEnv  # noqa: E402
from ctxrl.errors import ConfigError  # noqa: E402
from ctxrl.rollout.spec import RolloutRequest, RolloutSpec  # noqa: E402
from ctxrl.rollout.worker import RolloutWorker  # noqa: E402

ADVANTAGE = alternating_sign()  # (+1 / -1 by episode parity: conftest)
BASE = [f"model.name={TINY}", "model.device=cpu", "sft.enabled=false", "rollout.tasks_per_step=3",
        "rollout.group_size=2", "rollout.max_new_tokens=8", "run.progress=false", "rollout.temperature=1.0"]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def spec() -> RolloutSpec:
    return RolloutSpec.from_config(load_config(None, BASE))


def test_shards_are_contiguous_even_and_never_empty():
    assert shards(5, 2) == [(0, 2), (2, 5)] or shards(5, 2) == [(0, 3), (3, 5)]
    assert shards(2, 4) == [(0, 1), (1, 2)] and shards(0, 3) == [] and shards(6, 3) == [(0, 2), (2, 4), (4, 6)]
    for n, w in ((7, 3), (1, 1), (10, 4)):
        parts = shards(n, w)
        assert parts[0][0] == 0 and parts[-1][1] == n and all(a < b for a, b in parts)
        assert all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1))


def _same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.task.id, x.group_id) == (y.task.id, y.group_id)
        assert x.input_ids == y.input_ids and x.loss_mask == y.loss_mask and x.reward == y.reward
        assert x.behavior_logprobs == pytest.approx(y.behavior_logprobs, abs=1e-5)


def test_a_request_split_across_workers_plays_the_episodes_of_one_process(spec):
    local = RolloutWorker.from_spec(spec)
    request = RolloutRequest(tasks=CalculatorEnv.sample_tasks("train", 5, seed=1), group_size=2, seed=7,
                             group_offset=10)
    expected = local.run(request)
    pool = RayRolloutPool(spec, workers=2, timeout_s=120)
    try:
        pool.load_weights(local.engine.model.state_dict(), version=4)
        got = pool.run(request)
    finally:
        pool.close()
    _same(expected, got)
    assert [e.group_id for e in got] == [10 + i // 2 for i in range(10)]
    assert {e.policy_version for e in got} == {4} and pool.policy_version == 4


def test_a_worker_killed_mid_batch_is_restarted_and_its_shard_played_again(spec):
    local = RolloutWorker.from_spec(spec)
    request = RolloutRequest(tasks=CalculatorEnv.sample_tasks("train", 8, seed=2), group_size=4, seed=3)
    expected = local.run(request)
    pool = RayRolloutPool(spec, workers=2, timeout_s=120)
    try:
        pool.load_weights(local.engine.model.state_dict(), version=1)
        victim = pool.actors[1]
        killer = threading.Timer(0.05, lambda: ray.kill(victim))
        killer.start()
        got = pool.run(request)
        killer.join()
        assert pool.actors[1] is not victim and pool.stats["restarts"] == 1 and pool.stats["retried_shards"] == 1
        _same(expected, got)  # the new worker holds the same weights and replays the same seeds
        assert {e.policy_version for e in got} == {1}
        ray.kill(pool.actors[0])  # before a request: the same
        _same(expected, pool.run(request))
    finally:
        pool.close()


def test_a_worker_that_keeps_dying_stops_the_run_with_a_message(spec):
    pool = RayRolloutPool(spec, workers=1, timeout_s=60, retries=0)
    try:
        ray.kill(pool.actors[0])
        time.sleep(0.5)
        with pytest.raises(WorkerFailure, match="rollout worker 0 died 1 times playing tasks 0..1"):
            pool.run(RolloutRequest(tasks=CalculatorEnv.sample_tasks("train", 2, seed=1), group_size=1, seed=1))
    finally:
        pool.close()


@pytest.mark.slow  # minutes on a 2-core CPU: out of the default run (`-m slow` runs it)
def test_a_worker_dead_at_weight_sync_is_replaced_holding_the_new_weights_within_the_bound(spec):
    """Killed while idle (as during an update) or while the weights load: the sync replaces it with a fresh actor
    that loads them; past ``retries`` deaths in one call, a WorkerFailure naming what it was doing."""
    local = RolloutWorker.from_spec(spec)
    request = RolloutRequest(tasks=CalculatorEnv.sample_tasks("train", 4, seed=5), group_size=2, seed=9)
    state = {k: v.clone() for k, v in local.engine.model.state_dict().items()}
    pool = RayRolloutPool(spec, workers=2, timeout_s=120)
    try:
        pool.load_weights(state, version=1)
        ray.kill(pool.actors[0])  # idle
        new = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in state.items()}
        local.load_weights(new, version=2)
        pool.load_weights(new, version=2)
        assert pool.stats["restarts"] == 1
        victim = pool.actors[1]
        killer = threading.Timer(0.0, lambda: ray.kill(victim))  # while the weights load, or just after
        killer.start()
        pool.load_weights(new, version=3)
        killer.join()
        local.load_weights(new, version=3)
        got = pool.run(request)  # (a death the sync did not see is met here, and replayed)
        assert pool.stats["restarts"] == 2 and pool.actors[1] is not victim
        _same(local.run(request), got)
        assert {e.policy_version for e in got} == {3}
    finally:
        pool.close()
    pool = RayRolloutPool(spec, workers=1, timeout_s=60, retries=0)
    try:
        ray.kill(pool.actors[0])
        with pytest.raises(WorkerFailure, match=r"rollout worker 0 died 1 times loading weights \(version 4\)"):
            pool.load_weights(state, version=4)
    finally:
        pool.close()


def _rows(tmp_path, extra: list[str], steps: int = 2, during_update=None) -> tuple[list[dict], object]:
    """``steps`` RL steps of a run; ``during_update(run, step)`` is called inside each step's update (the rollout
    workers idle)."""
    from ctxrl.run.build import build, close, start_learning
    from ctxrl.run.step import rl_step, sync_engine

    config = load_config(None, BASE + [f"algo.advantage={ADVANTAGE}", "train.lr=1e-2", f"train.steps={steps}",
                                       *extra])
    run = build(config, tmp_path)
    try:
        learner = start_learning(run)
        if during_update is not None:
            update, done = learner.update, []

            def hooked(batch):
                during_update(run, len(done))
                done.append(1)
                return update(batch)

            learner.update = hooked
        sync_engine(run, 0)
        return [rl_step(run, s) for s in range(steps)], run
    finally:
        close(run)


@pytest.mark.slow  # (104 s on 2 cores: Ray's start, two runs and a restarted worker; the sharding and restart
# tests below keep the default suite's coverage of both)
def test_synchronous_training_on_ray_gives_the_in_process_results(tmp_path):
    """... with a worker killed while idle, during the first update: the weight sync replaces it, within the bound."""
    def kill_while_idle(run, step):
        if step == 0:
            ray.kill(run.worker.actors[0])

    local, _ = _rows(tmp_path / "local", [])
    on_ray, run = _rows(tmp_path / "ray", ["distributed.backend=ray"], during_update=kill_while_idle)
    assert type(run.worker).__name__ == "RayRolloutPool"
    assert run.worker.stats["restarts"] == 1 and run.worker.policy_version == 2
    for a, b in zip(local, on_ray):
        assert a["grad_norm"] > 0
        for key in ("reward", "sampled_tokens", "turns"):
            assert a[key] == b[key], key
        for key in ("loss", "grad_norm", "approx_kl", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_asynchronous_training_keeps_staleness_within_its_bound(tmp_path):
    rows, run = _rows(tmp_path, ["distributed.backend=ray", "distributed.max_staleness=1",
                                 "algo.old_logprobs=recompute", "algo.tis_cap=2.0"], steps=4)
    assert [r["staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]  # the first step starts from version 0
    assert all(r["stale_dropped"] == 0.0 and r["grad_norm"] > 0 for r in rows)
    assert run.worker.policy_version == 4


@pytest.mark.slow  # (Ray's start and two asynchronous steps)
def test_an_offpolicy_correction_chosen_by_name_applies_on_the_asynchronous_path(tmp_path):
    """``algo.offpolicy`` on stale rollouts: the correction compares the learner's recomputed old log-probs with the
    behaviour ones of an older policy, as on the synchronous path, and the rows log what it masked."""
    rows, _ = _rows(tmp_path, ["distributed.backend=ray", "distributed.max_staleness=1",
                               "algo.old_logprobs=recompute", "algo.offpolicy=icepop", "algo.icepop.lower=0.9",
                               "algo.icepop.upper=1.1"], steps=2)
    assert [r["staleness_max"] for r in rows] == [0.0, 1.0]
    assert all("offpolicy_masked_frac" in r and r["offpolicy_ratio_mean"] > 0 and r["grad_norm"] > 0 for r in rows)


@pytest.mark.parametrize("extra, message", [
    (["distributed.backend=ray", "distributed.max_staleness=1"], "algo.old_logprobs"),
    (["distributed.backend=ray", "distributed.rollout_workers=0"], "rollout_workers"),
])
def test_distributed_settings_that_cannot_work_are_config_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, extra)
