"""Context managers: what the model sees before each generation as an episode grows.

One file per manager (``full``, ``window``, ``summarize``, ``fold``, ``select``), each registered by name;
``base`` holds the protocol, the ``ContextPolicy`` settings and the registry.
"""

from ctxrl.rollout.managers.base import (
                                         ContextManager,
                                         ContextPolicy,
                                         Play,
                                         get_manager,
                                         manager_names,
                                         register_manager,
)

__all__ = ["ContextManager", "ContextPolicy", "Play", "get_manager", "manager_names", "register_manager"]
