"""PNG plots of a run (matplotlib, headless): reward, success by split, tool calls per episode.

Each quantity has its own chart: reward and success coincide for a 0/1 reward, so one chart of both showed a
single curve. Evaluations are drawn as points, one per evaluation, never joined: two evaluations (before and
after) joined by a line looked like a measured curve. The figures are built without ``pyplot`` (no global
state, nothing shown), so tests can inspect their axes and lines. ``ctxrl report`` draws the same figures as
SVG in one HTML page; these PNGs are for a quick look and for documents.
"""

from __future__ import annotations

from pathlib import Path

from ctxrl.report.html import Run


def plot_run(run_dir: str | Path) -> list[Path]:
    """Read ``metrics.jsonl`` and write ``plots/{reward,success,tool_calls}.png``; the paths written."""
    run = Run(run_dir)
    (run.dir / "plots").mkdir(exist_ok=True)
    out = []
    for name, figure in (("reward", reward_figure(run)), ("success", success_figure(run)),
                         ("tool_calls", tool_calls_figure(run))):
        out.append(run.dir / "plots" / f"{name}.png")
        figure.savefig(out[-1], dpi=110)
    return out


def _figure(title: str, y_label: str):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.5), layout="tight")
    ax = figure.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.set_ylabel(y_label)
    ax.ticklabel_format(axis="y", useOffset=False)  # no "+1e-13" offset turning float noise into a trend
    return figure, ax


def _line(ax, xy: list[tuple[float, float]], label: str, **style) -> None:
    if xy:
        ax.plot([x for x, _ in xy], [y for _, y in xy], label=label, **style)


def _points(ax, xy: list[tuple[float, float]], label: str) -> None:
    """Evaluations: one marker per evaluation, not joined."""
    if xy:
        ax.plot([x for x, _ in xy], [y for _, y in xy], linestyle="none", marker="o", markersize=7, label=label)


def _legend(ax) -> None:
    if ax.get_lines():
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, "nothing logged yet", transform=ax.transAxes, ha="center", va="center")


def reward_figure(run: Run):
    """Mean reward of the training rollouts per RL step."""
    figure, ax = _figure("Reward (training rollouts)", "reward")
    _line(ax, run.curve("reward"), "train reward")
    _legend(ax)
    return figure


def success_figure(run: Run):
    """Success by split: the training rollouts (sampled) as a curve, each split's evaluations (greedy) as points."""
    figure, ax = _figure("Success by split", "success")
    _line(ax, run.curve("success"), run.rollout_kind(), alpha=0.7)
    for split in run.splits():
        _points(ax, run.curve("success", "eval", split), f"{split}: {run.eval_kind()}")
    ax.set_ylim(-0.02, 1.02)
    _legend(ax)
    return figure


def tool_calls_figure(run: Run):
    """Tool calls and tool errors per episode of the training rollouts; evaluations' tool calls as points."""
    figure, ax = _figure("Tool calls per episode", "per episode")
    _line(ax, run.curve("tool_calls"), "tool calls (train)")
    _line(ax, run.curve("tool_errors"), "tool errors (train)", linestyle="--")
    for split in run.splits():
        _points(ax, run.curve("tool_calls", "eval", split), f"{split} tool calls (evaluation)")
    _legend(ax)
    return figure
