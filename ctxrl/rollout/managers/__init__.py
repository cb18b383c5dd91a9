"""Context managers: what the model sees before each generation as an episode grows.

One file per manager (``full``, ``window``, ``summarize``, ``fold``, ``select``), each registered by name;
``base`` holds the protocol, the ``ContextPolicy`` settings and the registry; the built-ins are named here, since
they import ``base`` to register.
"""

from ctxrl.rollout.managers.base import (
                                         MANAGERS,
                                         ContextManager,
                                         ContextPolicy,
                                         Play,
                                         get_manager,
                                         manager_names,
                                         register_manager,
)

MANAGERS.add_builtins("ctxrl.rollout.managers.full", "ctxrl.rollout.managers.window",
                      "ctxrl.rollout.managers.summarize", "ctxrl.rollout.managers.fold",
                      "ctxrl.rollout.managers.select")

__all__ = ["ContextManager", "ContextPolicy", "Play", "get_manager", "manager_names", "register_manager"]
