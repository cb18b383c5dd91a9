"""Bounded staleness in one process (``ctxrl.distributed.staleness``): the engine plays weights held exactly
``distributed.max_staleness`` versions behind the learner's, evaluations play the current ones, a resume starts
the lag again, and an off-policy correction sees the gap."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, alternating_sign

from ctxrl.config import load_config
from ctxrl.distributed.staleness import LaggedWeights
from ctxrl.errors import ConfigError

ADVANTAGE = alternating_sign()  # (+1 / -1 by episode parity: conftest)
BASE = [f"model.name={TINY}", "model.device=cpu", "sft.enabled=false", "rollout.tasks_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=6", "run.progress=false", "rollout.temperature=1.0",
        "eval.tasks=2", f"algo.advantage={ADVANTAGE}", "train.lr=1e-2", "algo.old_logprobs=recompute"]


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2,), value)}


def test_the_engine_plays_the_state_lag_versions_back():
    lagged = LaggedWeights(2)
    played = [lagged.push(v, _state(float(v)), False)[0] for v in range(6)]
    assert played == [0, 0, 0, 1, 2, 3]
    assert lagged.current()[0] == 5 and lagged.playing()[0] == 3
    version, state, partial = lagged.playing()
    assert torch.equal(state["w"], torch.full((2,), 3.0)) and partial is False


def test_held_states_are_copies_and_the_same_version_replaces_its_state():
    lagged = LaggedWeights(1)
    live = {"w": torch.zeros(2)}
    lagged.push(0, live, True)
    live["w"] += 7.0  # the learner's tensors move on in place: the held state must not
    assert torch.equal(lagged.playing()[1]["w"], torch.zeros(2))
    lagged.push(0, live, True)  # the warm start's weights replace the initial ones as version 0
    assert torch.equal(lagged.playing()[1]["w"], torch.full((2,), 7.0)) and lagged.playing()[2] is True
    assert len(lagged._held) == 1


def test_a_lag_below_one_and_a_version_going_back_are_errors():
    with pytest.raises(ValueError, match="use 1 or more"):
        LaggedWeights(0)
    lagged = LaggedWeights(2)
    lagged.push(3, _state(0.0), False)
    with pytest.raises(ValueError, match="older than the held 3"):
        lagged.push(2, _state(0.0), False)
    assert LaggedWeights(1).current() is None and LaggedWeights(1).playing() is None


def _engine_weights(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.worker.engine.model.state_dict().items()}


def _policy_weights(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.policy.engine_state()[0].items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)


def test_a_run_in_one_process_trains_on_episodes_exactly_lag_versions_old(tmp_path):
    """Staleness 2, four steps: each step's episodes are min(step, 2) versions old, the engine holds the learner's
    weights of two updates before, an evaluation plays the current weights and puts the lagged ones back, and
    icepop logs the gap it corrects."""
    from ctxrl.run import loop
    from ctxrl.run.build import build, close, start_learning
    from ctxrl.run.step import rl_step, sync_engine

    config = load_config(None, BASE + ["distributed.max_staleness=2", "train.steps=4", "algo.offpolicy=icepop"])
    run = build(config, tmp_path)
    try:
        start_learning(run)
        sync_engine(run, 0)
        after: list[dict[str, torch.Tensor]] = [_policy_weights(run)]  # the learner's weights by version
        rows = []
        for step in range(4):
            assert _same(_engine_weights(run), after[max(step - 2, 0)])
            collected = run.collector.collect(step)
            assert {e.policy_version for e in collected.episodes} == {max(step - 2, 0)}
            rows.append(rl_step(run, step))
            after.append(_policy_weights(run))
        assert [r["staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
        assert [r["staleness_mean"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
        assert all(r["stale_dropped"] == 0.0 and r["grad_norm"] > 0 and "offpolicy_masked_frac" in r for r in rows)
        assert not _same(after[2], after[4])  # the learner moved: the lag is visible in the weights
        assert run.worker.policy_version == 2 and _same(_engine_weights(run), after[2])

        seen = []
        original = run.worker.run

        def spy(request, **kwargs):
            seen.append((run.worker.policy_version, _same(_engine_weights(run), after[4])))
            return original(request, **kwargs)

        run.worker.run = spy
        loop.evaluate(run, 4, splits=("heldout",))
        assert seen and all(s == (4, True) for s in seen)  # evaluated on the learner's current weights
        assert run.worker.policy_version == 2 and _same(_engine_weights(run), after[2])  # the lag is back

        sync_engine(run, 4, restored=True)  # a resume: the checkpoint holds no older weights
        assert run.worker.policy_version == 4 and _same(_engine_weights(run), after[4])
    finally:
        close(run)


def test_the_warm_start_weights_replace_version_0_on_the_engine(tmp_path):
    """The initial weights are held as version 0 from the start; a warm start changes them and syncs version 0
    again: the engine must play the warm-started weights, evaluated and trained on (a bug once kept the initial
    ones, since the version had not changed)."""
    from ctxrl.run import loop
    from ctxrl.run.build import build, close
    from ctxrl.run.step import sync_engine

    run = build(load_config(None, BASE + ["distributed.max_staleness=2", "train.steps=1"]), tmp_path)
    try:
        initial = _engine_weights(run)
        with torch.no_grad():
            for p in run.model.parameters():
                p.add_(0.01)  # what a warm start does to the learner's weights
        sync_engine(run, 0)
        assert run.worker.policy_version == 0 and _same(_engine_weights(run), _policy_weights(run))
        assert not _same(_engine_weights(run), initial)
        loop.evaluate(run, 0, splits=("heldout",))  # nothing to swap: the current weights are the played ones
        assert _same(_engine_weights(run), _policy_weights(run))
    finally:
        close(run)


def test_off_policy_gap_grows_with_the_lag(tmp_path):
    """The same seeds at staleness 0 and 2: the behaviour and recomputed log-probs agree on-policy, not when the
    engine is two updates behind."""
    from ctxrl.run.build import build, close, start_learning
    from ctxrl.run.step import rl_step, sync_engine

    gaps = {}
    for lag in (0, 2):
        config = load_config(None, BASE + [f"distributed.max_staleness={lag}", "train.steps=3",
                                           "algo.offpolicy=token_tis"])
        run = build(config, tmp_path / str(lag))
        try:
            start_learning(run)
            sync_engine(run, 0)
            rows = [rl_step(run, s) for s in range(3)]
        finally:
            close(run)
        gaps[lag] = rows[-1]["mismatch_abs_before_update"]
    assert gaps[0] < 1e-4  # (the same weights, the same float32 arithmetic up to batching)
    assert gaps[2] > 100 * max(gaps[0], 1e-6)


@pytest.mark.parametrize("extra, message", [
    (["distributed.max_staleness=1"], "algo.old_logprobs"),
    (["distributed.max_staleness=1", "algo.old_logprobs=recompute", "env.name=kuhn_poker", "lora.rank=4",
      'roles.policies=["player_0=own"]'], "policy of its own"),
])
def test_staleness_in_one_process_that_cannot_work_is_a_config_error(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, extra)
