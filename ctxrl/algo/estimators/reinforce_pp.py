"""``reinforce_pp``: discounted returns of turn rewards over sampled tokens, whitened over the batch (REINFORCE++).

Each turn's reward sits on the last sampled token of that turn (its end-of-turn token, or the
last token of a cut-off turn); ``reinforce_pp_returns`` discounts over sampled tokens only
(``gamma`` per token) and ``masked_whiten`` normalises over every sampled token of the batch. No
group statistics: ``rollout.group_size`` may be 1.
"""

from __future__ import annotations

from ctxrl.algo.estimators.base import Estimator, SegmentBonus, one_row_each, register_estimator, unsegmented
from ctxrl.algo.estimators.tensors import padded, per_token, rows, token_turn_rewards
from ctxrl.algo.returns import masked_whiten, reinforce_pp_returns
from ctxrl.types import Episode, TrainSequence


@register_estimator
class ReinforcePP(Estimator):
    name = "reinforce_pp"
    needs_groups = False
    accepts_token_rewards = True

    def estimate(self, episodes: list[Episode], *, token_rewards: list[list[float]] | None = None,
                 values: list[list[float]] | None = None,
                 segment_bonus: SegmentBonus | None = None) -> list[list[TrainSequence]]:
        if not episodes:
            return []
        unsegmented(self.name, episodes)
        mask, turns = padded(episodes)
        extra = per_token(episodes, token_rewards, mask, "token rewards") * mask
        returns = reinforce_pp_returns(token_turn_rewards(episodes, mask, turns) + extra, mask, self.settings.gamma)
        return one_row_each(episodes, rows(masked_whiten(returns, mask), episodes))
