"""``build(config, run_dir) -> Run``: a run's parts, assembled from its config in one place.

``build`` checks what it can before anything large loads (the train split, the demos, the budget against the
tokenizer), makes the memory plan on a card before the policy loads, then the policy, the engine's copy inside the
rollout worker, the estimator, the curriculum, the collector and the writer, and returns them as a ``Run``
(``ctxrl.run.parts``). The order is the random streams' order: the seeds are set first and the policy (and any
LoRA adapters) initialised where the ``Trainer`` did before issue 50, so a run is the same run it was.

``start_learning(run)`` makes the learner when RL starts (AdamW on what trains, the KL reference, the critic);
``close(run)`` stops what the run started. ``learner_settings`` computes the few values the learner is told beside
its ``[algo]`` and ``[train]`` sections, once, here, not inside the part that reads them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ctxrl.config import Config
    from ctxrl.learner.learner import Learner, LearnerSettings
    from ctxrl.learner.memory import MemoryPlan
    from ctxrl.learner.policy import Policy
    from ctxrl.report.progress import Progress
    from ctxrl.rollout.runners import EpisodeRunner
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.run.parts import Run
    from ctxrl.run.roles import OwnRoles


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's global random streams from ``seed`` (the first thing ``build`` does)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build(config: Config, run_dir: str | Path, *, progress: Progress | None = None, parallel=None) -> Run:
    """The run's parts (the module docstring). ``parallel``: the data-parallel ranks of a ``torchrun`` job
    (``ctxrl.train.trainer.data_parallel``); a follower rank gets no worker, writer or teacher."""
    from ctxrl.envs.hooks import available_splits
    from ctxrl.models.prepare import prepare
    from ctxrl.report.progress import Progress
    from ctxrl.rollout.runners import make_runner
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import spec_env_class, spec_renderer
    from ctxrl.run.preflight import check_before_load, check_train_split
    from ctxrl.seeds import Seeds
    from ctxrl.train import tiny  # noqa: F401 - registers the tiny model's preparer
    from ctxrl.train.warm_start import check_demos, context_demos

    progress = progress or Progress()
    seed_everything(config.run.seed)
    spec = RolloutSpec.from_config(config)
    env_cls = spec_env_class(spec)
    splits = available_splits(env_cls)
    check_train_split(config, splits)
    under_manager = context_demos(config, env_cls)
    check_demos(config, env_cls)
    prepare(config.model.name, on_progress=progress.stage)  # (a tiny model built once: train() did)
    renderer = spec_renderer(spec)
    check_before_load(config, spec, env_cls, renderer, under_manager=under_manager)
    runner = make_runner(spec, env_cls, renderer)  # (demos: a missing demo file stops the run now)
    estimator = make_estimator(config)
    memory, micro_tokens = plan_memory(config, spec.model.device, estimator, parallel, progress)
    return assemble(config, run_dir, progress=progress, parallel=parallel, seeds=Seeds(config.run.seed), spec=spec,
                    env_cls=env_cls, splits=splits, under_manager=under_manager, renderer=renderer, runner=runner,
                    estimator=estimator, memory=memory, micro_batch_tokens=micro_tokens)


def make_estimator(config: Config):
    """The advantage estimator ``algo.advantage`` names, with its own settings (``[algo.NAME]``)."""
    from ctxrl.algo.estimators import get_estimator

    advantage = config.algo.advantage
    return get_estimator(advantage)(config.algo, config.settings_of("algo", advantage),
                                    num_attempts=config.meta.num_attempts)


def plan_memory(config: Config, device: str, estimator, parallel, progress: Progress) -> tuple[MemoryPlan | None, int]:
    """On CUDA, the memory plan, before anything large is allocated (a run that cannot fit stops here), and the
    learner's micro-batch budget: the plan's, or the CPU bound's."""
    from ctxrl.learner.sizing import memory_plan, micro_batch_tokens

    critic = estimator.needs_critic
    leader = parallel is None or parallel.leader
    memory = memory_plan(config, device, engine=leader and config.distributed.backend == "none", critic=critic,
                         beside=frozen_beside(config, estimator, device, parallel))
    if memory is not None:
        progress.message(memory.summary())
        return memory, memory.learner_tokens
    return None, micro_batch_tokens(config, device, progress, critic=critic)


