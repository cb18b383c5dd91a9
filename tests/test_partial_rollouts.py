"""Partial rollouts (``ctxrl.rollout.partial``, ``ctxrl.run.partial``): an episode cut at a weight update goes on with
the new weights, its early tokens keeping the log-probs and version that sampled them; groups train whole; nothing
is lost or played twice across steps; a resume starts afresh; what cannot work is a config error."""

from __future__ import annotations

import asyncio
import copy
import logging
import re

import pytest
import torch
from conftest import TINY

from ctxrl.config import load_config
from ctxrl.engine.base import Completion
from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.envs.registry import register
from ctxrl.errors import ConfigError
from ctxrl.rollout.spec import RolloutRequest, RolloutSpec
from ctxrl.rollout.worker import RolloutWorker
from ctxrl.seeds import episode_seed
from ctxrl.types import Message, StepResult, Task, turn_versions

PARTIAL = ["rollout.partial_step_tokens=1", "algo.old_logprobs=recompute", "rollout.episode_timeout_s=0"]


@register("countdown_for_test")
class Countdown(CalculatorEnv):
    """Calculator tasks that take ``task.context["turns"]`` turns whatever the policy writes (else ``1 + seed % 3``:
    the members of a group differ), then pay ``seed % 2``. Counts the environments it opens and closes."""

    name = "countdown_for_test"
    opened = closed = 0

    def reset(self, task, *, seed=None):
        type(self).opened += 1
        self.left = int(task.context.get("turns", 1 + seed % 3))
        self.seed = seed
        return super().reset(task, seed=seed)

    async def step(self, message):
        self.left -= 1
        if self.left <= 0:
            return StepResult([], reward=float(self.seed % 2), terminated=True)
        return StepResult([Message("user", "go on")])

    def close(self):
        type(self).closed += 1


class Versioned:
    """Answers every turn with the same ids, stamped with its version; each token's log-prob is ``-(version + 1) / 10``
    (``by_version``) or ``-0.5``. ``load_weights`` only moves the version."""

    def __init__(self, renderer, *, by_version: bool = True) -> None:
        self.ids, self.by_version, self.version = renderer.assistant_ids("ok"), by_version, 0

    @property
    def policy_version(self) -> int:
        return self.version

    def load_weights(self, state, *, version: int, partial: bool = False) -> None:
        self.version = version

    async def generate(self, prompt_ids, params):
        await asyncio.sleep(0)  # (as an engine does: the other episodes ask meanwhile)
        logprob = -(self.version + 1) / 10 if self.by_version else -0.5
        return Completion(list(self.ids), [logprob] * len(self.ids), "stop", self.version)


def _worker(renderer, engine, *extra: str) -> RolloutWorker:
    config = load_config(None, ["model.device=cpu", "env.name=countdown_for_test", "env.max_turns=8",
                                "rollout.episode_timeout_s=0", *extra])
    return RolloutWorker(RolloutSpec.from_config(config), engine, renderer, Countdown)


def _task(name: str, turns: int) -> Task:
    return Task(id=name, prompt=f"What is 1 plus {turns}?", answer=str(1 + turns), context={"turns": turns})


def _request(step: int, *tasks: Task, group_size: int = 2) -> RolloutRequest:
    return RolloutRequest(tasks=list(tasks), group_size=group_size, seed=7, step=step, group_offset=10 * step)


def test_an_episode_cut_at_an_update_goes_on_with_the_new_weights(renderer):
    """A budget of one token a step: the 3-turn group plays a turn a step, each on the weights of its step; its early
    tokens keep the log-probs that sampled them, its late ones carry the new version, and it trains whole at the end;
    a 1-turn group started each step finishes in it."""
    engine = Versioned(renderer)
    worker = _worker(renderer, engine)
    try:
        played = [worker.play_partial(_request(0, _task("short", 1), _task("long", 3)), 1)]
        for step in (1, 2):
            engine.load_weights({}, version=step)  # (the update between the steps)
            played.append(worker.play_partial(_request(step, _task(f"short{step}", 1)), 1))
    finally:
        worker.close()
    assert [[e.task.id for e in p.episodes] for p in played] == [
        ["short"] * 2, ["short1"] * 2, ["long"] * 2 + ["short2"] * 2]
    assert [(p.started, p.carried_in, p.carried_trained, p.in_flight, p.rounds) for p in played] == [
        (4, 0, 0, 2, 1), (2, 2, 0, 2, 1), (2, 2, 2, 0, 1)]
    n = len(engine.ids)
    for long in played[2].episodes[:2]:
        assert long.group_id == 1 and long.policy_version == 0  # (the version it started with)
        assert [t.policy_version for t in long.turns] == [0, 1, 2]
        assert turn_versions(long) == [0] * n + [1] * n + [2] * n
        sampled = [lp for lp, m in zip(long.behavior_logprobs, long.loss_mask) if m]
        assert sampled == pytest.approx([-0.1] * n + [-0.2] * n + [-0.3] * n)
        assert long.truncation is None and long.reward == float(long.turns[-1].reward)

    from ctxrl.run.partial import staleness_figures

    figures = staleness_figures(played[2].episodes, current=2)
    # the long episodes: tokens 2, 1 and 0 versions old (max 2); the short ones of this step: 0
    assert figures == {"staleness_mean": 1.0, "staleness_max": 2.0,
                       "token_staleness_mean": pytest.approx((2 * 3 * n) / (2 * 3 * n + 2 * n)),
                       "token_staleness_max": 2.0}


