"""Context management on kv_chain: full vs window vs summarize at one working-context budget.

For each manager the script trains the same warm-started model with the demo's pipeline on
``kv_chain`` chains longer than the budget holds in full (``full`` gets an unlimited budget: the
reference), then reports held-out success, the peak working context and summaries per episode.
For ``summarize`` and ``select`` it also evaluates the final checkpoint with growing
evaluation-time limits on summaries (selections) per episode (SUPO's test-time scaling), on
held-out and OOD tasks, each limit in ``--out/MANAGER-eval-K``. Results go to ``--out/summary.json``,
a table on stdout and ``--out/context.png``.

    python experiments/context.py                                  # tiny model, CPU: about 25 minutes on 2 cores
    python experiments/context.py --budget 320 --managers window,summarize     # 15 minutes
    python experiments/context.py --managers window,select         # select: the policy keeps chosen turns (ECHO)
    python experiments/context.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 100 model.dtype=bfloat16 \
        eval.tasks=100 sft.demos=2000                              # a GPU

The defaults are sized for a CPU (15 RL steps, 800 warm-start demos, 30 evaluation tasks per
split); overrides on the command line replace them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

MODEL = "tiny:envs=calculator+kv_chain"
SWEPT = ("summarize", "select")  # managers with a per-episode limit that evaluation can raise
CPU_SIZED = ["eval.tasks=30", "sft.demos=800"]  # defaults; command-line overrides come later and win
COMMON = [*CPU_SIZED, "env.name=kv_chain", "env.max_turns=10", "rollout.max_new_tokens=48",
          "rollout.max_total_tokens=2048", "run.progress=false", "train.eval_every=0"]


def manager_overrides(manager: str, budget: int, max_summaries: int) -> list[str]:
    if manager == "full":
        return ["context.manager=full"]
    limits = [f"context.{manager}.max_summaries={max_summaries}",
              f"context.{manager}.eval_max_summaries={max_summaries}"] if manager in SWEPT else []
    return [f"context.manager={manager}", f"context.max_context_tokens={budget}", *limits]


def main() -> None:
    from ctxrl.config import load_config
    from ctxrl.run import loop
    from ctxrl.run.build import build, close
    from ctxrl.train.trainer import train

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--budget", type=int, default=384, help="context.max_context_tokens for window / summarize")
    parser.add_argument("--max-summaries", type=int, default=2, help="summaries per episode in training")
    parser.add_argument("--eval-summaries", default="0,1,2,4,8",
                        help="evaluation-time limits on summaries (select: selections) to sweep")
    parser.add_argument("--managers", default="full,window,summarize")
    parser.add_argument("--out", default="runs/experiment-context")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, section.key=value")
    args = parser.parse_args()
    out = Path(args.out)
    results: dict[str, dict] = {}
    started = time.perf_counter()
    for manager in args.managers.split(","):
        config = load_config(None, [f"model.name={args.model}", f"train.steps={args.steps}", f"run.name={manager}",
                                    *COMMON, *manager_overrides(manager, args.budget, args.max_summaries),
                                    *args.overrides])
        summary = train(config, out / manager)
        rows = [json.loads(x) for x in (out / manager / "metrics.jsonl").read_text().splitlines()]
        final = next(r for r in reversed(rows) if r["phase"] == "eval" and r["split"] == "heldout")
        results[manager] = {"heldout_before": summary["heldout_success_before"],
                            "heldout_after": summary["heldout_success_after"],
                            "ood_after": summary["ood_success_after"],
                            "peak_context": final.get("context_peak_tokens_max"),
                            "summaries_per_episode": final.get("summaries_per_episode"),
                            "selections_per_episode": final.get("selections_per_episode"),
                            "truncated_max_context": final.get("truncated_max_context", 0.0)}
        if manager in SWEPT:
            scaling = {}
            for k in (int(x) for x in args.eval_summaries.split(",")):
                cfg = load_config(None, [f"model.name={summary['checkpoint']}", f"run.name=eval-{k}", *COMMON,
                                         *manager_overrides(manager, args.budget, args.max_summaries),
                                         f"context.{manager}.eval_max_summaries={k}", "train.steps=0",
                                         *args.overrides])
                run = build(cfg, out / f"{manager}-eval-{k}")
                evaluated = loop.evaluate(run, args.steps, splits=("heldout", "ood"))
                scaling[k] = {split: r["success"] for split, r in evaluated.items()}
                run.writer.close()
                close(run)
                del run  # before the next one is built: two engines' caches need not fit at once
            results[manager]["heldout_by_eval_summaries"] = {k: v["heldout"] for k, v in scaling.items()}
            results[manager]["ood_by_eval_summaries"] = {k: v["ood"] for k, v in scaling.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    plot_results(results, out / "context.png",
                 title=f"{args.model}, budget {args.budget} tokens, {args.steps} RL steps")
    print(f"model {args.model}, {args.steps} RL steps, budget {args.budget} tokens, "
          f"{time.perf_counter() - started:.0f}s")
    print(f"{'manager':10s} {'heldout':>14s} {'ood':>6s} {'peak ctx':>9s} {'summ/ep':>8s} {'cut':>6s}")
    for manager, r in results.items():
        peak = "-" if r["peak_context"] is None else f"{r['peak_context']:.0f}"
        summ = "-" if r["summaries_per_episode"] is None else f"{r['summaries_per_episode']:.2f}"
        print(f"{manager:10s} {r['heldout_before']:.2f} -> {r['heldout_after']:.2f} {r['ood_after']:6.2f} "
              f"{peak:>9s} {summ:>8s} {r['truncated_max_context']:6.2f}")
        if "heldout_by_eval_summaries" in r:
            for split in ("heldout", "ood"):
                print(f"  {manager}, {split} by eval-time limit: "
                      + ", ".join(f"{k}: {v:.2f}" for k, v in r[f"{split}_by_eval_summaries"].items()))


def plot_results(results: dict[str, dict], path: Path, *, title: str = "") -> Path:
    """Left: held-out and OOD success after RL per manager; right: success by the evaluation-time limit on
    summaries (selections), for each manager swept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(results)
    xs = range(len(names))
    left.bar([x - 0.2 for x in xs], [results[n]["heldout_after"] for n in names], width=0.4, label="held-out")
    left.bar([x + 0.2 for x in xs], [results[n]["ood_after"] for n in names], width=0.4, label="OOD (longer chains)")
    left.set_xticks(list(xs), names)
    left.set_ylim(0, 1.05)
    left.set_ylabel("success after RL")
    left.legend(fontsize=8)
    for manager in SWEPT:
        for split, style in (("heldout", "-"), ("ood", "--")):
            curve = results.get(manager, {}).get(f"{split}_by_eval_summaries")
            if curve:
                limits = sorted(curve, key=int)
                right.plot([int(k) for k in limits], [curve[k] for k in limits], style, marker="o",
                           label=f"{manager}, {split}")
    right.set_xlabel("summaries (selections) allowed at evaluation")
    right.set_ylabel("success")
    right.set_ylim(0, 1.05)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
