"""PPO-clip (with DAPO's clip-higher and the dual clip) and GSPO, under the names ``algo.loss`` has used so far.

Their definitions stay in ``ctxrl.algo.losses`` (``policy_loss``, ``gspo_loss``), where the learner imports them;
this file only names them in ``POLICY_LOSSES``, so that the registry reaches every loss. The dual clip is
``ppo_clip`` with ``dual_clip = c > 1``, not a loss of its own.
"""

from __future__ import annotations

from ctxrl.algo.losses import gspo_loss, policy_loss
from ctxrl.algo.policy_losses.base import register_policy_loss

register_policy_loss("ppo_clip")(policy_loss)
register_policy_loss("gspo")(gspo_loss)