def test_a_cut_episode_is_the_episode_played_without_a_cut_but_for_its_versions(renderer):
    """The same request with a budget it never reaches (one step, as a waiting step plays it) and cut at every turn
    over three versions: the same ids, masks, log-probs, messages, rewards and training rows; only the turns'
    versions differ. Without a cut the pool plays exactly ``worker.run``'s episodes."""
    from ctxrl.algo.estimators import get_estimator
    from ctxrl.sections import AlgoConfig

    request = _request(0, _task("long", 3), _task("long2", 2))
    waiting = _worker(renderer, Versioned(renderer, by_version=False)).run(request)
    whole = _worker(renderer, Versioned(renderer, by_version=False))
    uncut = whole.play_partial(request, 10**9).episodes
    whole.close()
    engine = Versioned(renderer, by_version=False)
    worker = _worker(renderer, engine)
    first = worker.play_partial(request, 1)  # (no group finishes in the first round: long2 in the second)
    assert first.rounds == 2 and first.in_flight == 2
    cut = first.episodes
    engine.load_weights({}, version=1)
    cut += worker.play_partial(_request(1), 1).episodes
    worker.close()
    assert [e.task.id for e in cut] == ["long2"] * 2 + ["long"] * 2

    def fields(episode):
        d = episode.to_dict()
        d.pop("info")  # (seconds)
        for turn in d["turns"]:
            turn.pop("policy_version")
        return d

    by_task = {(e.task.id, i % 2): e for i, e in enumerate(cut)}
    assert [fields(e) for e in uncut] == [fields(e) for e in waiting]
    assert [fields(by_task[(e.task.id, i % 2)]) for i, e in enumerate(uncut)] == [fields(e) for e in uncut]
    assert {t.policy_version for e in uncut for t in e.turns} == {0}
    assert [t.policy_version for t in by_task[("long", 0)].turns] == [0, 0, 1]

    estimator = get_estimator("grpo")(AlgoConfig())
    rows = [r.to_dict() for rs in estimator.estimate(uncut) for r in rs]
    ordered = [by_task[(e.task.id, i % 2)] for i, e in enumerate(uncut)]
    assert [r.to_dict() for rs in estimator.estimate(ordered) for r in rs] == rows


def test_a_group_trains_whole_once_its_last_member_finishes(renderer):
    """Members of one group that take 1 and 2 turns: the first one's episode is held, not trained, until the second
    finishes in the next step; the whole group trains then."""
    seed = next(s for s in range(100) if (episode_seed(s, 0, 0) % 3, episode_seed(s, 0, 1) % 3) == (0, 1))
    ragged = Task(id="ragged", prompt="What is 2 plus 2?", answer="4")  # turns 1 + seed % 3: 1 and 2
    engine = Versioned(renderer)
    worker = _worker(renderer, engine)
    try:
        first = worker.play_partial(RolloutRequest(tasks=[ragged, _task("short", 1)], group_size=2, seed=seed), 1)
        assert [e.task.id for e in first.episodes] == ["short", "short"]
        assert (first.in_flight, first.groups_in_flight) == (2, 1)  # the finished member is held with its group
        engine.load_weights({}, version=1)
        second = worker.play_partial(RolloutRequest(tasks=[], group_size=2, seed=seed, step=1), 1)
    finally:
        worker.close()
    assert [e.task.id for e in second.episodes] == ["ragged", "ragged"]
    assert [len(e.turns) for e in second.episodes] == [1, 2]
    assert [[t.policy_version for t in e.turns] for e in second.episodes] == [[0], [0, 1]]
    assert second.carried_trained == 2 and second.in_flight == 0


