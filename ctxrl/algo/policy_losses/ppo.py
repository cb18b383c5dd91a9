"""PPO-clip (with DAPO's clip-higher and the dual clip) and GSPO, under the names ``algo.loss`` has used so far.

Their definitions stay in ``ctxrl.algo.losses`` (``policy_loss``, ``gspo_loss``), where the learner imports them;
this file only names them in ``POLICY_LOSSES``, so that the registry reaches every loss. Both take PPO's clip range,
``algo.clip_low`` / ``algo.clip_high``. The dual clip is ``ppo_clip`` with ``[algo.ppo_clip] dual_clip = c > 1``,
not a loss of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ctxrl.algo.losses import gspo_loss, policy_loss
from ctxrl.algo.policy_losses.base import register_policy_loss
from ctxrl.settings import NON_NEGATIVE


@dataclass(frozen=True)
class PPOClipSettings:
    """``[algo.ppo_clip]``."""

    dual_clip: float = field(default=0.0, metadata=NON_NEGATIVE)
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -c * A (Ye et al. 2020; 0 = off;
    verl's ``clip_ratio_c``)."""

    def __post_init__(self) -> None:
        if 0.0 < self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or 0 = off), got {self.dual_clip!r}")


register_policy_loss("ppo_clip", settings=PPOClipSettings, shared_clips=True)(policy_loss)
register_policy_loss("gspo", shared_clips=True)(gspo_loss)
