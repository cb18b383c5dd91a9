"""Advantage estimators as registered objects: one file each, a registry, and the protocol (``base``).

The built-ins are named here, not in ``base``, which they import to register (``Registry.add_builtins``).
"""

from ctxrl.algo.estimators.base import (
                                        ESTIMATORS,
                                        Estimator,
                                        broadcast,
                                        estimator_names,
                                        get_estimator,
                                        register_estimator,
                                        token_advantages,
)

ESTIMATORS.add_builtins("ctxrl.algo.estimators.outcome", "ctxrl.algo.estimators.reinforce_pp",
                        "ctxrl.algo.estimators.turn_grpo", "ctxrl.algo.estimators.turn_loo",
                        "ctxrl.algo.estimators.gae", "ctxrl.algo.estimators.meta",
                        "ctxrl.algo.estimators.distill", "ctxrl.algo.estimators.rae")

__all__ = ["Estimator", "broadcast", "estimator_names", "get_estimator", "register_estimator",
           "token_advantages"]