def test_nothing_is_lost_or_played_twice_across_steps(renderer):
    """Six steps of the Collector, groups whose members take 1 to 3 turns, a budget of two turns a step: every group
    trains once, whole, in one step; what was started is what was trained plus what is in flight; the groups in
    flight never pass tasks_per_step; closing the worker drops (and closes) the episodes still in flight."""
    from ctxrl.run.collect import Collector
    from ctxrl.seeds import Seeds
    from ctxrl.tasks.curriculum import make_curriculum

    engine = Versioned(renderer)
    turn = len(engine.ids)
    config = load_config(None, ["model.device=cpu", "env.name=countdown_for_test", "rollout.tasks_per_step=3",
                                "rollout.group_size=2", *PARTIAL, f"rollout.partial_step_tokens={2 * turn}"])
    worker = RolloutWorker(RolloutSpec.from_config(config), engine, renderer, Countdown)
    collector = Collector(config, worker, Countdown, make_curriculum(config.curriculum), Seeds(0))
    opened, closed = Countdown.opened, Countdown.closed
    trained_in: dict[int, int] = {}  # group id -> the step it trained in
    started, rows = 0, []
    for step in range(6):
        collected = collector.collect(step)
        rows.append(collected.metrics)
        started += collected.metrics["partial_started"]
        assert collected.episodes == collected.train
        assert collected.metrics["partial_carried_in"] + collected.metrics["partial_started"] <= 3 * 2
        groups = [e.group_id for e in collected.episodes]
        assert all(groups.count(g) == 2 and g not in trained_in for g in groups)  # whole, and never again
        trained_in.update({g: step for g in groups})
        engine.load_weights({}, version=step + 1)
    assert started == 2 * len(trained_in) + rows[-1]["partial_in_flight"]
    assert sum(r["partial_carried_trained"] for r in rows) > 0 and max(r["staleness_max"] for r in rows) > 0
    assert all(r["partial_in_flight"] == r["partial_groups_in_flight"] * 2 for r in rows)
    worker.close()
    assert Countdown.opened - opened == Countdown.closed - closed == started  # (the dropped ones closed too)
    assert worker.partial.close() == 0


def test_closing_drops_the_episodes_in_flight_and_logs_how_many(renderer, caplog):
    worker = _worker(renderer, Versioned(renderer))
    worker.play_partial(_request(0, _task("short", 1), _task("long", 3)), 1)
    with caplog.at_level(logging.WARNING, logger="ctxrl.rollout.partial"):
        assert worker.partial.close() == 2
    assert "2 episodes in flight were dropped" in caplog.text


RANDOM_TURNS = ("rollout.temperature=1.0", "rollout.max_new_tokens=24",
                'rollout.stop_strings=[" ", "a", "e", "o"]')  # (so that the random tiny model's turns end early)


def test_uncut_the_pool_plays_a_waiting_steps_episodes_on_the_hf_engine(model, tokenizer, renderer):
    """The tiny model sampling: with a budget it never reaches, the pool's episodes are ``worker.run``'s, bit for bit
    (the same seeds, the same batches)."""
    from ctxrl.engine.hf import HFEngine

    request = _request(0, _task("long", 3), _task("long2", 2), _task("short", 1))
    engines = [HFEngine(model, pad_token_id=tokenizer.pad_token_id, decode=renderer.decode) for _ in range(2)]
    worker = _worker(renderer, engines[1], *RANDOM_TURNS)
    try:
        waiting = _worker(renderer, engines[0], *RANDOM_TURNS).run(request)
        uncut = worker.play_partial(request, 10**9).episodes
    finally:
        worker.close()
        for engine in engines:
            engine.close()
    assert [len(e.turns) for e in uncut] == [3, 3, 2, 2, 1, 1]
    assert [(e.input_ids, e.loss_mask, e.behavior_logprobs) for e in uncut] == [
        (e.input_ids, e.loss_mask, e.behavior_logprobs) for e in waiting]


