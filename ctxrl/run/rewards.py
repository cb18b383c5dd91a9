"""Training-time reward shaping: the environment's reward, re-weighted and joined by shaping terms.

``shape_rewards`` rewrites ``Episode.reward`` with ``reward.outcome * env_reward`` plus the weighted
terms of ``ctxrl.algo.shaping`` and the judge's score (``reward.judge.weight``, ``ctxrl.judge``), and the turns to
match: every ``Turn.reward`` is multiplied by
``reward.outcome`` and the episode-level terms are added to the last turn, so per-turn estimators
see the same total. The environment's own reward stays in ``info["env_reward"]``, and every
term in ``info["reward_terms"]``. Evaluation never shapes: it reports the environment's success.
"""

from __future__ import annotations

from ctxrl.algo.shaping import compose, format_reward, group_optimal_calls, otc_reward, overlong_penalty
from ctxrl.judge.spec import JudgeSettings
from ctxrl.sections import RewardConfig
from ctxrl.types import Episode

NO_JUDGE = JudgeSettings()
"""``[reward.judge]`` at its defaults: no judge."""


def shaping_enabled(rc: RewardConfig, judge: JudgeSettings = NO_JUDGE) -> bool:
    return (rc.outcome != 1.0 or bool(rc.overlong_buffer) or rc.otc_weight != 0.0 or rc.format_weight != 0.0
            or judge.enabled)


def judge_score(episode: Episode) -> float:
    """The judge's score of a graded episode (``info["judge"]``, ``ctxrl.judge``); 0 for an errored one, which
    trains on nothing. A played episode without one is ctxrl's bug, not the episode's: it is not scored 0 quietly."""
    verdict = episode.info.get("judge", {})
    if "score" in verdict:
        return float(verdict["score"])
    if episode.truncation == "error":
        return 0.0
    raise RuntimeError(f"reward.judge is set but the episode of task {episode.task.id} was not judged; the rollout "
                       "worker grades every training episode it plays (was it built without the run's spec?)")


def shape_rewards(episodes: list[Episode], rc: RewardConfig, *, max_total_tokens: int,
                  judge: JudgeSettings = NO_JUDGE) -> dict[str, float]:
    """Shape the rewards of one rollout batch in place (``judge``: the run's ``[reward.judge]``, whose weight its
    score takes); returns the mean of each term."""
    if not episodes or not shaping_enabled(rc, judge):
        return {}
    optimal = group_optimal_calls([e.tool_calls for e in episodes], [e.success for e in episodes],
                                  [e.group_id for e in episodes]) if rc.otc_weight else {}
    weights = {"outcome": rc.outcome}
    if rc.overlong_buffer:
        weights["overlong"] = rc.overlong_weight
    if rc.otc_weight:
        weights["otc"] = rc.otc_weight
    if rc.format_weight:
        weights["format"] = rc.format_weight
    if judge.enabled:
        weights["judge"] = judge.weight
    sums: dict[str, float] = {}
    for e in episodes:
        terms = {"outcome": e.reward}
        if rc.overlong_buffer:
            longest = max(len(s.input_ids) for s in e.sequences())
            terms["overlong"] = overlong_penalty(longest, max_total_tokens, rc.overlong_buffer)
        if rc.otc_weight:
            terms["otc"] = otc_reward(float(e.success), e.tool_calls, optimal[e.group_id], c=rc.otc_c)
        if rc.format_weight:
            terms["format"] = format_reward([t.tool_errors for t in e.turns])
        if judge.enabled:
            terms["judge"] = judge_score(e)
        total, logged = compose(terms, weights)
        e.info["env_reward"] = e.reward
        e.info["reward_terms"] = logged
        # every turn's own reward is re-weighted; the episode-level terms go on the last turn
        for turn in e.turns:
            turn.reward *= rc.outcome
        if e.turns:
            e.turns[-1].reward += total - rc.outcome * e.reward
        e.reward = total
        for k, v in logged.items():
            sums[k] = sums.get(k, 0.0) + v
        sums["reward_shaped"] = sums.get("reward_shaped", 0.0) + total
    return {k: v / len(episodes) for k, v in sums.items()}
