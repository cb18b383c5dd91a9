"""Context spaces of environment variants and the train / heldout / ood splits."""

from ctxrl.tasks.space import (
    ContextError,
    ContextParam,
    ContextSpace,
    sample_tasks,
    split_of,
    stable_hash,
    task_id,
)

__all__ = ["ContextError", "ContextParam", "ContextSpace", "sample_tasks", "split_of", "stable_hash", "task_id"]
