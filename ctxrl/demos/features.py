"""Which optional features an environment's hooks enable: what ``ctxrl check-env NAME`` prints.

The hooks themselves are declared in ``ctxrl.envs.hooks``; the context managers declare theirs as they register
(``fold``'s ``folded``), so this module, above both, lists them all.
"""

from __future__ import annotations

from ctxrl.envs.hooks import HOOKS, flag, has_trial_hooks, hook
from ctxrl.rollout.managers import manager_names


def features(env_cls: type) -> dict[str, bool]:
    """Which optional features an environment's hooks enable (what ``check-env`` prints)."""
    manager_names()  # the built-in managers declare their hooks (folded) as they register
    declared = {h.feature: hook(env_cls, h.name) is not None for h in HOOKS.values() if h.feature}
    return {
        "warm start (scripted solve)": callable(getattr(env_cls, "solve", None)),
        "imperfect warm start (shortcut)": hook(env_cls, "shortcut") is not None,
        "over-calling warm start (redundant)": hook(env_cls, "redundant") is not None,
        "demos from other worlds (pretraining_variant)": hook(env_cls, "pretraining_variant") is not None,
        "summary demos (summary)": hook(env_cls, "summary") is not None,
        **declared,
        "trial demos (failure + reflection)": has_trial_hooks(env_cls),
        "note-following trial demos (solve_after)": (has_trial_hooks(env_cls)
                                                     and hook(env_cls, "solve_after") is not None),
        "named actions (names_actions)": flag(env_cls, "names_actions"),
        "built from data (configure)": hook(env_cls, "configure") is not None,
        "tiny-model tokenizer and pre-training text (corpus)": hook(env_cls, "corpus") is not None,
        "only some splits (splits)": hook(env_cls, "splits") is not None,
    }
