"""PNG plots of a run: training reward and held-out success over steps (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_run(run_dir: str | Path) -> list[Path]:
    """Read ``metrics.jsonl`` and write ``plots/reward.png`` and ``plots/success.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("phase") == "rl"]
    evals = [r for r in rows if r.get("phase") == "eval"]
    out = []
    (run_dir / "plots").mkdir(exist_ok=True)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in train], [r["reward"] for r in train], label="train reward")
    ax.plot([r["step"] for r in train], [r["success"] for r in train], label="train success", alpha=0.7)
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right")
    ax.set_title("Training rollouts")
    fig.tight_layout()
    out.append(run_dir / "plots" / "reward.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for split in sorted({r["split"] for r in evals}):
        pts = [r for r in evals if r["split"] == split]
        ax.plot([r["step"] for r in pts], [r["success"] for r in pts], marker="o", label=f"{split} success")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right")
    ax.set_title("Evaluation (greedy)")
    fig.tight_layout()
    out.append(run_dir / "plots" / "success.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)
    return out
