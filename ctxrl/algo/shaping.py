"""Reward shaping: small pure functions of what an episode did, composed with weights.

- ``overlong_penalty``: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13);
- ``otc_tool_reward`` / ``otc_reward``: OTC's tool-efficiency reward (Wang et al. 2025, "Acting
  Less is Reasoning More", OTC-PO), which scales correctness by how close the number of tool
  calls is to the fewest that solve the task;
- ``format_reward``: 1 when every assistant turn parsed cleanly (no malformed call);
- ``compose``: a weighted sum of named terms, returned with the terms for logging.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """0 up to ``max_length - buffer`` tokens, then linearly down to -1 at ``max_length``; -1 beyond.

    ``length`` is what counts against ``max_length``: DAPO uses the response length and its
    generation limit; ctxrl's training loop uses the whole episode (prompt, turns, tool output)
    against ``rollout.max_total_tokens``, the budget whose overflow truncates an episode.
    ``buffer`` is DAPO's L_cache.
    """
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length={max_length}], got {buffer}")
    free = max_length - buffer
    if length <= free:
        return 0.0
    if length <= max_length:
        return (free - length) / buffer
    return -1.0


def otc_tool_reward(calls: int, optimal: int | None, *, c: float = 1.0) -> float:
    """OTC's r_tool for ``calls`` tool calls (m) when the fewest known to succeed is ``optimal`` (n).

    ``optimal=None`` (unknown, OTC-PPO): ``cos(m * pi / (2m + c))``, 1 at m = 0, decaying with m.
    Otherwise (OTC-GRPO), with ``f = 0`` if m = n = 0, ``f = m`` if n = 0, else ``f = 2nm / (m + n)``:
    1 if f = n = 0; ``cos(m * pi / (2m + c))`` if n = 0; ``sin(f * pi / (2n))`` otherwise, which is
    1 at m = n and falls off on both sides (too few calls and too many).
    """
    if calls < 0 or (optimal is not None and optimal < 0):
        raise ValueError(f"tool-call counts must be >= 0, got calls={calls}, optimal={optimal}")
    m = float(calls)
    if optimal is None or optimal == 0:
        if optimal == 0 and calls == 0:
            return 1.0
        return math.cos(m * math.pi / (2 * m + c))
    n = float(optimal)
    f = 2 * n * m / (m + n)
    return math.sin(f * math.pi / (2 * n))


def otc_reward(correct: float, calls: int, optimal: int | None, *, alpha: float = 1.0, c: float = 1.0) -> float:
    """``alpha * r_tool * correct``: a wrong answer earns nothing however few tools it used."""
    return alpha * otc_tool_reward(calls, optimal, c=c) * float(correct)


def group_optimal_calls(calls: list[int], correct: list[bool], groups: list[int]) -> dict[int, int | None]:
    """Per group: the fewest tool calls among its correct episodes (OTC-GRPO's estimate of n), or None."""
    best: dict[int, int | None] = {g: None for g in groups}
    for m, ok, g in zip(calls, correct, groups):
        if ok and (best[g] is None or m < best[g]):
            best[g] = m
    return best


def format_reward(turn_errors: list[int]) -> float:
    """1.0 if no turn produced a malformed or failed tool call, else 0.0."""
    return 0.0 if any(e > 0 for e in turn_errors) else 1.0


def compose(terms: Mapping[str, float], weights: Mapping[str, float]) -> tuple[float, dict[str, float]]:
    """``sum(weights[k] * terms[k])`` over the weighted terms; an unknown weight name is an error."""
    unknown = sorted(set(weights) - set(terms))
    if unknown:
        raise ValueError(f"reward weights name unknown terms {unknown}; known: {sorted(terms)}")
    total = sum(float(w) * float(terms[k]) for k, w in weights.items())
    return total, {f"reward_{k}": float(v) for k, v in terms.items()}