def assemble(config: Config, run_dir: str | Path, *, progress, parallel, seeds, spec, env_cls, splits, under_manager,
             renderer, runner, estimator, memory, micro_batch_tokens) -> Run:
    """The parts that load or allocate, in ``build``'s order: the policy, the teacher, the rollout worker (with the
    engine's copy), the writer, the curriculum, the collector, the lagged engine states."""
    from ctxrl.config import to_toml
    from ctxrl.distributed.staleness import lagged_weights
    from ctxrl.learner.policy import Policy
    from ctxrl.learner.teacher import Teacher
    from ctxrl.report.sinks import make_sinks
    from ctxrl.report.writer import RunWriter
    from ctxrl.rollout.managers import get_manager
    from ctxrl.run.collect import Collector
    from ctxrl.run.followers import Followers
    from ctxrl.run.parts import Run
    from ctxrl.run.roles import OwnRoles, own_roles
    from ctxrl.tasks.curriculum import make_curriculum

    device = spec.model.device
    policy = Policy.load(config, device, roles=own_roles(config))
    own = OwnRoles(own_roles(config), policy)
    leader = parallel is None or parallel.leader
    teacher = Teacher.load(estimator.options, config, renderer.tokenizer, device) if (
        estimator.needs_teacher and leader) else None  # (distillation's: it scores the leader's rows)
    worker = writer = None
    if leader:  # a follower: no engine, no run directory
        worker = rollout_worker(config, spec, policy, renderer, env_cls, memory, runner, own)
        writer = RunWriter(run_dir, sinks=make_sinks(config.report, Path(run_dir), name=config.run.name,
                                                     config=config.as_record()))
        writer.write_config(to_toml(config))
    curriculum = make_curriculum(config.curriculum, config.settings_of("curriculum", config.curriculum.kind))
    return Run(config=config, seeds=seeds, progress=progress, spec=spec, device=device, env_cls=env_cls,
               splits=splits, context_demos=under_manager, renderer=renderer, tokenizer=renderer.tokenizer,
               estimator=estimator, memory=memory, micro_batch_tokens=micro_batch_tokens, policy=policy,
               model=policy.model, own=own, parallel=parallel, followers=Followers(parallel), leader=leader,
               teacher=teacher, worker=worker, writer=writer, curriculum=curriculum,
               collector=Collector(config, worker, env_cls, curriculum, seeds),
               lagged=lagged_weights(config.distributed, policy) if leader else None,
               manager=get_manager(config.context.manager))


def start_learning(run: Run) -> Learner:
    """The learner over ``run.policy`` when RL starts: AdamW on what trains, a KL reference (``algo.kl_coef``: a
    frozen copy, or the LoRA base with adapters off), a critic (``needs_critic``: a copy of the warm-started policy),
    and each own role's learner; it is ``run.learner`` from here on."""
    from ctxrl.learner.critic import Critic
    from ctxrl.learner.learner import Learner

    config = run.config
    a, t = config.algo, config.train
    reference = run.policy.reference() if a.kl_coef > 0 else None
    precision = run.policy.precision
    critic = critic_optimizer = None
    if run.estimator.needs_critic:
        critic = Critic(run.policy.trainable_copy()).train()
        critic_lr = config.settings_of("algo", "gae").critic_lr  # (the critic's settings are [algo.gae]'s)
        critic_optimizer = precision.optimizer(critic.parameters(), lr=critic_lr, weight_decay=t.weight_decay)
    optimizer = precision.optimizer(run.policy.trainable_parameters(), lr=t.lr, weight_decay=t.weight_decay)
    run.learner = Learner(run.model, optimizer, learner_settings(config, run.micro_batch_tokens),
                          pad_token_id=run.tokenizer.pad_token_id, reference=reference, precision=precision,
                          seed=run.seeds.learner, critic=critic, critic_optimizer=critic_optimizer,
                          parallel=run.parallel)
    run.own.make_learners(run, reference)
    return run.learner


