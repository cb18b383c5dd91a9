"""``turn_grpo``: group-normalised per-turn returns (MT-GRPO-style), each turn's advantage on its tokens.

``turn_advantages`` (``ctxrl.algo.turns``) compares each turn's discounted return (``gamma`` per
turn) with the same turn of the other episodes of its group; ``broadcast_turn_advantages`` puts it
on every sampled token of that turn. Optional per-token rewards are summed per turn and centred
(never std-normalised, as in ``grpo``). With one turn per episode this is ``grpo``.
"""

from __future__ import annotations

from ctxrl.algo.estimators.base import Estimator, SegmentBonus, one_row_each, register_estimator, unsegmented
from ctxrl.algo.estimators.tensors import group_ids, padded, per_token, rows, turn_sums
from ctxrl.algo.turns import broadcast_turn_advantages, episode_turn_tensors, turn_advantages
from ctxrl.types import Episode, TrainSequence


@register_estimator
class TurnGRPO(Estimator):
    name = "turn_grpo"
    accepts_token_rewards = True

    def estimate(self, episodes: list[Episode], *, token_rewards: list[list[float]] | None = None,
                 values: list[list[float]] | None = None,
                 segment_bonus: SegmentBonus | None = None) -> list[list[TrainSequence]]:
        if not episodes:
            return []
        unsegmented(self.name, episodes)
        mask, turns = padded(episodes)
        extra = per_token(episodes, token_rewards, mask, "token rewards") * mask
        groups, gamma = group_ids(episodes), self.settings.gamma
        turn_rewards, turn_mask = episode_turn_tensors(episodes)
        turn_extra = turn_sums(extra, turns, turn_rewards.shape[1])
        turn_adv = turn_advantages(turn_rewards, turn_mask, groups, gamma=gamma) + \
            turn_advantages(turn_extra, turn_mask, groups, gamma=gamma, std_normalize=False)
        return one_row_each(episodes, rows(broadcast_turn_advantages(turn_adv, turns, mask), episodes))
