"""``turn_loo``: per-turn returns minus a leave-one-out baseline, unbiased when the agent chooses its length.

``turn_loo_advantages`` (``ctxrl.algo.turns``) compares each turn's discounted return (``gamma`` per
turn) with the mean return at the same turn of the *other* episodes of its group that reached it; where
none did, with the mean return at that turn of the batch's episodes of other task groups that reached it
(``task_group_ids``: ``Episode.group_id``, so a match's other seats are left out); where none of those did
either, the turn gets 0. ``estimate`` is given the step's whole batch, which is what that fallback reads.
No std normalisation. ``broadcast_turn_advantages`` puts each turn's advantage on
every sampled token of that turn. Optional per-token rewards (a KL penalty placed in the reward) are summed
per turn and added to the turn rewards before the returns, as ``rloo`` adds them to the outcome.

Why it exists beside ``turn_grpo`` (issue 52): ``turn_grpo`` normalises within the episodes that reached a
turn, a subset chosen by the policy's own earlier actions, by a std that includes the scored return; its
gradient is biased whenever the turn count is a choice. Here the baseline of episode ``i`` is a function of
the other episodes only, so it cannot depend on ``i``'s actions and the gradient is unbiased whatever the turn
counts (the module docstring of ``ctxrl.algo.turns`` derives it; ``tests/test_turn_credit.py`` checks it
exactly and shows ``turn_grpo`` failing the same check). With one turn per episode and groups of two or more
this is ``rloo`` (a group of one gets ``rloo``'s 0 only when it is alone in the batch).
"""

from __future__ import annotations

from ctxrl.algo.estimators.base import Estimator, SegmentBonus, one_row_each, register_estimator, unsegmented
from ctxrl.algo.estimators.tensors import group_ids, padded, per_token, rows, task_group_ids, turn_sums
from ctxrl.algo.turns import broadcast_turn_advantages, episode_turn_tensors, turn_loo_advantages
from ctxrl.types import Episode, TrainSequence


@register_estimator
class TurnLOO(Estimator):
    name = "turn_loo"
    accepts_token_rewards = True

    def estimate(self, episodes: list[Episode], *, token_rewards: list[list[float]] | None = None,
                 values: list[list[float]] | None = None,
                 segment_bonus: SegmentBonus | None = None) -> list[list[TrainSequence]]:
        if not episodes:
            return []
        unsegmented(self.name, episodes)
        mask, turns = padded(episodes)
        extra = per_token(episodes, token_rewards, mask, "token rewards") * mask
        turn_rewards, turn_mask = episode_turn_tensors(episodes)
        turn_rewards = turn_rewards + turn_sums(extra, turns, turn_rewards.shape[1])
        turn_adv = turn_loo_advantages(turn_rewards, turn_mask, group_ids(episodes),
                                       task_group_ids=task_group_ids(episodes), gamma=self.settings.gamma)
        return one_row_each(episodes, rows(broadcast_turn_advantages(turn_adv, turns, mask), episodes))
