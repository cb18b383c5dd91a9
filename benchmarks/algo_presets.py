"""Every algorithm preset, and the SimpleTIR / OTC claims, from one warm start (one command).

1. Warm-start once (SFT on the demo's imperfect demonstrations) and save the checkpoint.
2. Train each preset in ``examples/presets/`` from that checkpoint for ``--steps`` RL steps and
   report held-out success before and after, tool calls per episode and the gradient norm.
3. The two claims, each an A/B from the same checkpoint and seeds:
   - SimpleTIR: void-turn filtering on vs off (GRPO) -> gradient-norm spikes (steps whose norm
     exceeds 3x the run's median), void-turn rate, held-out success;
   - OTC: OTC-GRPO reward vs plain correctness (GRPO) -> tool calls per episode, success.

Writes ``OUT/algo_presets.json``, ``OUT/algo_presets.md`` (the tables) and
``OUT/algo_claims.png``. On a GPU the whole script takes a few minutes; on 2 CPU cores about
``(2 + presets + 4) x seeds`` demo-length runs.

    python benchmarks/algo_presets.py --out runs/algo --steps 40 --seeds 0,1
    python benchmarks/algo_presets.py --out runs/algo --steps 2 --presets grpo,gspo --seeds 0  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ctxrl.config import load_config
from ctxrl.train.trainer import train as run_training

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "examples" / "calculator_tiny.toml"
PRESETS = ROOT / "examples" / "presets"


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(run_dir: Path, summary: dict) -> dict:
    rows = read_rows(run_dir)
    rl = [r for r in rows if r["phase"] == "rl"]
    norms = [r["grad_norm"] for r in rl if "grad_norm" in r]
    median = statistics.median(norms) if norms else 0.0
    return {
        "heldout_before": summary["heldout_success_before"], "heldout_after": summary["heldout_success_after"],
        "ood_after": summary["ood_success_after"], "tool_calls_after": summary["tool_calls_after"],
        "train_tool_calls_last10": statistics.mean(r["tool_calls"] for r in rl[-10:]) if rl else 0.0,
        "grad_norm_median": median, "grad_norm_max": max(norms, default=0.0),
        "grad_spikes": sum(n > 3 * median for n in norms) if median else 0,
        "void_turn_rate": statistics.mean(r.get("void_turn_rate", 0.0) for r in rl) if rl else 0.0,
        "seconds": summary["wall_seconds"],
        "curve": {k: [r.get(k) for r in rl] for k in ("grad_norm", "tool_calls", "success", "void_turn_rate")},
    }


def train(config_path: Path | None, out: Path, name: str, overrides: list[str]) -> dict:
    run_dir = out / name
    config = load_config(config_path or BASE, overrides)
    summary = run_training(config, run_dir)
    result = summarize(run_dir, summary)
    print(f"{name:<28} heldout {result['heldout_before']:.2f} -> {result['heldout_after']:.2f}  "
          f"tools/ep {result['tool_calls_after']:.2f}  grad max {result['grad_norm_max']:.2f} "
          f"spikes {result['grad_spikes']}  void {result['void_turn_rate']:.2f}  {result['seconds']:.0f}s", flush=True)
    return result


def mean_of(results: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in results)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/algo-presets")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--presets", default="", help="comma-separated preset names (default: all)")
    ap.add_argument("--no-claims", action="store_true")
    ap.add_argument("overrides", nargs="*", help="section.field=value for every run (e.g. model.device=cuda)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = [p.stem for p in sorted(PRESETS.glob("*.toml"))]
    if args.presets:
        names = [n for n in names if n in args.presets.split(",")]
    report: dict = {"steps": args.steps, "seeds": seeds, "presets": {}, "claims": {}}
    for seed in seeds:
        # one warm start per seed, shared by every preset and arm
        warm = train(None, out, f"warm-seed{seed}", [*args.overrides, f"run.seed={seed}", "train.steps=0"])
        ckpt = str(out / f"warm-seed{seed}" / "checkpoints" / "final")
        common = [*args.overrides, f"run.seed={seed}", f'model.name="{ckpt}"', "sft.enabled=false",
                  f"train.steps={args.steps}"]
        report.setdefault("warm", []).append(warm["heldout_before"])
        for name in names:
            r = train(PRESETS / f"{name}.toml", out, f"{name}-seed{seed}", common)
            report["presets"].setdefault(name, []).append(r)
        if args.no_claims:
            continue
        arms = {"grpo": [], "grpo+void_filter": ["algo.void_turn_filter=true"],
                "otc_grpo": ["reward.outcome=0.0", "reward.otc_weight=1.0"]}
        for arm, extra in arms.items():
            r = train(None, out, f"claim-{arm}-seed{seed}", [*common, *extra])
            report["claims"].setdefault(arm, []).append(r)
    (out / "algo_presets.json").write_text(json.dumps(report, indent=2))

    lines = [f"RL steps: {args.steps}; seeds: {seeds}; held-out success after the shared warm start: "
             f"{statistics.mean(report['warm']):.2f}", "",
             "| preset | held-out after RL | tool calls / ep | grad-norm median | grad-norm max | wall (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, results in report["presets"].items():
        lines.append(f"| {name} | {mean_of(results, 'heldout_after'):.2f} "
                     f"| {mean_of(results, 'tool_calls_after'):.2f} | {mean_of(results, 'grad_norm_median'):.3f} "
                     f"| {mean_of(results, 'grad_norm_max'):.3f} | {mean_of(results, 'seconds'):.0f} |")
    if report["claims"]:
        lines += ["", "| arm | held-out after RL | tool calls / ep (eval) | tool calls / ep (last 10 train steps) "
                      "| void-turn rate | grad spikes (> 3x median) | grad-norm max |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for arm, results in report["claims"].items():
            lines.append(f"| {arm} | {mean_of(results, 'heldout_after'):.2f} "
                         f"| {mean_of(results, 'tool_calls_after'):.2f} "
                         f"| {mean_of(results, 'train_tool_calls_last10'):.2f} "
                         f"| {mean_of(results, 'void_turn_rate'):.3f} | {mean_of(results, 'grad_spikes'):.1f} "
                         f"| {mean_of(results, 'grad_norm_max'):.3f} |")
        plot_claims(report["claims"], out / "algo_claims.png")
    table = "\n".join(lines)
    (out / "algo_presets.md").write_text(table + "\n")
    print("\n" + table)
    return report


def plot_claims(claims: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    panels = [(axes[0], ("grpo", "grpo+void_filter"), "grad_norm", "tab:orange",
               dict(title="SimpleTIR: gradient norm per step", xlabel="RL step", ylabel="grad norm (pre-clip)")),
              (axes[1], ("grpo", "otc_grpo"), "tool_calls", "tab:green",
               dict(title="OTC: tool calls per training episode", xlabel="RL step", ylabel="tool calls / episode"))]
    for ax, (base, arm), key, color, labels in panels:
        for name, c in ((base, "tab:blue"), (arm, color)):
            for i, r in enumerate(claims.get(name, [])):
                ax.plot(r["curve"][key], label=name if i == 0 else None, color=c, alpha=0.8)
        ax.set(**labels)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
