"""Several agents in one episode, trained and evaluated (docs/multi-agent.md): a pinned frozen role that is played
but never updated, rae's baselines across a resume, evaluation against held-out opponents, ``check-env`` and
``ctxrl envs`` on the new environments, and the configuration's refusals."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import TINY
from test_roles import SayGame  # noqa: F401 - registers say_game_for_test, whose every reply is a move

from ctxrl.config import ConfigError, load_config
from ctxrl.engine.hf import HFEngine
from ctxrl.envs.check import check_env
from ctxrl.envs.kuhn_poker import KuhnPokerEnv, payoff
from ctxrl.envs.propose_solve import ProposeSolveEnv, check_problem, edge_reward
from ctxrl.errors import CheckpointError
from ctxrl.eval.arena import elo_ratings, wilson_interval
from ctxrl.eval.evaluate import evaluate_split
from ctxrl.rollout.spec import RolloutSpec
from ctxrl.rollout.worker import RolloutWorker
from ctxrl.run.build import build, start_learning
from ctxrl.run.step import rl_step
from ctxrl.train import checkpoint

SMALL = [f"model.name={TINY}", "sft.enabled=false", "rollout.tasks_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=6", "rollout.max_total_tokens=160", "env.max_turns=1", "eval.tasks=2",
         "run.samples_per_step=0", "run.progress=false"]


def test_a_frozen_role_is_played_but_never_updated_and_rae_resumes_exactly(tmp_path, model, tokenizer):
    frozen_dir = tmp_path / "frozen"
    model.save_pretrained(frozen_dir)
    tokenizer.save_pretrained(frozen_dir)
    config = load_config(None, [*SMALL, "env.name=say_game_for_test", "algo.advantage=rae", "algo.rae.alpha=0.5",
                                f'roles.policies=["player_1=frozen:{frozen_dir}"]', "train.steps=2", "train.lr=0.05"])
    run = build(config, tmp_path / "run")
    start_learning(run)
    start = {k: v.clone() for k, v in run.model.state_dict().items()}
    rows = [rl_step(run, 0), rl_step(run, 1)]
    frozen = run.worker.runner.frozen[str(frozen_dir)]
    assert frozen is not run.worker.engine and frozen.policy_version == 0 and run.worker.policy_version == 2
    on_disk = type(model).from_pretrained(frozen_dir).state_dict()
    assert all(torch.equal(v, on_disk[k]) for k, v in frozen.model.state_dict().items())  # never sent weights
    assert any(not torch.equal(v, start[k]) for k, v in run.model.state_dict().items())  # the learner moved
    assert [r["trained_episodes"] for r in rows] == [4, 4]  # player_0's four seats; player_1's never
    played = run.collector.rollout_round(1, 0)
    assert {(e.role, e.info["policy"], bool(any(e.loss_mask))) for e in played} == {
        ("player_0", "shared", True), ("player_1", f"frozen:{frozen_dir}", True)}
    baselines = dict(run.estimator.baselines)
    assert set(baselines) == {"player_0"} and baselines["player_0"] != 0.0
    checkpoint.save(run, 2)
    resumed = build(config, tmp_path / "run")
    start_learning(resumed)
    assert resumed.estimator.baselines == {} and checkpoint.resume(resumed) == 2
    assert resumed.estimator.baselines == baselines


def test_evaluation_against_held_out_opponents(model, renderer):
    engine = HFEngine(model, pad_token_id=renderer.tokenizer.pad_token_id)
    config = load_config(None, [*SMALL, "env.name=kuhn_poker", "env.max_turns=2",
                                'roles.eval_opponents=["scripted:random", "scripted:nash"]'])
    worker = RolloutWorker(RolloutSpec.from_config(config), engine, renderer)
    summary, episodes = evaluate_split(worker, "heldout", 3, seed=1)
    assert len(episodes) == 3 * 2 * 2 * 2  # tasks x the learner in each role x two seats x two opponents
    for name in ("random", "nash"):
        assert summary[f"seats_vs_{name}"] == 6.0  # three deals with the learner first, three with it second
        low, high = wilson_interval(summary[f"win_rate_vs_{name}"] * 6, 6)
        assert (summary[f"win_low_vs_{name}"], summary[f"win_high_vs_{name}"]) == pytest.approx((low, high))
    learner = [e for e in episodes if e.info["policy"] == "shared"]
    assert len(learner) == 12 and {e.role for e in learner} == {"player_0", "player_1"}
    assert summary["success"] == sum(e.success for e in learner) / 12
    config = load_config(None, [*SMALL, "env.name=propose_solve", 'roles.eval_opponents=["scripted:given"]'])
    worker = RolloutWorker(RolloutSpec.from_config(config), engine, renderer)
    summary, episodes = evaluate_split(worker, "heldout", 2, seed=1)
    assert summary["seats_vs_given"] == 8.0  # the scripted proposer cannot solve: the learner only solves
    assert {(e.role, e.info["policy"]) for e in episodes} == {("proposer", "scripted:given"), ("solver", "shared")}


def test_wilson_interval_and_elo_by_hand():
    # 8 of 10, z = 1.96: centre (0.8 + 1.96^2/20) / (1 + 1.96^2/10), half-width 1.96 sqrt(0.016 + 1.96^2/400) / same
    z = 1.959963984540054
    centre, half = (0.8 + z * z / 20) / (1 + z * z / 10), z * math.sqrt(0.016 + z * z / 400) / (1 + z * z / 10)
    assert wilson_interval(8, 10) == pytest.approx((centre - half, centre + half))
    assert wilson_interval(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0) and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    ratings = elo_ratings([("a", "b", 1.0)] * 3 + [("a", "b", 0.0)])
    assert ratings["a"] - ratings["b"] == pytest.approx(400 * math.log10(3), abs=1e-6)  # odds 3:1
    assert (ratings["a"] + ratings["b"]) / 2 == pytest.approx(1000.0)
    chain = elo_ratings([("a", "b", 0.75), ("b", "c", 0.75), ("a", "c", 0.9)], prior=0.0)
    assert chain["a"] > chain["b"] > chain["c"]
    assert elo_ratings([("a", "b", 1.0)], prior=1.0)["a"] - 1000 == pytest.approx(200 * math.log10(3), abs=1e-6)
    with pytest.raises(ValueError, match="players must differ"):
        elo_ratings([("a", "a", 1.0)])


def test_check_env_passes_the_new_environments_and_names_what_is_wrong(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ctxrl", "check-env", "kuhn_poker", "--tasks", "4", "--json"],
                          capture_output=True, text=True, cwd=tmp_path)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and result["ok"] and result["features"]["scripted opponents (opponents)"], proc
    assert check_env(ProposeSolveEnv) == [] and check_env(KuhnPokerEnv, seed=3) == []

    class Generous(KuhnPokerEnv):  # pays the winner of a showdown one chip too many
        async def step(self, message):
            result = await super().step(message)
            result.rewards = {s: r + (1.0 if r > 1 else 0.0) for s, r in result.rewards.items()}
            return result

    class Lonely(KuhnPokerEnv):
        def reset(self, task, *, seed=None):
            return {"player_0": super().reset(task, seed=seed)["player_0"]}

    class Ungraded(KuhnPokerEnv):
        gold_rewards = None

    assert any("differ from gold_rewards" in p or "sum to" in p for p in check_env(Generous, n_tasks=8))
    assert any("seats the roles ['player_0']" in p for p in check_env(Lonely, n_tasks=2))
    assert any("no gold_rewards" in p for p in check_env(Ungraded, n_tasks=2))


def test_the_new_environments_rules_by_hand():
    assert payoff([1, 3], ["check", "check"]) == (-1.0, 1.0) and payoff([3, 1], ["bet", "call"]) == (2.0, -2.0)
    assert payoff([1, 3], ["bet", "fold"]) == (1.0, -1.0) and payoff([3, 1], ["check", "bet", "fold"]) == (-1.0, 1.0)
    assert [edge_reward(k, 4) for k in range(5)] == [0.0, 0.5, 1.0, 0.5, 0.0]
    assert check_problem("<problem>12 + 7*3</problem>", 2, 2) == ("12 + 7 * 3", "33")
    assert check_problem("<problem>123 + 4</problem>", 2, 2)[0] is None  # too many digits
    assert check_problem("<problem>1 + 2 + 3 + 4</problem>", 2, 2)[0] is None  # too many operations
    assert check_problem("12 + 7", 2, 2) == (None, "no <problem>...</problem>")
    assert ProposeSolveEnv.gold_rewards(ProposeSolveEnv.sample_tasks("train", 1, 0)[0])["proposer"] == 0.0


def test_envs_lists_each_environments_roles():
    from ctxrl.cli import env_listing

    lines = env_listing(80)
    assert "kuhn_poker (tools: none; roles: player_0, player_1)" in lines
    assert "propose_solve (tools: none; roles: proposer, solver)" in lines
    assert "calculator (tools: calculator; roles: agent)" in lines


@pytest.mark.parametrize(("overrides", "message"), [
    (["roles.rewards=team"], "has one role: leave"),
    (["env.name=kuhn_poker", 'roles.policies=["dealer=shared"]'], "ROLE one of player_0, player_1"),
    (["env.name=kuhn_poker", 'roles.policies=["player_0=own"]'], "needs lora.rank > 0"),
    (["env.name=kuhn_poker", 'roles.policies=["player_0=mine"]'], "must be shared, own"),
    (["env.name=kuhn_poker", 'roles.policies=["player_0=scripted:shark"]'], "no scripted player 'shark'"),
    (["env.name=kuhn_poker", 'roles.policies=["player_0=frozen:/no/such/dir"]'], "is not a directory"),
    (["env.name=kuhn_poker", 'roles.policies=["player_0=scripted:nash", "player_1=scripted:random"]'],
     "pins every role"),
    (["env.name=kuhn_poker", 'roles.eval_opponents=["shared"]'], "the trained policies are the learner"),
    (["env.name=kuhn_poker", "meta.num_attempts=2", "algo.advantage=meta"], "trials of attempts"),
    (["env.name=kuhn_poker", 'roles.policies=["player_1=scripted:nash"]', "context.manager=summarize",
      "context.max_context_tokens=200"], "cannot answer"),
])
def test_the_configuration_refuses_what_cannot_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_roles_with_adapters_of_their_own_train_apart_and_resume_exactly(tmp_path):
    """player_1 plays a LoRA adapter of its own (roles.policies player_1=own) beside the shared one on one base:
    each adapter is trained by its own optimiser on its own seats only, and two steps with a checkpoint and a
    resume between them end exactly where two uninterrupted steps do, both adapters and both optimisers."""
    from ctxrl.models.lora import adapter_parameters

    config = load_config(None, [*SMALL, "env.name=say_game_for_test", "lora.rank=4", "train.steps=2",
                                'roles.policies=["player_1=own"]', "train.lr=0.05", "lora.export_merged=false"])
    straight = build(config, tmp_path / "straight")
    start_learning(straight)
    start = {n: p.detach().clone() for n, p in straight.model.named_parameters() if "lora_B" in n}
    rows = [rl_step(straight, 0), rl_step(straight, 1)]
    assert all("loss_player_1" in row and "loss" in row for row in rows)  # each policy's own update
    shared, own = (adapter_parameters(straight.model, a) for a in ("default", "player_1"))
    assert any(not torch.equal(p, start[n]) for n, p in shared.items() if n in start)
    assert any(not torch.equal(p, start[n]) for n, p in own.items() if n in start)
    optimizers = {"default": straight.learner.optimizer, "player_1": straight.own.learners["player_1"].optimizer}
    held = {a: {id(p) for g in o.param_groups for p in g["params"]} for a, o in optimizers.items()}
    assert held["default"] == {id(p) for p in shared.values()} and held["player_1"] == {id(p) for p in own.values()}
    engine = straight.worker.role_engines["player_1"]
    assert engine is not straight.worker.engine and engine.policy_version == 2
    assert all(torch.equal(dict(engine.model.named_parameters())[n], p) for n, p in own.items())

    stopped = build(config, tmp_path / "stopped")
    start_learning(stopped)
    rl_step(stopped, 0)
    stopped.own.learners["player_1"].skipped_updates = 2  # (a role's own count, resumed with it)
    path = checkpoint.save(stopped, 1)
    assert (path / "player_1" / "adapter_model.safetensors").exists()
    resumed = build(config, tmp_path / "stopped")
    start_learning(resumed)
    assert checkpoint.resume(resumed) == 1
    assert resumed.own.learners["player_1"].skipped_updates == 2 and resumed.learner.skipped_updates == 0
    rl_step(resumed, 1)
    for adapter in ("default", "player_1"):
        mine = adapter_parameters(resumed.model, adapter)
        assert all(torch.equal(p, mine[n]) for n, p in adapter_parameters(straight.model, adapter).items()), adapter
    for learner, again in ((straight.learner, resumed.learner),
                           (straight.own.learners["player_1"], resumed.own.learners["player_1"])):
        a, b = learner.optimizer.state_dict()["state"], again.optimizer.state_dict()["state"]
        assert a.keys() == b.keys() and all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in a)
    with torch.no_grad():  # a role's adapter gone non-finite is never saved, as the shared policy's is not
        next(iter(own.values())).fill_(float("nan"))
    with pytest.raises(CheckpointError, match="player_1"):
        checkpoint.save(straight, 3)


def test_pinned_seats_are_never_dropped_as_stale_in_asynchronous_rounds():
    """A scripted or frozen seat is played by a policy that never moves (policy_version 0 forever): an asynchronous
    round keeps it whatever the learner's version, and leaves it out of the staleness figures."""
    from types import SimpleNamespace

    from ctxrl.config import RewardConfig
    from ctxrl.judge.spec import JudgeSettings
    from ctxrl.train.collect import Collector
    from ctxrl.types import Episode, Task

    def seat(version: int, trains: bool) -> Episode:
        e = Episode(task=Task(id="t", prompt="p", answer="a"), policy_version=version)
        if not trains:
            e.info["trains"] = False
        return e

    played = [seat(5, True), seat(3, True), seat(0, False)]
    worker = SimpleNamespace(policy_version=5, submit=lambda request: request, collect=lambda submitted: played)
    config = SimpleNamespace(train=SimpleNamespace(steps=1), distributed=SimpleNamespace(max_staleness=1),
                             reward=RewardConfig(), rollout=SimpleNamespace(max_total_tokens=64),
                             settings_of=lambda section, name: JudgeSettings())  # ([reward.judge]: no judge)
    fake = SimpleNamespace(_prefetched=None, worker=worker, config=config, rollout_request=lambda step, r: None)
    collected = Collector.asynchronous_round(fake, 0)
    assert collected.episodes == [played[0], played[2]]  # the two-versions-old trained seat goes; the pinned stays
    assert collected.metrics == {"staleness_mean": 1.0, "staleness_max": 2.0, "stale_dropped": 1.0}
