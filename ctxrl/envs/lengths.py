"""How long an environment's episodes are in a given model's tokens: the figure a context budget needs.

A working-context budget (``context.max_context_tokens``) means something only against the
tokenizer and chat template that will render the episodes: the same ``fact_hunt`` page is about 57
tokens with its own tiny tokenizer and far more with the default one. ``episode_lengths`` plays the
scripted solution of a few tasks of each split and renders it with a ``ChatRenderer``:

- ``opening``: the system prompt, the tool schemas and the task, up to the first reply;
- ``turn``: what one step adds (the reply and its observations), every step but the last;
- ``episode``: the whole conversation (min, median, max), and ``turns``: replies per episode.

A budget at or above an episode's length (plus ``rollout.max_new_tokens`` for the reply being
written) never makes a context manager act on it. ``ctxrl check-env NAME --lengths MODEL`` prints
these figures.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from ctxrl.envs.check import play_solution_with_tools
from ctxrl.envs.hooks import available_splits


def episode_lengths(env_cls: type, renderer: Any, *, n_tasks: int = 8, seed: int = 0, tool_format: str = "hermes",
                    splits: tuple[str, ...] | None = None) -> dict[str, dict[str, Any]]:
    """Token lengths of ``n_tasks`` scripted episodes per split (see the module docstring); ``splits``
    defaults to those the environment has (its ``splits`` hook)."""
    if n_tasks < 1:
        raise ValueError(f"n_tasks must be at least 1, got {n_tasks}")
    result = {}
    for split in splits or available_splits(env_cls):
        openings, steps, totals, replies = [], [], [], []
        tasks = env_cls.sample_tasks(split, n_tasks, seed)
        for task in tasks:
            messages, _, tools = play_solution_with_tools(env_cls, task, seed, tool_format)
            starts = [i for i, m in enumerate(messages) if m.role == "assistant"]
            if not starts:
                raise ValueError(f"{env_cls.__name__}.solve() gave no reply for task {task.id} ({split})")
            prefix = [len(renderer.prompt_ids(messages[:i], tools or None)) for i in starts]
            openings.append(prefix[0])
            steps += [b - a for a, b in zip(prefix, prefix[1:])]
            totals.append(len(renderer.conversation_ids(messages, tools or None)))
            replies.append(len(starts))
        result[split] = {"tasks": len(tasks), "opening": median(openings), "turn": median(steps) if steps else None,
                         "episode": [min(totals), median(totals), max(totals)], "turns": median(replies)}
    return result


def lengths_table(lengths: dict[str, dict[str, Any]]) -> str:
    """The figures as aligned text, one row per split."""
    lines = [f"{'split':8s} {'opening':>8s} {'turn':>6s} {'episode min / median / max':>27s} {'turns':>6s}"]
    for split, r in lengths.items():
        turn = "-" if r["turn"] is None else f"{r['turn']:.0f}"
        low, mid, high = r["episode"]
        lines.append(f"{split:8s} {r['opening']:8.0f} {turn:>6s} {f'{low:.0f} / {mid:.0f} / {high:.0f}':>27s} "
                     f"{r['turns']:6.1f}")
    return "\n".join(lines)
