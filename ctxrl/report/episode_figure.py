"""Draw an episode's tokens coloured by loss mask: trained (sampled) vs context (never trained).

``benchmarks/episode_figure.py OUT.png`` plays one scripted calculator episode with the tiny tokenizer and
draws it; the picture in docs/trajectories.md is made this way.
"""

from __future__ import annotations

from pathlib import Path

from ctxrl.types import Episode


def draw_episode(episode: Episode, decode, path: str | Path, *, width_chars: int = 86) -> Path:
    """Write a PNG of ``episode``: one box per token run, green = loss mask 1, grey = 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from ctxrl.report.writer import mask_spans

    # Lay out text runs on lines of at most width_chars characters.
    lines: list[list[tuple[str, int]]] = [[]]
    used = 0
    for start, end, mask in mask_spans(episode):
        text = decode(episode.input_ids[start:end])
        for i, piece in enumerate(text.split("\n")):
            if i > 0:
                lines.append([])
                used = 0
            while piece:
                room = width_chars - used
                if room <= 0:
                    lines.append([])
                    used, room = 0, width_chars
                chunk, piece = piece[:room], piece[room:]
                lines[-1].append((chunk, mask))
                used += len(chunk)
    height = 0.26 * len(lines) + 0.9
    fig, ax = plt.subplots(figsize=(width_chars * 0.085 + 0.4, height))
    ax.set_xlim(0, width_chars)
    ax.set_ylim(len(lines), -1)
    ax.axis("off")
    for row, runs in enumerate(lines):
        x = 0
        for chunk, mask in runs:
            ax.text(x, row, chunk, family="monospace", fontsize=8, va="center", ha="left",
                    bbox={"boxstyle": "square,pad=0.12", "lw": 0,
                          "fc": "#b7e4b0" if mask else "#e6e6e6"})
            x += len(chunk)
    ax.legend(handles=[Patch(fc="#b7e4b0", label="loss mask 1: sampled by the policy (trained)"),
                       Patch(fc="#e6e6e6", label="loss mask 0: prompt, template, tool output")],
              loc="upper right", fontsize=7, frameon=False, bbox_to_anchor=(1.0, 1.06), ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
