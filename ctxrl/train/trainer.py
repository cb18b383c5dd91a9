"""The trainer: what a run holds, assembled from its config; a warm start, then RL steps, with evaluations.

``Trainer`` builds the run's parts (the policy and its engine's copy, the rollout worker, the estimator, the
curriculum, the writer, the memory plan) and holds them. One RL step is ``ctxrl.run.step.rl_step`` over it:
collect -> filter -> estimate -> update -> sync the engine -> log, each phase a function of the run there; the
``step``, ``collect``, ``filter``, ``estimate``, ``update`` and ``sync_engine`` methods hand over to them.

``fit`` is the outer loop (``ctxrl.run.loop``): warm start, evaluation, the steps with evaluations and checkpoints
at their cadence, a graceful stop on SIGINT/SIGTERM, the final evaluation and checkpoint. What the default "GRPO"
is: group-normalised outcome advantages (Bessel std), a PPO-clip surrogate with the behaviour log-probs as the old
policy, token-mean aggregation, optional k1/k2/k3 KL to the warm-start policy (off by default), no value function
(docs/algorithms.md).
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ctxrl.algo.estimators import get_estimator
from ctxrl.algo.filters import drop_small_groups  # noqa: F401 - its old path (tests import it from here)
from ctxrl.config import Config, to_toml
from ctxrl.distributed.staleness import lagged_weights
from ctxrl.envs.hooks import available_splits
from ctxrl.errors import CheckpointError, ConfigError
from ctxrl.judge.backends import is_endpoint
from ctxrl.learner.learner import Learner
from ctxrl.learner.memory import MemoryPlan
from ctxrl.learner.policy import Policy, export_merged
from ctxrl.learner.sizing import memory_plan, micro_batch_tokens
from ctxrl.learner.teacher import Teacher, teacher_name
from ctxrl.models.prepare import prepare
from ctxrl.report.progress import Progress
from ctxrl.report.sinks import make_sinks
from ctxrl.report.writer import RunWriter
from ctxrl.rollout.managers import get_manager
from ctxrl.rollout.runners import EpisodeRunner, make_runner
from ctxrl.rollout.spec import RolloutSpec, spec_engine
from ctxrl.rollout.worker import RolloutWorker, spec_env_class, spec_renderer
from ctxrl.run import checkpoint, loop
from ctxrl.run import step as step_module
from ctxrl.run.build import learner_settings
from ctxrl.run.collect import Collected, Collector
from ctxrl.run.evaluation import evaluate_splits
from ctxrl.run.followers import Followers
from ctxrl.run.health import TrainingAborted
from ctxrl.run.preflight import (
    check_before_load,
    check_template_segments,  # noqa: F401 - its old path (tests import it from here)
    check_train_split,
    preflight,
)
from ctxrl.run.roles import OwnRoles, own_roles
from ctxrl.seeds import Seeds
from ctxrl.tasks.curriculum import make_curriculum
from ctxrl.tools.mcp import close_hubs
from ctxrl.train.tiny import prepare_tiny, tiny_tokenizer  # noqa: F401 - prepare_tiny: registers the tiny preparer
from ctxrl.train.warm_start import check_demos, context_demos, warm_start
from ctxrl.types import SPLITS, Episode, TrainSequence

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Everything a run holds (see the module docstring); ``fit`` runs it.

    ``policy`` is the learner's trainable policy (``ctxrl.learner.policy``: full or LoRA, its precision)
    and ``model`` its module; the worker's engine samples with its own copy, updated after every
    optimiser step (``sync_engine``). The learner, its reference and critic are built by
    ``make_learner`` when RL starts.
    """

    def __init__(self, config: Config, run_dir: str | Path, *, progress: Progress | None = None,
                 parallel=None) -> None:
        self.config = config
        self.seeds = Seeds(config.run.seed)
        self.progress = progress or Progress()
        seed_everything(config.run.seed)
        self.spec = RolloutSpec.from_config(config)
        self.device = self.spec.model.device
        self.env_cls = spec_env_class(self.spec)
        self.splits = available_splits(self.env_cls)
        check_train_split(config, self.splits)
        self.context_demos = context_demos(config, self.env_cls)
        check_demos(config, self.env_cls)
        prepare(config.model.name, on_progress=self.progress.stage)  # (a tiny model built once: train() did)
        self.renderer = spec_renderer(self.spec)
        self.tokenizer = self.renderer.tokenizer
        check_before_load(config, self.spec, self.env_cls, self.renderer, under_manager=self.context_demos)
        runner = make_runner(self.spec, self.env_cls, self.renderer)  # (demos: a missing demo file stops the run now)
        advantage = config.algo.advantage
        self.estimator = get_estimator(advantage)(config.algo, config.settings_of("algo", advantage),
                                                  num_attempts=config.meta.num_attempts)
        # On CUDA: the memory plan, before anything large is allocated (a run that cannot fit stops here)
        critic = self.estimator.needs_critic
        self.memory = memory_plan(config, self.device, engine=(parallel is None or parallel.leader)
                                  and config.distributed.backend == "none", critic=critic,
                                  beside=frozen_beside(config, self.estimator, self.device, parallel))
        if self.memory is not None:
            self.progress.message(self.memory.summary())
        self.micro_batch_tokens = self.memory.learner_tokens if self.memory is not None else micro_batch_tokens(
            config, self.device, self.progress, critic=critic)
        """Tokens per learner micro-batch: the user's ``train.max_tokens_per_microbatch``, or what the memory plan
        (CUDA) or the CPU bound chose; the learner, the critic's values, the KL reference and the warm start read it."""
        self.policy = Policy.load(config, self.device, roles=own_roles(config))
        self.model = self.policy.model
        self.own = OwnRoles(own_roles(config), self.policy)  # roles with trainable policies of their own
        self.parallel = parallel
        """Data-parallel learner ranks (``torchrun``): rank 0 (the leader) does everything else; the others only
        take the leader's rows and update with it (``ctxrl.distributed.data_parallel``)."""
        self.followers = Followers(parallel)
        self.leader = parallel is None or parallel.leader
        self.teacher = Teacher.load(self.estimator.options, config, self.tokenizer, self.device) if (
            self.estimator.needs_teacher and self.leader) else None  # (distillation's: it scores the leader's rows)
        self.worker = None if not self.leader else rollout_worker(  # a follower: no engine, no run directory
            config, self.spec, self.policy, self.renderer, self.env_cls, self.memory, runner, self.own)
        self.writer = None
        if self.leader:
            self.writer = RunWriter(run_dir, sinks=make_sinks(config.report, Path(run_dir), name=config.run.name,
                                                              config=config.as_record()))
            self.writer.write_config(to_toml(config))
        self._skipped_reported = False
        self.curriculum = make_curriculum(config.curriculum, config.settings_of("curriculum", config.curriculum.kind))
        self.collector = Collector(self.config, self.worker, self.env_cls, self.curriculum, self.seeds)
        self.lagged = lagged_weights(config.distributed, self.policy) if self.leader else None
        """In one process with ``distributed.max_staleness``: the engine states it plays, held back that many
        versions (``ctxrl.distributed.staleness``)."""
        self.manager = get_manager(config.context.manager)
        self.learner: Learner | None = None
        self.consecutive_skips = 0

    def close(self) -> None:
        """Stop the rollout workers (Ray actors) and what the tools run on (MCP servers, this process's too: a warm
        start plays scripted solutions here); safe to call more than once."""
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()
        close_hubs()

    def sync_engine(self, version: int, *, restored: bool = False) -> None:
        """The engine gets the policy's weights as ``version`` (``ctxrl.run.step.sync_engine``)."""
        step_module.sync_engine(self, version, restored=restored)

    def current_weights(self):
        """Context: the engine plays the learner's current weights inside (``ctxrl.run.step.current_weights``)."""
        return step_module.current_weights(self)

    # -- the outer loop --------------------------------------------------------------------------------
    def fit(self, *, resume: bool = False) -> dict[str, Any]:
        """Warm start (if enabled), evaluate, RL, evaluate again; returns the summary.

        ``resume``: continue from ``checkpoints/latest`` instead (no warm start; the evaluation
        before RL is read back from ``metrics.jsonl``). RL checkpoints are written every
        ``train.checkpoint_every`` steps and when a signal stops the run.
        """
        if not self.leader:
            return self.followers.follow(self.policy, self.make_learner)
        try:
            return loop.run(self, resume)
        finally:
            self.followers.release()  # (nothing to do in one process)
            self.close()  # (a run that failed too: its MCP servers stop with it)

    # -- phases of a run -------------------------------------------------------------------------------
    def warm_start(self, on_step=None) -> dict[str, Any]:
        """Supervised warm start of the policy (``[sft]``); the engine gets the result as policy version 0.

        ``on_step(step, total, loss)`` after each optimiser step (default: the progress display).
        """
        row, demos = warm_start(self.config, self.spec, self.env_cls, self.renderer, self.model,
                                under_manager=self.context_demos, on_step=on_step or self.progress.sft,
                                precision=self.policy.precision, micro_batch_tokens=self.micro_batch_tokens)
        self.own.after_warm_start()
        self.sync_engine(0)
        self.writer.log_metrics(row)
        self.writer.log_samples(0, demos[:2], self.renderer.decode, phase="sft")
        return row

    def evaluate(self, step: int, splits: tuple[str, ...] = SPLITS) -> dict[str, dict[str, float]]:
        """Success (and tool use) on ``eval.tasks`` tasks of each split, greedy by default; logged per split.

        A split the environment has no tasks for (``splits()``) is skipped, and said so once.
        """
        missing = [s for s in SPLITS if s not in self.splits]
        if missing and not self._skipped_reported:
            self._skipped_reported = True
            self.progress.message(f"note: environment {self.config.env.name!r} has no {' or '.join(missing)} tasks: "
                                  "evaluation skips " + ("that split" if len(missing) == 1 else "those splits"))
            self.writer.log_metrics({"phase": "note", "step": step, "skipped_splits": missing})
        with self.current_weights():
            return evaluate_splits(self.worker, self.config, self.writer, step,
                                   tuple(s for s in splits if s in self.splits), self.progress)

    def make_learner(self) -> Learner:
        """The learner over ``policy``: AdamW on what trains, a KL reference (``algo.kl_coef``: a frozen copy, or the
        LoRA base with adapters off), a critic (``needs_critic``)."""
        from ctxrl.learner.critic import Critic

        a, t = self.config.algo, self.config.train
        reference = self.policy.reference() if a.kl_coef > 0 else None
        precision = self.policy.precision
        critic = critic_optimizer = None
        if self.estimator.needs_critic:  # the critic starts as a copy of the warm-started policy
            critic = Critic(self.policy.trainable_copy()).train()
            critic_lr = self.config.settings_of("algo", "gae").critic_lr  # (the critic's settings are [algo.gae]'s)
            critic_optimizer = precision.optimizer(critic.parameters(), lr=critic_lr, weight_decay=t.weight_decay)
        optimizer = precision.optimizer(self.policy.trainable_parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.learner = Learner(self.model, optimizer, learner_settings(self.config, self.micro_batch_tokens),
                               pad_token_id=self.tokenizer.pad_token_id, reference=reference,
                               precision=precision, seed=self.seeds.learner, critic=critic,
                               critic_optimizer=critic_optimizer, parallel=self.parallel)
        self.own.make_learners(self, reference)
        return self.learner

    def save_final(self, name: str) -> Path:
        """The policy's weights and tokenizer under ``checkpoints/``, for other tools to load: full fine-tuning, an
        HF checkpoint in ``model.dtype`` in transformers' own layout (which may shard or convert to the hub's names;
        step checkpoints keep the module's names); LoRA, the adapters in PEFT's format (a role's own in ``ROLE/``),
        and with ``lora.export_merged`` the base with the shared adapters merged in (``NAME-merged``)."""
        checkpoint.refuse_non_finite(self, name)
        path = self.policy.save(self.writer.dir / "checkpoints" / name, self.tokenizer)
        if self.policy.is_lora and self.config.lora.export_merged:
            export_merged(path, path.with_name(f"{name}-merged"), dtype=self.config.model.dtype)
        return path

    # -- one RL step (``ctxrl.run.step``: its phases as functions of the run) --------------------------
    def step(self, step: int) -> dict[str, Any]:
        """One RL step (collect -> filter -> estimate -> update -> sync -> log); returns its metrics row."""
        return step_module.rl_step(self, step)

    def collect(self, step: int) -> Collected:
        return step_module.collect(self, step)

    def filter(self, step: int, collected: Collected) -> list[Episode]:
        return step_module.keep_trainable(self, step, collected)

    def estimate(self, valid: list[Episode], metrics: dict[str, Any]) -> tuple[list[TrainSequence], int]:
        return step_module.estimate(self, valid, metrics)

    def update(self, rows: list[TrainSequence], step: int) -> dict[str, float]:
        """The learner's update (``ctxrl.run.step.update``), then the engine's weights as ``step + 1``."""
        figures = step_module.update(self, rows, step)
        self.sync_engine(step + 1)
        return figures


def rollout_worker(config: Config, spec: RolloutSpec, policy: Policy, renderer, env_cls: type,
                   memory: MemoryPlan | None, runner: EpisodeRunner, own: OwnRoles | None = None):
    """The run's rollout worker: Ray actors that load the model themselves (``distributed.backend = "ray"``; the
    weights follow by ``load_weights``; each builds its own episode runner from the spec), or one in this process
    over an engine with its own copy of the policy, sized by the memory plan where there is one, playing through
    ``runner`` (and an engine per role with a policy of its own, ``own``)."""
    d = config.distributed
    if d.backend == "ray":
        from ctxrl.distributed.pool import RayRolloutPool

        return RayRolloutPool(spec, workers=d.rollout_workers, address=d.address or None, timeout_s=d.timeout_s)
    sizes = {} if memory is None else {"max_batch_size": memory.kv_slots, "prefill_tokens": memory.prefill_tokens}
    engine = spec_engine(spec, policy.engine_model(), renderer, **sizes)
    return RolloutWorker(spec, engine, renderer, env_cls, runner=runner,
                         role_engines=own.engines(spec, renderer) if own is not None else None)


def train(config: Config, run_dir: str | Path, *, progress: Progress | None = None,
          resume: bool = False) -> dict[str, Any]:
    """Check ``run_dir``, build a ``Trainer`` and ``fit`` it: what ``ctxrl train`` runs."""
    run_dir = Path(run_dir)
    progress = progress or Progress()
    parallel = data_parallel(config, resume)
    try:
        return _train(config, run_dir, progress, resume, parallel)
    except Exception as exc:  # a run directory that cannot be written: one line, with how to go on
        problem = loop.storage_error(exc, run_dir, config.train.checkpoint_every)
        if problem is None:
            raise
        raise problem from exc
    finally:
        if parallel is not None:
            parallel.close()


def _train(config: Config, run_dir: Path, progress: Progress, resume: bool, parallel) -> dict[str, Any]:
    problem = None
    if parallel is None or parallel.leader:  # (the followers load what the leader prepared)
        try:
            preflight(config)  # every check that needs no model, before one is built, converted or downloaded
            if resume and not (run_dir / "checkpoints").exists():
                raise CheckpointError(f"--resume: {run_dir} holds no run (no checkpoints directory); check --run-dir")
            metrics = run_dir / "metrics.jsonl"
            if not resume and metrics.exists() and metrics.stat().st_size > 0:
                raise CheckpointError(f"{run_dir} already holds a run ({metrics} is not empty); continue it with "
                                      "--resume, or choose another --run-dir: a new run would mix its logs with the "
                                      "old one's")
            check_before_build(config)
            prepare_model(config.model.name, progress)
            if teacher_name(config):  # (a tiny teacher built, a GGUF one converted, before the student loads)
                prepare_model(teacher_name(config), progress)
            judge = config.settings_of("reward", "judge").target
            if judge and not is_endpoint(judge):  # (a local judge, the same way)
                prepare_model(judge, progress)
        except Exception as exc:  # noqa: BLE001 - the followers must hear of any failure, then it is raised here
            problem = exc
    if parallel is not None:
        message = parallel.broadcast_object(None if problem is None else str(problem))
        if message is not None and problem is None:
            raise TrainingAborted(f"rank 0 stopped before training: {message}")
    if problem is not None:
        raise problem
    return Trainer(config, run_dir, progress=progress, parallel=parallel).fit(resume=resume)


def data_parallel(config: Config, resume: bool = False):
    """The learner's data-parallel ranks when ``torchrun`` started this process (``WORLD_SIZE`` > 1), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if config.distributed.backend != "none":
        raise ConfigError("a data-parallel learner (torchrun) runs its rollouts in rank 0's process; it cannot be "
                          f"combined with distributed.backend={config.distributed.backend!r} yet")
    if own_roles(config):
        raise ConfigError("roles.policies ROLE=own (a LoRA adapter per role) is not supported under torchrun yet: "
                          "train it in one process")
    if resume:
        raise ConfigError("--resume under torchrun is not supported yet: resume the run in one process (the "
                          "checkpoint is the same whatever the number of learner ranks)")
    from ctxrl.distributed.data_parallel import DataParallel
    from ctxrl.models.loader import resolve_device

    return DataParallel.from_environment(resolve_device(config.model.device))


def frozen_beside(config: Config, estimator, device: str, parallel) -> tuple[tuple[str, str], ...]:
    """``(name, dtype)`` of the frozen models that will share ``device`` with the policy in this process: a
    distillation teacher without a device of its own, a local judge of an in-process rollout worker (their weights
    count in the memory plan)."""
    if not (parallel is None or parallel.leader):
        return ()
    out = []
    if estimator.needs_teacher and estimator.options.device in ("", device):
        out.append((estimator.options.teacher, estimator.options.dtype or config.model.dtype))
    judge = config.settings_of("reward", "judge").target
    if judge and not is_endpoint(judge) and config.distributed.backend == "none":
        out.append((judge, config.model.dtype))
    return tuple(out)


def check_before_build(config: Config) -> None:
    """When the policy is a tiny model not built yet (minutes on a CPU), what ``check_before_load`` refuses, on its
    tokenizer alone (seconds): demos that cannot fit the budget stop the run before the build, not after it. The
    ``Trainer`` checks again with the built model's own tokenizer."""
    from ctxrl.models.loader import parse_tiny
    from ctxrl.models.tiny import is_built

    tiny = parse_tiny(config.model.name)
    if tiny is None or is_built(tiny):
        return
    spec = RolloutSpec.from_config(config)
    env_cls = spec_env_class(spec)
    renderer = spec_renderer(spec, tokenizer=tiny_tokenizer(tiny))
    check_before_load(config, spec, env_cls, renderer, under_manager=context_demos(config, env_cls))


def prepare_model(name: str, progress: Progress) -> None:
    """Build the tiny model, or convert a GGUF checkpoint (a named real model's included), now if it is not
    cached yet, showing how far it is (minutes on a CPU for the tiny model, seconds for a GGUF)."""
    from ctxrl.models.cache import cache_root
    from ctxrl.models.loader import adapter_base, parse_tiny, resolves_to_cache
    from ctxrl.models.tiny import is_built

    base = adapter_base(name) or name  # (a LoRA checkpoint's base, named as its run named it)
    if not resolves_to_cache(base):
        return
    spec = parse_tiny(base)
    if spec is not None and not is_built(spec):
        progress.message(f"building the tiny model {base!r} once (a few minutes on a CPU; cached in {cache_root()})")
    prepare(name, on_progress=progress.stage)