def test_the_learner_sees_the_gap_exactly_on_the_tokens_older_weights_sampled(model, tokenizer, renderer):
    """The tiny model in the HF engine, an episode cut after its first turn and continued on perturbed weights (an
    evaluation played between the steps): under the new weights (the learner's after the update), the tokens sampled
    after the cut have the log-probs they were sampled with, and only the earlier ones differ, which is what
    token_tis then weights."""
    from ctxrl.algo.offpolicy import token_tis
    from ctxrl.engine.hf import HFEngine
    from ctxrl.learner.logprobs import token_logprobs

    module = copy.deepcopy(model)
    engine = HFEngine(module, pad_token_id=tokenizer.pad_token_id, decode=renderer.decode)
    worker = _worker(renderer, engine, *RANDOM_TURNS)
    try:
        first = worker.play_partial(_request(0, _task("long", 2), _task("short", 1), group_size=1), 1)
        assert [e.task.id for e in first.episodes] == ["short"]
        with torch.no_grad():
            new = {k: v + 0.05 * torch.randn_like(v) for k, v in module.state_dict().items()}
        engine.load_weights(new, version=1)
        worker.run(RolloutRequest(tasks=[_task("eval", 1)], seed=3, phase="eval"))  # (in a loop of its own)
        (episode,) = worker.play_partial(_request(1), 1).episodes
    finally:
        worker.close()
        engine.close()
    assert [t.policy_version for t in episode.turns] == [0, 1]
    ids = torch.tensor([episode.input_ids])
    with torch.no_grad():
        learner = token_logprobs(module, ids, torch.ones_like(ids), temperature=1.0)[0]
    mask = torch.tensor(episode.loss_mask[1:], dtype=torch.bool)
    behaviour = torch.tensor(episode.behavior_logprobs[1:])
    version = torch.tensor([episode.turns[t].policy_version if t >= 0 else -1 for t in episode.turn_index[1:]])
    gap = (learner - behaviour).abs()
    assert gap[mask & (version == 1)].max() < 1e-4  # sampled by these weights: on-policy
    assert gap[mask & (version == 0)].min() > 1e-3  # sampled before the update: off-policy
    weights = token_tis(learner[None], behaviour[None], mask[None].float(), cap=2.0).weights[0]
    assert torch.allclose(weights[mask & (version == 1)], torch.ones(1), atol=1e-4)
    assert (weights[mask & (version == 0)] - 1).abs().min() > 1e-3


def _trainer_config(*extra: str):
    return load_config(None, [f"model.name={TINY}", "model.device=cpu", "sft.enabled=false", "run.progress=false",
                              "env.name=countdown_for_test", "rollout.tasks_per_step=2", "rollout.group_size=2",
                              "eval.tasks=2", "train.lr=1e-3", "train.steps=4", *PARTIAL, *extra])


def test_training_steps_log_the_pool_and_a_resume_starts_fresh_groups(tmp_path, renderer, caplog):
    """Three RL steps of a built run: the rows log the pool and the staleness; a checkpoint after step 2 keeps no
    episode in flight, so the resumed run's step 3 starts tasks_per_step fresh groups and says why."""
    from ctxrl.run import checkpoint
    from ctxrl.run.build import build, close, start_learning
    from ctxrl.run.step import rl_step, sync_engine

    run = build(_trainer_config(), tmp_path)
    try:
        run.worker.engine = Versioned(renderer)
        start_learning(run)
        sync_engine(run, 0)
        rows = [rl_step(run, s) for s in range(2)]
        checkpoint.save(run, 1)
        going_on = rl_step(run, 2)
    finally:
        close(run)
    assert all(r["trained_episodes"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert rows[1]["partial_in_flight"] > 0 and {"staleness_mean", "token_staleness_max"} <= rows[1].keys()
    assert going_on["partial_carried_in"] == rows[1]["partial_in_flight"]
    resumed = build(_trainer_config(), tmp_path)
    try:
        resumed.worker.engine = Versioned(renderer)
        start_learning(resumed)
        assert checkpoint.resume(resumed) == 1 and resumed.worker.policy_version == 2
        with caplog.at_level(logging.WARNING, logger="ctxrl.run.partial"):
            row = rl_step(resumed, 2)
    finally:
        close(resumed)
    assert "step 3 starts with no episode in flight" in caplog.text
    assert row["partial_carried_in"] == 0 and row["partial_started"] == 2 * 2


@pytest.mark.parametrize("extra, message", [
    (["algo.old_logprobs=behaviour"], "algo.old_logprobs"),
    (["rollout.episode_timeout_s=300"], "rollout.episode_timeout_s=0"),
    (["distributed.backend=ray"], "distributed.backend=none"),
    (["distributed.max_staleness=1"], "set one of them to 0"),
    (["algo.dynamic_sampling=true"], "dynamic_sampling"),
    (["meta.num_attempts=2", "algo.advantage=meta"], "trials"),
    (['reward.judge.target="http://127.0.0.1:1/v1"', "reward.judge.model=m"], "reward.judge"),
    (["env.name=kuhn_poker"], "several roles"),
])
def test_partial_rollouts_that_cannot_work_are_config_errors(extra, message):
    with pytest.raises(ConfigError, match=r"rollout\.partial_step_tokens.*" + re.escape(message)):
        load_config(None, [*PARTIAL, *extra])


def test_a_worker_refuses_what_its_pool_cannot_play(renderer):
    with pytest.raises(ConfigError, match="episode deadline"):
        RolloutWorker(RolloutSpec.from_config(load_config(None, ["model.device=cpu"])), Versioned(renderer), renderer,
                      Countdown).play_partial(_request(0, _task("short", 1)), 1)
