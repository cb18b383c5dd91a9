"""What a batch of episodes is measured by: success, reward, tool use, turns, tokens, truncation rates.

The same figures for a training step (``ctxrl.run.step``) and an evaluation
(``ctxrl.eval.evaluate``); trials add their own (``ctxrl.meta.metrics``).
"""

from __future__ import annotations

from collections import Counter

from ctxrl.types import Episode


def summarize(episodes: list[Episode]) -> dict[str, float]:
    """Success, reward, tool use and truncation rates of a list of episodes."""
    rows = [{"success": e.success, "reward": e.reward, "tool_calls": e.tool_calls, "tool_errors": e.tool_errors,
             "turns": len(e.turns), "sampled_tokens": e.num_sampled_tokens, "truncation": e.truncation}
            for e in episodes]
    errored = sum(e.truncation == "error" for e in episodes)
    out = rates(rows, len(episodes), errored=errored)
    restarts = sum(e.info.get("template_restarts", 0) for e in episodes)
    if restarts:  # a chat template that rewrites history cut episodes into segments (docs/tool-formats.md)
        out["template_restarts"] = restarts / len(episodes)
    return out


def rates(rows: list[dict], n: int, *, errored: int, skip_truncations: tuple[str, ...] = ()) -> dict[str, float]:
    """Per-episode means over ``n`` (rows missing from ``n`` count as 0) and one ``truncated_*`` rate per reason."""
    n = max(n, 1)
    out = {key: sum(r[key] for r in rows) / n
           for key in ("success", "reward", "tool_calls", "tool_errors", "turns", "sampled_tokens")}
    out["errored"] = errored / n
    reasons = Counter(r["truncation"] for r in rows if r["truncation"] and r["truncation"] not in skip_truncations)
    for reason, count in reasons.items():
        out[f"truncated_{reason}"] = count / n
    return out