def close(run: Run) -> None:
    """Stop the rollout workers (Ray actors) and what the tools run on (MCP servers, this process's too: a warm start
    plays scripted solutions here); safe to call more than once."""
    from ctxrl.tools.mcp import close_hubs

    stop = getattr(run.worker, "close", None)
    if stop is not None:
        stop()
    close_hubs()


def rollout_worker(config: Config, spec: RolloutSpec, policy: Policy, renderer, env_cls: type,
                   memory: MemoryPlan | None, runner: EpisodeRunner, own: OwnRoles | None = None):
    """The run's rollout worker: Ray actors that load the model themselves (``distributed.backend = "ray"``; the
    weights follow by ``load_weights``; each builds its own episode runner from the spec), or one in this process
    over an engine with its own copy of the policy, sized by the memory plan where there is one, playing through
    ``runner`` (and an engine per role with a policy of its own, ``own``)."""
    from ctxrl.rollout.spec import spec_engine
    from ctxrl.rollout.worker import RolloutWorker

    d = config.distributed
    if d.backend == "ray":
        from ctxrl.distributed.pool import RayRolloutPool

        return RayRolloutPool(spec, workers=d.rollout_workers, address=d.address or None, timeout_s=d.timeout_s)
    sizes = {} if memory is None else {"max_batch_size": memory.kv_slots, "prefill_tokens": memory.prefill_tokens}
    engine = spec_engine(spec, policy.engine_model(), renderer, **sizes)
    return RolloutWorker(spec, engine, renderer, env_cls, runner=runner,
                         role_engines=own.engines(spec, renderer) if own is not None else None)


def frozen_beside(config: Config, estimator, device: str, parallel) -> tuple[tuple[str, str], ...]:
    """``(name, dtype)`` of the frozen models that will share ``device`` with the policy in this process: a
    distillation teacher without a device of its own, a local judge of an in-process rollout worker (their weights
    count in the memory plan)."""
    from ctxrl.judge.backends import is_endpoint

    if not (parallel is None or parallel.leader):
        return ()
    out = []
    if estimator.needs_teacher and estimator.options.device in ("", device):
        out.append((estimator.options.teacher, estimator.options.dtype or config.model.dtype))
    judge = config.settings_of("reward", "judge").target
    if judge and not is_endpoint(judge) and config.distributed.backend == "none":
        out.append((judge, config.model.dtype))
    return tuple(out)


def learner_settings(config: Config, micro_batch_tokens: int | None = None) -> LearnerSettings:
    """The learner's settings for ``config``: its ``[algo]`` and ``[train]`` sections, the sampler's temperature (1 for
    greedy), Dr.GRPO's constant length (the most sampled tokens an episode can have), the distillation top-K weight,
    the critic's value clip (``[algo.gae]``: a critic's settings are GAE's) and the token budget of a micro-batch
    (``micro_batch_tokens``: the memory plan's or the CPU bound's; None takes the user's
    ``train.max_tokens_per_microbatch``), and the policy loss's and the off-policy correction's own settings
    (``[algo.NAME]``). A KL placed in the
    reward is not the loss's (``LearnerSettings.kl_coef``)."""
    from ctxrl.learner.learner import LearnerSettings

    r = config.rollout
    return LearnerSettings(config.algo, config.train, temperature=r.temperature if r.temperature > 0 else 1.0,
                           norm_length=min(config.env.max_turns * r.max_new_tokens, r.max_total_tokens),
                           micro_batch_tokens=(config.train.max_tokens_per_microbatch if micro_batch_tokens is None
                                               else micro_batch_tokens),
                           distill_top_k_coef=distill_top_k_coef(config),
                           vf_clip=config.settings_of("algo", "gae").vf_clip,
                           loss_options=config.settings_of("algo", config.algo.loss),
                           offpolicy_options=(config.settings_of("algo", config.algo.offpolicy)
                                              if config.algo.offpolicy else None))


def distill_top_k_coef(config: Config) -> float:
    """``algo.distill.top_k_coef`` when the run distils with a top-K term (``algo.distill.top_k > 0``), else 0."""
    if config.algo.advantage != "distill":
        return 0.0
    options = config.settings_of("algo", "distill")
    return float(options.top_k_coef) if options.top_k else 0.0
