"""Learning across episodes: meta-RL with reflection vs single-episode RL, and annealed demonstrations.

Two experiments, one command each (results in ``--out``: ``summary.json``, ``tables.md``, a PNG):

    python experiments/meta.py reflection                          # minesweeper, tiny model, CPU
    python experiments/meta.py reflection --env bandit
    python experiments/meta.py reflection --env codebreak --model tiny:envs=calculator+codebreak
    python experiments/meta.py demos                               # python_math, no warm start
    python experiments/meta.py reflection --model Qwen/Qwen2.5-0.5B-Instruct --steps 100 model.dtype=bfloat16
    python experiments/meta.py summarize runs/seed0 runs/seed1 runs/seed2    # mean table over reflection runs

``reflection``: one supervised warm start (scripted solutions) is trained once, saved, and every arm
starts from it (the same weights, not merely the same seed):

- ``warm``: the warm start, untrained by RL, evaluated in K-attempt trials with reflections;
- ``icrl``: the warm start prompted with its earlier attempts in full and their rewards, no
  reflection, no training (in-context RL prompting, "Reward is Enough");
- ``single``: single-episode RL (``meta.num_attempts=1``, GRPO), evaluated in the same trials as ``warm``;
- ``meta``: meta-RL with reflection (trials of K attempts, ``algo.advantage=meta``, LaMer's
  cross-episode credit, reflections trained);
- ``retry`` (optional, ``--arms``): meta-RL with plain retries (feedback lines, no reflection).

Every arm is evaluated greedily on the same held-out tasks: attempt-1 success (the zero-shot
policy), success at and by attempt K, attempts per trial, repeated failed actions. ``--sampled N``
adds a sampled evaluation with N trials per task: pass@K of N independent first attempts against
success by attempt K.

``demos``: python_math from the untrained model (``sft.enabled=false``): GRPO with annealed
few-shot demonstrations (from ``solve()`` on other training tasks, fading linearly to none at
half the steps) against none; held-out success (always zero-shot) before, during and after.

``--trial-demos F`` plays that fraction of the warm start's demos as scripted trials (a failure, its
reflection, the solution: ``sft.trial_demos``, docs/meta.md). ``summarize DIR...`` prints the mean
and per-run figures of several reflection runs (seeds) and, with ``--out``, writes them and a plot.

``--smoke`` shrinks everything (random-init model, one step, two tasks) to check the script runs.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

MODELS = {"reflection": "tiny:envs=calculator+minesweeper+bandit",
          "demos": "tiny:envs=calculator+python_math+search_qa+sokoban"}
ENV_OVERRIDES = {
    "minesweeper": ["env.max_turns=6", "rollout.max_new_tokens=48", "rollout.max_total_tokens=1536"],
    "bandit": ["env.max_turns=8", "rollout.max_new_tokens=32", "rollout.max_total_tokens=1536"],
    "codebreak": ["env.max_turns=6", "rollout.max_new_tokens=32", "rollout.max_total_tokens=1536",
                  "meta.reflection_max_tokens=96"],  # notes of 5-digit codes run to ~70 tokens
    "hidden_word": ["env.max_turns=5", "rollout.max_new_tokens=32", "rollout.max_total_tokens=1536",
                    "meta.reflection_max_tokens=64"],  # notes run to ~45 tokens with SmolLM2's tokenizer
    "python_math": ["env.max_turns=4", "rollout.max_new_tokens=160", "rollout.max_total_tokens=2048"],
}
COMMON = ["run.progress=false", "train.eval_every=0", "rollout.tasks_per_step=4", "rollout.group_size=4",
          "meta.reflection_max_tokens=64"]
SMOKE = ["rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "sft.demos=8",
         "sft.epochs=1", "sft.batch_size=4", "rollout.max_total_tokens=1024", "meta.reflection_max_tokens=4",
         "meta.demos.pool=3", "run.samples_per_step=0"]
ARMS = ("warm", "icrl", "single", "meta", "retry")


def _config(overrides: list[str]):
    from ctxrl.config import load_config

    return load_config(None, overrides)


def train_and_evaluate(overrides: list[str], out: Path, *, eval_every: int = 0) -> dict:
    """Optional warm start, ``train.steps`` RL steps, held-out evaluation (also every ``eval_every`` steps)."""
    from ctxrl.run import loop
    from ctxrl.run.build import build, start_learning
    from ctxrl.run.step import rl_step

    config = _config(overrides)
    run = build(config, out)
    if config.sft.enabled:
        loop.warm_start(run)
    curve = {}
    steps = config.train.steps
    if eval_every:
        curve[0] = loop.evaluate(run, 0, splits=("heldout",))["heldout"]["success"]
    if steps:
        start_learning(run)
        for step in range(steps):
            rl_step(run, step)
            if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
                curve[step + 1] = loop.evaluate(run, step + 1, splits=("heldout",))["heldout"]["success"]
    result = loop.evaluate(run, steps, splits=("heldout",))["heldout"]
    curve[steps] = result["success"]
    checkpoint = loop.save_final(run, "final")
    run.writer.close()
    return {"heldout": result, "curve": curve, "checkpoint": str(checkpoint)}


def evaluate(checkpoint: str, overrides: list[str], out: Path) -> dict:
    """Held-out evaluation of a saved model under ``overrides`` (no training)."""
    from ctxrl.run import loop
    from ctxrl.run.build import build

    run = build(_config([*overrides, f"model.name={json.dumps(checkpoint)}", "sft.enabled=false", "train.steps=0"]),
                out)
    result = loop.evaluate(run, 0, splits=("heldout",))["heldout"]
    run.writer.close()
    return result


def reflection(args, out: Path) -> dict:
    k = args.attempts
    base = [*COMMON, f"env.name={args.env}", *ENV_OVERRIDES.get(args.env, []), f"run.seed={args.seed}",
            f"eval.tasks={args.eval_tasks}", f"sft.trial_demos={args.trial_demos}", *(SMOKE if args.smoke else []),
            *args.overrides]
    trials = [f"meta.eval_attempts={k}"]
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    warm = train_and_evaluate([*base, f"model.name={args.model}", "train.steps=0", *trials], out / "warm")
    checkpoint = warm["checkpoint"]
    print(f"warm start saved to {checkpoint} ({time.perf_counter() - t0:.0f}s)", flush=True)
    start = [*base, f"model.name={json.dumps(checkpoint)}", "sft.enabled=false"]
    protocols = {"warm": trials, "icrl": [*trials, "meta.carry=attempts", "meta.reflect=false"]}
    if "warm" in arms:
        results["warm"] = {"heldout": warm["heldout"], "checkpoint": checkpoint}
    if "icrl" in arms:
        results["icrl"] = {"heldout": evaluate(checkpoint, [*base, *protocols["icrl"]], out / "icrl"),
                           "checkpoint": checkpoint}
    training = {"single": ["meta.num_attempts=1", "algo.advantage=grpo", *trials],
                "meta": [f"meta.num_attempts={k}", "algo.advantage=meta"],
                "retry": [f"meta.num_attempts={k}", "algo.advantage=meta", "meta.reflect=false"]}
    for arm in ("single", "meta", "retry"):
        if arm in arms:
            results[arm] = train_and_evaluate([*start, f"train.steps={args.steps}", *training[arm]], out / arm)
            protocols[arm] = [*trials, *(["meta.reflect=false"] if arm == "retry" else [])]
            print(f"{arm}: {args.steps} RL steps done ({time.perf_counter() - t0:.0f}s)", flush=True)
    if args.sampled:  # pass@K of independent first attempts vs success by attempt K, with sampling
        temperature = _config(base).rollout.temperature
        for arm, r in results.items():
            r["sampled"] = evaluate(r["checkpoint"], [*base, *protocols.get(arm, protocols["warm"]),
                                                      f"meta.eval_trials={args.sampled}",
                                                      f"eval.temperature={temperature}",
                                                      f"eval.tasks={max(2, args.eval_tasks // 2)}"],
                                    out / f"{arm}-sampled")
    return {"experiment": "reflection", "env": args.env, "model": args.model, "attempts": k, "steps": args.steps,
            "trial_demos": args.trial_demos, "seconds": round(time.perf_counter() - t0), "arms": results}


def demos(args, out: Path) -> dict:
    env, steps = args.env, args.steps
    base = [*COMMON, f"env.name={env}", *ENV_OVERRIDES.get(env, []), f"run.seed={args.seed}",
            f"model.name={args.model}", "sft.enabled=false", f"train.steps={steps}", f"eval.tasks={args.eval_tasks}",
            *(SMOKE if args.smoke else []), *args.overrides]
    arms = {"none": ["meta.demos.max=0"],
            "annealed": [f"meta.demos.max={args.demos}", f"meta.demos.steps={max(1, steps // 2)}",
                         "meta.demos.kind=linear", "meta.demos.mode=count"]}
    t0 = time.perf_counter()
    every = args.eval_every or max(1, steps // 4)
    results = {arm: train_and_evaluate([*base, *o], out / arm, eval_every=every) for arm, o in arms.items()}
    return {"experiment": "demos", "env": env, "model": args.model, "steps": steps, "demos": args.demos,
            "demos_steps": max(1, steps // 2), "seconds": round(time.perf_counter() - t0), "arms": results}


def _fmt(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def tables(summary: dict) -> str:
    """Markdown tables of a summary (what docs/experiments/meta.md shows)."""
    if summary["experiment"] == "reflection":
        k = summary["attempts"]
        lines = [f"{summary['env']}, {summary['model']}, K = {k} attempts, {summary['steps']} RL steps, trial demos "
                 f"{summary.get('trial_demos', 0):g} ({summary['seconds']} s)", "",
                 f"| arm | attempt-1 success | success at attempt {k} | success by attempt {k} | attempts / trial "
                 f"| tool errors at 1, {k} | repeated failed actions | pass@{k} (sampled) | success by {k} (sampled) "
                 f"| success at 2: trial, independent (sampled) |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for arm, r in summary["arms"].items():
            h, s = r["heldout"], r.get("sampled", {})
            lines.append(f"| {arm} | {_fmt(h.get('success'))} | {_fmt(h.get(f'success_at_{k}'))} | "
                         f"{_fmt(h.get(f'success_by_{k}'))} | {_fmt(h.get('attempts'))} | "
                         f"{_fmt(h.get('tool_errors_at_1'))}, {_fmt(h.get(f'tool_errors_at_{k}'))} | "
                         f"{_fmt(h.get('exploration/repeated_failed_actions'))} | {_fmt(s.get(f'pass_at_{k}'))} | "
                         f"{_fmt(s.get(f'success_by_{k}'))} | {_fmt(s.get('success_at_2'))}, "
                         f"{_fmt(s.get('independent_success_at_2'))} |")
        return "\n".join(lines) + "\n"
    lines = [f"{summary['env']}, {summary['model']}, {summary['steps']} RL steps, no warm start; annealed: "
             f"{summary['demos']} demos fading to 0 at step {summary['demos_steps']} ({summary['seconds']} s)", "",
             "| arm | held-out before | held-out after | held-out by step |", "|---|---|---|---|"]
    for arm, r in summary["arms"].items():
        curve = r["curve"]
        lines.append(f"| {arm} | {_fmt(curve[min(curve)])} | {_fmt(r['heldout']['success'])} | "
                     + ", ".join(f"{s}: {_fmt(v)}" for s, v in sorted(curve.items())) + " |")
    return "\n".join(lines) + "\n"


AGGREGATED = ("success", "success_at_2", "success_at_{k}", "success_by_{k}", "tool_errors_at_1", "tool_errors_at_{k}",
              "exploration/repeated_failed_actions", "sampled/pass_at_{k}", "sampled/success_by_{k}",
              "sampled/success_at_2", "sampled/independent_success_at_2")


def aggregate(summaries: list[dict]) -> str:
    """A markdown table of reflection runs (several seeds): per arm, the mean and the per-seed values."""
    if not summaries or any(s["experiment"] != "reflection" for s in summaries):
        raise SystemExit("summarize takes the --out directories of reflection runs (each with a summary.json)")
    k = summaries[0]["attempts"]
    keys = [key.format(k=k) for key in AGGREGATED]
    arms = list(dict.fromkeys(arm for s in summaries for arm in s["arms"]))
    lines = [f"{summaries[0]['env']}, K = {k}, {len(summaries)} runs (mean; per run in brackets)", "",
             "| arm | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for arm in arms:
        cells = []
        for key in keys:
            part, name = key.split("/", 1) if key.startswith("sampled/") else ("heldout", key)
            values = [s["arms"][arm].get(part, {}).get(name) for s in summaries if arm in s["arms"]]
            values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
            cells.append(f"{sum(values) / len(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})" if values
                         else "-")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def mean_summary(summaries: list[dict]) -> dict:
    """One reflection summary whose held-out ``success_by_k`` are the means over ``summaries`` (for ``plot``)."""
    k = summaries[0]["attempts"]
    arms = list(dict.fromkeys(arm for s in summaries for arm in s["arms"]))
    mean = {}
    for arm in arms:
        runs = [s["arms"][arm]["heldout"] for s in summaries if arm in s["arms"]]
        mean[arm] = {"heldout": {f"success_by_{j}": sum(r[f"success_by_{j}"] for r in runs) / len(runs)
                                 for j in range(1, k + 1)}}
    return {**summaries[0], "arms": mean, "env": f"{summaries[0]['env']}, mean of {len(summaries)} runs"}


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    if summary["experiment"] == "reflection":
        k = summary["attempts"]
        for arm, r in summary["arms"].items():
            ax.plot(range(1, k + 1), [r["heldout"].get(f"success_by_{j}", math.nan) for j in range(1, k + 1)],
                    marker="o", label=arm)
        ax.set_xlabel("attempt")
        ax.set_ylabel("held-out success by attempt")
        ax.set_xticks(range(1, k + 1))
    else:
        for arm, r in summary["arms"].items():
            steps = sorted(r["curve"])
            ax.plot(steps, [r["curve"][s] for s in steps], marker="o", label=arm)
        ax.set_xlabel("RL step")
        ax.set_ylabel("held-out success (zero-shot)")
    ax.set_title(f"{summary['env']}: {summary['experiment']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=("reflection", "demos", "summarize"),
                        help="summarize: a table over the --out directories of reflection runs given as arguments")
    parser.add_argument("--env", help="reflection: minesweeper (default), bandit or codebreak; "
                                      "demos: python_math (default)")
    parser.add_argument("--model", help="default: the tiny model pre-trained on the experiment's environments")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per trained arm (default 12; demos 40)")
    parser.add_argument("--attempts", type=int, default=3, help="K, attempts per trial")
    parser.add_argument("--arms", default="warm,icrl,single,meta", help=f"reflection arms, from {', '.join(ARMS)}")
    parser.add_argument("--eval-tasks", type=int, default=40, help="held-out tasks per evaluation")
    parser.add_argument("--sampled", type=int, default=0,
                        help="reflection: trials per task of an extra sampled evaluation (pass@K needs >= K; 0 = none)")
    parser.add_argument("--trial-demos", type=float, default=0.0,
                        help="reflection: fraction of the warm start's demos played as scripted trials (a failure, "
                             "its reflection, the solution; sft.trial_demos)")
    parser.add_argument("--demos", type=int, default=2, help="demos: demonstrations per prompt at step 0")
    parser.add_argument("--eval-every", type=int, default=0, help="demos: held-out evaluation every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a seconds-long run on a random-init model")
    parser.add_argument("--out", default=None, help="results directory (default runs/experiment-meta-<experiment>)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, section.key=value")
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options, as the examples write them
    if args.experiment == "summarize":
        missing = [d for d in args.overrides if not (Path(d) / "summary.json").is_file()]
        if missing or not args.overrides:
            raise SystemExit(f"summarize needs the --out directories of finished reflection runs; no summary.json in "
                             f"{', '.join(missing) or '(none given)'}")
        summaries = [json.loads((Path(d) / "summary.json").read_text()) for d in args.overrides]
        text = aggregate(summaries)
        print(text)
        if args.out:  # the table and the mean success-by-attempt curves
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "tables.md").write_text(text)
            plot(mean_summary(summaries), out / "reflection.png")
        return {"table": text}
    if args.smoke:
        args.model = args.model or "tiny:pretrain_steps=0"
        args.steps = 1 if args.steps is None else args.steps
        args.attempts, args.eval_tasks, args.demos = 2, 2, 1
    args.model = args.model or MODELS[args.experiment]
    args.env = args.env or ("minesweeper" if args.experiment == "reflection" else "python_math")
    if args.steps is None:
        args.steps = 12 if args.experiment == "reflection" else 40
    out = Path(args.out or f"runs/experiment-meta-{args.experiment}")
    if any(out.glob("*/metrics.jsonl")):
        raise SystemExit(f"{out} already holds runs of an earlier experiment; choose another --out or remove it")
    out.mkdir(parents=True, exist_ok=True)
    summary = reflection(args, out) if args.experiment == "reflection" else demos(args, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = tables(summary)
    (out / "tables.md").write_text(text)
    plot(summary, out / f"{args.experiment}.png")
    print(text)
    return summary


if __name__ == "__main__":
    main()
