"""Training on segmented episodes: one sequence per segment, the episode's advantage on each.

An episode whose context was rewritten (``summarize``) holds several token-faithful sequences
(``Episode.sequences()``). Advantages are computed over episodes (group statistics count
episodes, never segments); ``expand_segments`` then turns each episode into one training
sequence per segment, every sampled token carrying the episode's advantage (SUPO / ReSum
broadcast). Under a ``seq-mean-*`` aggregation a segment is a sequence, so an episode with many
segments would weigh more; ``weight="episode"`` (the default) scales each segment's advantages by
``1 / n_segments`` there, so every episode weighs as one sequence. Under ``token-mean`` nothing
changes: the sampled tokens are the same whether or not the episode was cut into segments.
"""

from __future__ import annotations

import dataclasses

from ctxrl.types import Episode

WEIGHTS = ("episode", "segment")


def episode_scalar_advantage(episode: Episode, advantages: list[float]) -> float:
    """The advantage an outcome estimator gave the episode (its value on the sampled tokens)."""
    return next((a for a, m in zip(advantages, episode.loss_mask) if m), 0.0)


def expand_segments(episodes: list[Episode], advantages: list[list[float]], *, agg: str = "token-mean",
                    weight: str = "episode") -> tuple[list[Episode], list[list[float]]]:
    """(one episode-like sequence per segment, its per-token advantages); unsegmented episodes pass through."""
    if weight not in WEIGHTS:
        raise ValueError(f"segment weight must be one of {', '.join(WEIGHTS)}, not {weight!r}")
    out_eps: list[Episode] = []
    out_adv: list[list[float]] = []
    for episode, adv in zip(episodes, advantages, strict=True):
        if not episode.segments:
            out_eps.append(episode)
            out_adv.append(adv)
            continue
        sequences = episode.sequences()
        scalar = episode_scalar_advantage(episode, adv)
        if weight == "episode" and agg.startswith("seq-mean"):
            scalar /= len(sequences)
        for seq in sequences:
            out_eps.append(dataclasses.replace(episode, input_ids=seq.input_ids, loss_mask=seq.loss_mask,
                                               behavior_logprobs=seq.behavior_logprobs, turn_index=seq.turn_index,
                                               messages=seq.messages, segments=[]))
            out_adv.append([scalar * m for m in seq.loss_mask])
    return out_eps, out_adv


def context_stats(episodes: list[Episode]) -> dict[str, float]:
    """Working-context metrics: tokens per generation, peak context, summaries, summary length."""
    if not episodes:
        return {}
    peaks = [max(len(s.input_ids) for s in e.sequences()) for e in episodes]
    summaries = [e.info.get("summaries", 0) for e in episodes]
    total_summary_tokens = sum(e.info.get("summary_tokens", 0) for e in episodes)
    full = [sum(len(s.input_ids) for s in e.sequences()) for e in episodes]
    n = len(episodes)
    return {
        "context_peak_tokens_mean": sum(peaks) / n,
        "context_peak_tokens_max": float(max(peaks)),
        "summaries_per_episode": sum(summaries) / n,
        "windows_per_episode": sum(e.info.get("windows", 0) for e in episodes) / n,
        "branches_per_episode": sum(e.info.get("branches", 0) for e in episodes) / n,
        "summary_tokens_mean": total_summary_tokens / max(sum(summaries), 1),
        "context_tokens_saved": (sum(full) - sum(peaks)) / n,
        "success_with_summary": _rate([e.success for e, k in zip(episodes, summaries) if k]),
        "success_without_summary": _rate([e.success for e, k in zip(episodes, summaries) if not k]),
    }


def _rate(values: list[bool]) -> float:
    return sum(values) / len(values) if values else float("nan")
