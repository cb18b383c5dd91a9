"""Self-play and proposer–solver training (issue 37): does playing against itself make the policy better against
opponents it never met?

Per seed, one run of the pipeline (``ctxrl.train.trainer.train``) on a multi-role environment: a warm start on
the environment's scripted matches (``kuhn_poker``: random legal lines, so it teaches the rules and the reply
format, not a strategy), then ``--steps`` RL steps in which the shared policy plays every seat (per-role group
baselines, ``rollout.group_size`` matches per task). Every evaluation plays the held-out split against the
environment's held-out scripted opponents (``roles.eval_opponents``: ``kuhn_poker`` ``random`` and ``nash``;
``propose_solve`` the scripted proposer ``given``, which makes the learner's win rate the solvers' accuracy on
fixed problems), the learner in each role it can take. Printed per run: the held-out win rate against each
opponent after the warm start and after RL, with 95 % Wilson intervals; across seeds, the mean change and its
standard error. For a zero-sum game the checkpoints of each run (``train.checkpoint_every``) then play a round
robin on held-out deals, and ``elo_ratings`` rates them (scripted opponents included, as fixed anchors).

    python experiments/selfplay.py --env kuhn_poker --seed 0 --seed 1 --seed 2 --steps 40 --out runs/selfplay
    python experiments/selfplay.py --env propose_solve --model smollm2-135m-instruct --seed 0 --out runs/ps \\
        model.dtype=bfloat16 train.lr=5e-6
    python experiments/selfplay.py --smoke --out /tmp/selfplay     # seconds, on the CPU
    python experiments/selfplay.py --collect runs/batch/runs/kuhn135-*  # means +- SE over runs of one seed each
    python experiments/selfplay.py --baselines 100     # the scripted players against the evaluation's opponents

``--smoke`` runs one RL step on the random-init tiny model: that it runs end to end, not a figure.
``--collect`` reads the ``selfplay.json`` of runs made one seed per process (``experiments/batch.py``) and prints
the mean change of each held-out figure over them, with its standard error.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

EVAL_OPPONENTS = {"kuhn_poker": ["random", "nash"], "propose_solve": ["given"]}
"""The held-out scripted players each environment's evaluations meet (``roles.eval_opponents``)."""
ENV_SETTINGS = {
    "kuhn_poker": ["env.max_turns=2", "rollout.max_new_tokens=8", "rollout.max_total_tokens=256"],
    "propose_solve": ["env.max_turns=1", "rollout.max_new_tokens=24", "rollout.max_total_tokens=256"],
}
DEFAULTS = ["sft.demos=1000", "sft.epochs=2", "sft.batch_size=32", "sft.lr=1e-3", "rollout.tasks_per_step=16",
            "rollout.group_size=4", "rollout.temperature=1.0", "train.lr=3e-4", "train.mini_batches=1",
            "eval.tasks=100", "run.samples_per_step=1", "run.progress=false", "train.keep_checkpoints=0"]
SMOKE = ["sft.demos=8", "sft.epochs=1", "sft.batch_size=8", "eval.tasks=2", "rollout.tasks_per_step=2",
         "rollout.group_size=2"]
SMOKE_MODEL = "tiny:pretrain_steps=0"


