"""``Run``: the assembled parts of one run, a plain record with no logic.

``ctxrl.run.build.build(config, run_dir)`` makes one; what a run *does* is functions of it: ``ctxrl.run.step``
(one RL step), ``ctxrl.run.loop`` (the warm start, evaluations, the outer loop, the final save),
``ctxrl.run.checkpoint`` (save and resume), ``ctxrl.run.build.start_learning`` (the learner, when RL starts) and
``ctxrl.run.build.close``. The fields below are the parts, in the order ``build`` makes them, then the state the
step keeps between steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ctxrl.config import Config
    from ctxrl.distributed.data_parallel import DataParallel
    from ctxrl.distributed.staleness import LaggedWeights
    from ctxrl.learner.learner import Learner
    from ctxrl.learner.memory import MemoryPlan
    from ctxrl.learner.policy import Policy
    from ctxrl.learner.teacher import Teacher
    from ctxrl.report.progress import Progress
    from ctxrl.report.writer import RunWriter
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.run.collect import Collector
    from ctxrl.run.followers import Followers
    from ctxrl.run.roles import OwnRoles
    from ctxrl.seeds import Seeds


@dataclass(eq=False, repr=False)
class Run:
    """One run's parts (the module docstring). A follower rank of a data-parallel learner has no ``worker``,
    ``writer``, ``teacher`` or ``lagged`` (None): it only takes the leader's rows and updates with it."""

    config: Config
    seeds: Seeds
    progress: Progress
    spec: RolloutSpec
    """The rollout's limits and models, derived from the config once (``RolloutSpec.from_config``)."""
    device: str
    env_cls: type
    splits: tuple[str, ...]
    """The splits the environment has tasks for (an evaluation skips the others, and says so once)."""
    context_demos: bool
    """Whether the warm start's demos play under the run's context manager."""
    renderer: Any
    tokenizer: Any
    estimator: Any
    memory: MemoryPlan | None
    """The memory plan (CUDA), made before anything large was allocated; None on a CPU."""
    micro_batch_tokens: int
    """Tokens per learner micro-batch: the user's ``train.max_tokens_per_microbatch``, or what the memory plan (CUDA)
    or the CPU bound chose; the learner, the critic's values, the KL reference and the warm start read it."""
    policy: Policy
    """The learner's trainable policy (``ctxrl.learner.policy``: full or LoRA, its precision); the engine samples
    with its own copy, updated after every optimiser step."""
    model: torch.nn.Module
    """``policy.model``."""
    own: OwnRoles
    """Roles with trainable policies of their own (``roles.policies ROLE=own``)."""
    parallel: DataParallel | None
    """Data-parallel learner ranks (``torchrun``): rank 0 (the leader) does everything else."""
    followers: Followers
    leader: bool
    teacher: Teacher | None
    worker: Any
    """The rollout worker (in this process, or Ray actors); None on a follower."""
    writer: RunWriter | None
    curriculum: Any
    collector: Collector
    lagged: LaggedWeights | None
    """In one process with ``distributed.max_staleness``: the engine states it plays, held back that many versions."""
    manager: Any
    learner: Learner | None = None
    """Made by ``start_learning`` when RL starts."""
    consecutive_skips: int = 0
    """RL steps in a row whose every update was skipped (non-finite); ``train.max_consecutive_skips`` aborts."""
    skipped_reported: bool = False
    """Whether the splits an evaluation skips were said already."""
