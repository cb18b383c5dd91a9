"""Training on segmented episodes: one sequence per segment, the episode's advantage on each.

An episode whose context was rewritten (``window``, ``summarize``, ``fold``) holds several
token-faithful sequences (``Episode.sequences()``). Advantages are computed over episodes (group
statistics count episodes, never segments); ``expand_segments`` then turns each episode into one
training sequence per segment, every sampled token carrying the episode's advantage (SUPO /
ReSum broadcast). With ``token-mean`` aggregation (required with a context manager) a token
weighs the same whether or not its episode was cut into segments, so long episodes do not gain
weight from being segmented. Sequences without sampled tokens are not trained.
"""

from __future__ import annotations

import dataclasses

from ctxrl.types import Episode

OUTCOME_ESTIMATORS = ("grpo", "dr_grpo", "rloo")

def episode_outcome_advantages(name: str, episodes: list[Episode]) -> list[float]:
    """One advantage per episode from its final reward, with group statistics over episodes.

    The same values ``episode_advantages`` puts on every sampled token of an unsegmented episode
    (``grpo``, ``dr_grpo``, ``rloo``), computed without looking at any sequence, so an episode
    whose live sequence sampled nothing keeps its advantage too.
    """
    import torch

    from ctxrl.algo.advantages import grpo_advantages, rloo_advantages

    if name not in OUTCOME_ESTIMATORS:
        raise ValueError(f"segmented episodes need an outcome estimator ({', '.join(OUTCOME_ESTIMATORS)}), not {name!r}")
    if not episodes:
        return []
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
    groups = torch.tensor([e.group_id for e in episodes], dtype=torch.long)
    if name == "rloo":
        return rloo_advantages(rewards, groups).tolist()
    return grpo_advantages(rewards, groups, std_normalize=name == "grpo").tolist()


def expand_segments(episodes: list[Episode], advantages: list[float], *,
                    branch_reward: float = 0.0) -> tuple[list[Episode], list[list[float]]]:
    """One training sequence per segment (or per unsegmented episode), its tokens carrying the episode's advantage.

    ``branch_reward``: the ``fold`` manager's optional process reward. It is added to the
    advantage of every sampled token of a branch that returned a non-empty result (a segment that
    ended as ``fold``), as FoldGRPO (Context-Folding, Sun et al. 2025) adds its token-level
    process rewards to the group-normalised outcome advantage. It rewards finishing a branch with
    a result, not the result's correctness, so keep it small next to the outcome advantage;
    ``max_branches`` bounds how much an episode can collect. A branch that returned nothing
    (``fold-empty``) or never returned (``fold-unfinished``) gets none.
    """
    out_eps: list[Episode] = []
    out_adv: list[list[float]] = []
    for episode, scalar in zip(episodes, advantages, strict=True):
        if not episode.segments:
            out_eps.append(episode)
            out_adv.append([scalar * m for m in episode.loss_mask])
            continue
        for seq in episode.sequences():
            if not any(seq.loss_mask):
                continue  # nothing sampled in it: nothing to train
            out_eps.append(dataclasses.replace(episode, input_ids=seq.input_ids, loss_mask=seq.loss_mask,
                                               behavior_logprobs=seq.behavior_logprobs, turn_index=seq.turn_index,
                                               messages=seq.messages, segments=[]))
            bonus = branch_reward if seq.ended_by == "fold" else 0.0
            out_adv.append([(scalar + bonus) * m for m in seq.loss_mask])
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
        "branches_returned_per_episode": sum(s.ended_by == "fold" for e in episodes for s in e.segments) / n,
        "summary_tokens_mean": total_summary_tokens / max(sum(summaries), 1),
        "context_tokens_saved": (sum(full) - sum(peaks)) / n,
        "success_with_summary": _rate([e.success for e, k in zip(episodes, summaries) if k]),
        "success_without_summary": _rate([e.success for e, k in zip(episodes, summaries) if not k]),
    }


def _rate(values: list[bool]) -> float:
    return sum(values) / len(values) if values else float("nan")