def run_one(env: str, seed: int, model: str, steps: int, overrides: list[str], run_dir: Path) -> dict:
    """Train one seed; the run's summary."""
    from ctxrl.config import load_config
    from ctxrl.train.trainer import train

    every = max(1, steps // 4)
    config = load_config(None, [f"model.name={model}", f"env.name={env}", f"train.steps={steps}",
                                f"run.seed={seed}", f"run.name={env}-s{seed}", f"train.eval_every={every}",
                                f"train.checkpoint_every={every}", *DEFAULTS, *ENV_SETTINGS[env],
                                "roles.eval_opponents=" + json.dumps([f"scripted:{o}" for o in EVAL_OPPONENTS[env]]),
                                *overrides])
    return train(config, run_dir)


def win_rates(run_dir: Path) -> dict[int, dict[str, float]]:
    """The held-out evaluation rows of a run by step (also of a run that did not finish)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {r["step"]: r for r in rows if r.get("phase") == "eval" and r.get("split") == "heldout"}


def opponents(row: dict) -> list[str]:
    return [key.removeprefix("win_rate_vs_") for key in row if key.startswith("win_rate_vs_")]


def mean_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def arena(run_dir: Path, tasks: int, seed: int = 4321) -> dict[str, float]:
    """Elo ratings of a run's step checkpoints and its scripted opponents, from a round robin on held-out deals
    (every pair plays each task once with each of them first to act)."""
    import itertools

    from ctxrl.config import load_config
    from ctxrl.eval.arena import elo_ratings, opponent_name
    from ctxrl.rollout.spec import RolloutRequest, RolloutSpec
    from ctxrl.rollout.worker import RolloutWorker

    config = load_config(run_dir / "config.toml")
    worker = RolloutWorker.from_spec(RolloutSpec.from_config(config))
    players = [f"frozen:{p}" for p in sorted((run_dir / "checkpoints").glob("step-*"))]
    players += list(config.roles.eval_opponents)
    deals = worker.env_cls.sample_tasks("heldout", tasks, seed)
    roles = worker.env_cls.roles
    games = []
    for a, b in itertools.combinations(players, 2):
        if a.startswith("scripted:") and b.startswith("scripted:"):
            continue  # the anchors need no games among themselves
        for first, second in ((a, b), (b, a)):
            episodes = worker.run(RolloutRequest(tasks=deals, seed=seed, phase="eval",
                                                 policies={roles[0]: first, roles[1]: second}))
            for opener, other in zip(episodes[0::2], episodes[1::2]):  # a match's two seats, in seat order
                score = 1.0 if opener.reward > other.reward else 0.5 if opener.reward == other.reward else 0.0
                games.append((opponent_name(first), opponent_name(second), score))
    return elo_ratings(games, prior=1.0)


def baselines(env: str, tasks: int, seed: int = 1234) -> dict[str, dict[str, float]]:
    """What the environment's scripted players score against its evaluation opponents on the held-out tasks an
    evaluation plays (``eval.seed`` 1234), each in every seat in turn: the yardstick of the learner's figures."""
    import asyncio
    import random

    from ctxrl.envs.registry import get_env_class
    from ctxrl.envs.roles import opponents_of
    from ctxrl.types import Message

    cls = get_env_class(env)
    players = opponents_of(cls)
    opponents = EVAL_OPPONENTS[env]
    deals, rng, out = cls.sample_tasks("heldout", tasks, seed), random.Random(seed), {}
    for name, opponent in ((n, o) for n in players for o in opponents):
        wins = chips = seats = 0.0
        for task, learner in ((t, r) for t in deals for r in cls.roles):
            env_ = cls()
            env_.reset(task)
            while True:
                seat = env_.to_act()
                policy = players[name] if seat == learner else players[opponent]
                result = asyncio.run(env_.step(Message("assistant", policy(env_.view(seat), rng))))
                if result.terminated:
                    break
            wins, chips, seats = wins + result.outcome.get(learner, False), chips + result.rewards[learner], seats + 1
        out[f"{name} vs {opponent}"] = {"win_rate": wins / seats, "reward": chips / seats}
        print(f"scripted {name:12s} vs {opponent:8s} win rate {wins / seats:.3f}  reward {chips / seats:+.3f}")
    return out


def report(runs: dict[str, dict], out: Path) -> dict:
    """Print the before/after table per run and the mean change across seeds; returns the figures."""
    figures: dict = {"runs": {}, "mean": {}}
    changes: dict[str, list[float]] = {}
    for name, run_dir in ((n, out / n) for n in runs):
        rows = win_rates(run_dir)
        if len(rows) < 2:
            print(f"{name}: fewer than two held-out evaluations logged")
            continue
        first, last = rows[min(rows)], rows[max(rows)]
        figures["runs"][name] = {"steps": max(rows), "before": first, "after": last}
        for opp in opponents(first):
            b, a = first[f"win_rate_vs_{opp}"], last[f"win_rate_vs_{opp}"]
            print(f"{name:22s} vs {opp:10s} win rate {b:.3f} [{first[f'win_low_vs_{opp}']:.3f}, "
                  f"{first[f'win_high_vs_{opp}']:.3f}] -> {a:.3f} [{last[f'win_low_vs_{opp}']:.3f}, "
                  f"{last[f'win_high_vs_{opp}']:.3f}]  reward {first[f'reward_vs_{opp}']:+.3f} -> "
                  f"{last[f'reward_vs_{opp}']:+.3f}  ({int(last[f'seats_vs_{opp}'])} seats)")
            changes.setdefault(opp, []).append(a - b)
        curve = " ".join(f"{step}:{row.get('success', 0):.2f}" for step, row in sorted(rows.items()))
        print(f"{name:22s} held-out success over all opponents by step: {curve}")
    for opp, values in changes.items():
        mean, se = mean_se(values)
        figures["mean"][opp] = {"change": mean, "se": se, "seeds": len(values)}
        print(f"mean change of the held-out win rate vs {opp} over {len(values)} seeds: {mean:+.3f} ± {se:.3f} (SE)")
    return figures


def collect(directories: list[Path]) -> dict:
    """The mean change (after RL minus after the warm start) of each opponent's held-out win rate and reward over
    the runs in ``directories`` (each holding a ``selfplay.json``), with standard errors; printed and returned."""
    changes: dict[str, list[float]] = {}
    for directory in directories:
        path = directory / "selfplay.json"
        if not path.exists():
            raise SystemExit(f"{path} does not exist: --collect takes directories that experiments/selfplay.py wrote")
        for run in json.loads(path.read_text())["runs"].values():
            before, after = run["before"], run["after"]
            for opp in opponents(before):
                for figure in ("win_rate", "reward"):
                    key = f"{figure}_vs_{opp}"
                    changes.setdefault(key, []).append(after[key] - before[key])
    out = {}
    for key, values in sorted(changes.items()):
        mean, se = mean_se(values)
        out[key] = {"change": mean, "se": se, "runs": len(values)}
        print(f"{key:24s} change {mean:+.3f} ± {se:.3f} (SE over {len(values)} runs)")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="kuhn_poker", choices=sorted(ENV_SETTINGS))  # (multi-role environments)
    parser.add_argument("--seed", action="append", type=int, help="run.seed (repeatable; default 0)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--arena-tasks", type=int, default=50, help="held-out deals per pairing of the Elo round robin")
    parser.add_argument("--out", default="runs/selfplay", help="parent of the run directories")
    parser.add_argument("--smoke", action="store_true", help="one step of the random-init tiny model (a test)")
    parser.add_argument("--collect", nargs="+", type=Path, metavar="DIR", help="summarise runs already made")
    parser.add_argument("--baselines", type=int, metavar="TASKS", help="only the scripted players' figures (zero-sum)")
    parser.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    args = parser.parse_args(argv)
    if args.collect:
        return collect(args.collect)
    if args.baselines:
        return baselines(args.env, args.baselines)
    import torch

    torch.set_num_threads(1)  # the tiny model's matrices gain nothing from threads, and a shared CPU loses much
    out, overrides = Path(args.out), list(args.overrides)
    model, steps, arena_tasks = args.model, args.steps, args.arena_tasks
    if args.smoke:
        model, steps, arena_tasks, overrides = SMOKE_MODEL, 1, 2, SMOKE + overrides
    from ctxrl.envs.hooks import flag
    from ctxrl.envs.registry import get_env_class
    from ctxrl.train.tiny import ensure_model

    ensure_model(model)
    started, runs = time.perf_counter(), {}
    for seed in args.seed or [0]:
        name = f"{args.env}-s{seed}"
        runs[name] = run_one(args.env, seed, model, steps, overrides, out / name)
    print(f"model {model}, {steps} RL steps, overrides {overrides or 'none'}, {time.perf_counter() - started:.0f}s")
    figures = report(runs, out)
    if flag(get_env_class(args.env), "zero_sum"):
        figures["elo"] = {name: arena(out / name, arena_tasks) for name in runs}
        for name, ratings in figures["elo"].items():
            print(f"{name} Elo: " + "  ".join(f"{p} {r:.0f}" for p, r in sorted(ratings.items())))
    figures["seconds"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / "selfplay.json").write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
