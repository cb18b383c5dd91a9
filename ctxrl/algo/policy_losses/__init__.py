"""Policy losses as registered pure functions: one file each, a registry (``base``), no ``if``.

| name | file | paper |
|---|---|---|
| ``ppo_clip`` | ``ppo.py`` (``policy_loss``) | Schulman et al. 2017; clip-higher (DAPO); dual clip (Ye et al. 2020) |
| ``gspo`` | ``ppo.py`` (``gspo_loss``) | Zheng et al. 2025, GSPO |
| ``cispo`` | ``cispo.py`` | MiniMax 2025, MiniMax-M1 |
| ``gmpo`` | ``gmpo.py`` | Zhao et al. 2025, GMPO |
| ``sapo`` | ``sapo.py`` | Gao et al. 2025, SAPO |
| ``clip_cov``, ``kl_cov`` | ``cov.py`` | Cui et al. 2025, the entropy mechanism of RL for reasoning LMs |
| ``dppo_tv``, ``dppo_kl`` | ``dppo.py`` | Qi et al. 2026, DPPO |

``algo.loss`` names the one a run trains with, its settings in ``[algo.NAME]``. ``get_policy_loss(name)`` returns
the function, ``declared(fn)`` what it declared when registered; every one takes ``(logprobs, old_logprobs,
advantages, mask, *, agg, norm_length, denominator, token_weights, on_device, **its own settings)`` and returns
``(loss, metrics)``
(``base``); ``policy_loss`` and ``gspo_loss`` are defined in ``ctxrl.algo.losses``. The built-ins are named here,
not in ``base``, which they import to register; ``ctxrl.algo.losses`` comes first so that the two losses defined
there (registered by ``ppo``) are listed first.
"""

from ctxrl.algo.policy_losses.base import (
    FIGURES,
    POLICY_LOSSES,
    declared,
    get_policy_loss,
    loss_keywords,
    policy_loss_names,
    register_policy_loss,
)

POLICY_LOSSES.add_builtins("ctxrl.algo.losses", "ctxrl.algo.policy_losses.ppo", "ctxrl.algo.policy_losses.cispo",
                           "ctxrl.algo.policy_losses.gmpo", "ctxrl.algo.policy_losses.sapo",
                           "ctxrl.algo.policy_losses.cov", "ctxrl.algo.policy_losses.dppo")

__all__ = ["FIGURES", "POLICY_LOSSES", "declared", "get_policy_loss", "loss_keywords", "policy_loss_names",
           "register_policy_loss"]
