"""Advantage estimators as registered objects: one file each, a registry, and the protocol (``base``)."""

from ctxrl.algo.estimators.base import (
                                        Estimator,
                                        EstimatorSettings,
                                        broadcast,
                                        estimator_names,
                                        get_estimator,
                                        register_estimator,
                                        token_advantages,
)

__all__ = ["Estimator", "EstimatorSettings", "broadcast", "estimator_names", "get_estimator", "register_estimator",
           "token_advantages"]
