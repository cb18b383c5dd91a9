"""What a rollout needs to know, as plain data: the ``RolloutSpec`` (once per run) and ``RolloutRequest`` (per batch).

These are the only things rollout code reads. ``RolloutSpec.from_config`` builds the spec once
from the run's configuration: the model to load, the environment, the sampling settings and
episode limits of training and of evaluation (each with its context manager), the trial settings
(meta-RL), the annealed demonstrations and the judge of training episodes. A ``RolloutRequest`` says
what to play now: which tasks, how many episodes each, the seed, the phase, and the step's curriculum
(turn cap, context budget). Both round-trip through JSON exactly (``to_dict`` / ``from_dict``), so a ``RolloutWorker``
in another process, on a Ray actor or behind an HTTP endpoint plays exactly what an in-process
one would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ctxrl.judge.spec import JudgeSettings
from ctxrl.plain import PlainData, project
from ctxrl.rollout.managers.base import ContextPolicy
from ctxrl.sections import SHARED, EnvConfig, LoRAConfig, MetaConfig, ModelConfig, RolesConfig, RolloutConfig
from ctxrl.seeds import Seeds
from ctxrl.types import Task

PHASES = ("train", "eval")
OWN = "own"
POLICY_KINDS = (SHARED, OWN, "scripted", "frozen")
"""Who plays a role of a multi-role environment (``roles.policies``): the run's policy (``shared``), a trainable
policy of the role's own (``own``: a LoRA adapter per role, ``ctxrl.run.roles``), the environment's
scripted player ``scripted:NAME``, or a checkpoint that never trains ``frozen:PATH``."""


def parse_policy(text: str) -> tuple[str, str]:
    """``(kind, argument)`` of a role's policy (``POLICY_KINDS``); a bad one is a ``ValueError`` saying the forms."""
    kind, _, argument = text.partition(":")
    if kind not in POLICY_KINDS or (kind in (SHARED, OWN)) != (argument == ""):
        raise ValueError(f"policy {text!r} must be shared, own (a LoRA adapter of the role's own), scripted:NAME "
                         "(one of the environment's opponents()) or frozen:PATH (a checkpoint directory)")
    return kind, argument


DEFAULT_ENGINE_BATCH = 128
"""The engine's batch when ``rollout.max_batch_size`` is 0 (sized by the run) and no memory plan sizes it: a CPU
run, or Ray rollout workers."""


@dataclass(frozen=True)
class RolloutLimits(PlainData):
    """Sampling settings and the limits of one episode."""

    max_turns: int = 4
    max_new_tokens: int = 64
    max_total_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    """Token ids that end a turn besides the renderer's end-of-turn ids (``rollout.stop_ids``)."""
    stop_strings: tuple[str, ...] = ()
    """Texts that end a turn once sampled (``rollout.stop_strings``)."""
    timeout_s: float = 0.0
    """Wall-clock deadline of the whole episode (set-up, model and tool time); 0 = none."""
    context: ContextPolicy = ContextPolicy()
    """The context manager and its settings."""


@dataclass(frozen=True)
class RolloutSpec(PlainData):
    """Everything rollout code reads, fixed for a run (see the module docstring)."""

    model: ModelConfig = ModelConfig(device="cpu")
    """The ``[model]`` section, its device resolved (``auto``: the device this machine has): the policy a worker
    loads (``ctxrl.models.loader``) when it is not handed an engine, its chat template and tool-call format."""
    env: EnvConfig = EnvConfig()
    """The ``[env]`` section: the environment (registered name or ``module:Class``), the options of environments
    built from data, and the MCP servers whose tools the policy gets beside the environment's own
    (``env.mcp_*``; ``ctxrl.envs.mcp``)."""
    env_options: dict[str, Any] = field(default_factory=dict)
    """The environment's own table (``[env.NAME]``), read into its ``Settings`` (``configured_env_class``)."""
    train: RolloutLimits = RolloutLimits()
    eval: RolloutLimits = RolloutLimits(temperature=0.0)
    meta: MetaConfig = MetaConfig()
    """The ``[meta]`` section: how a trial of attempts is played (``ctxrl.meta.rollout``); each phase's trial budget
    is ``attempts_of(meta, phase)``."""
    demos: dict[str, Any] = field(default_factory=dict)
    """The annealed demonstrations' table (``[meta.demos]``, as plain data like ``env_options``), which the ``meta``
    runner reads into ``ctxrl.meta.anneal.DemoSettings``; empty: its defaults (none)."""
    rollout: RolloutConfig = RolloutConfig()
    """The ``[rollout]`` section: the engine (``engine``), its batch (``max_batch_size``), the sandboxed Python
    interpreters of the worker's process (``sandbox_workers``, ``ctxrl.tools.python``)."""
    seed: int = 0
    """The run's seed (``run.seed``), from which the worker's own streams derive (``ctxrl.seeds.Seeds``)."""
    plugins: str = ""

    @property
    def max_demos(self) -> int:
        """Annealed demonstrations per training prompt at step 0 (``meta.demos.max``); 0: none."""
        return int(self.demos.get("max", 0))
    """Modules a worker imports before it reads the spec (``run.plugins``): where custom extension points live."""
    judge: JudgeSettings = JudgeSettings()
    """The judge that grades training episodes (its table ``[reward.judge]``; off when its target is empty)."""
    roles: RolesConfig = RolesConfig()
    """Who plays each role of a multi-role environment, and how the seats' rewards relate (``[roles]``)."""
    lora: LoRAConfig = LoRAConfig()
    """A LoRA run's adapters (the ``[lora]`` section): a worker wraps the model it loads the same way, so the
    learner's adapters fit it."""

    @property
    def max_batch_size(self) -> int:
        """Largest batch of concurrent requests the engine decodes together (``rollout.max_batch_size``, or
        ``DEFAULT_ENGINE_BATCH`` where the config leaves it to the run, 0, and no memory plan sizes it)."""
        return self.rollout.max_batch_size or DEFAULT_ENGINE_BATCH

    @property
    def engine_seed(self) -> int:
        """The engine's stream for requests that bring no seed."""
        return Seeds(self.seed).engine

    @classmethod
    def from_config(cls, config: Any) -> RolloutSpec:
        """The spec of a run's ``Config`` (``model.device = "auto"`` resolved to the device this machine has)."""
        from ctxrl.envs.registry import settings_name
        from ctxrl.models.loader import resolve_device

        c, r = config.context, config.rollout

        def context(phase: str) -> ContextPolicy:
            return ContextPolicy(c.manager, c.max_context_tokens, phase=phase,
                                 options=dict(config.components.get(f"context.{c.manager}", {})))

        train = project(RolloutLimits, r, max_turns=config.env.max_turns, timeout_s=r.episode_timeout_s,
                        context=context("train"))
        evaluation = project(RolloutLimits, r, max_turns=config.env.max_turns, timeout_s=r.episode_timeout_s,
                             temperature=config.eval.temperature, top_p=1.0, top_k=0,  # (evaluation never used these)
                             context=context("eval"))
        return cls(
            model=dataclasses.replace(config.model, device=resolve_device(config.model.device)), env=config.env,
            env_options=dict(config.components.get(f"env.{settings_name(config.env.name)}", {})),
            train=train, eval=evaluation, meta=config.meta, demos=dict(config.components.get("meta.demos", {})),
            rollout=r, seed=config.run.seed, plugins=config.run.plugins,
            judge=config.settings_of("reward", "judge"), roles=config.roles,
            lora=config.lora)


def spec_engine(spec: RolloutSpec, model, renderer, *, max_batch_size: int | None = None,
                prefill_tokens: int | None = None):
    """The engine ``spec`` asks for, serving ``model`` (which it takes over) with ``renderer``'s ids.

    ``max_batch_size`` and ``prefill_tokens`` replace the spec's batch and the fast engine's default prefill
    chunk (a CUDA run's memory plan sizes them: ``ctxrl.learner.memory``)."""
    from ctxrl.engine.factory import make_engine

    return make_engine(model, kind=spec.rollout.engine, pad_token_id=renderer.tokenizer.pad_token_id,
                       max_batch_size=max_batch_size or spec.max_batch_size, seed=spec.engine_seed,
                       max_total_tokens=max(spec.train.max_total_tokens, spec.eval.max_total_tokens),
                       decode=renderer.decode, prefill_tokens=prefill_tokens)


@dataclass(frozen=True)
class RolloutRequest(PlainData):
    """One batch to play: ``group_size`` episodes (or trials) of each task, all concurrently.

    Episode ``k`` of ``tasks[i]`` gets group id ``group_offset + task_offset + i`` and seed
    ``episode_seed(seed, task_offset + i, k)``. ``phase`` picks the spec's training or evaluation settings;
    training prompts get annealed demonstrations by ``step`` (episode ``first_episode + i *
    group_size + k`` of the step), evaluation never does. ``max_turns`` and ``context_budget``
    override the phase's (a curriculum's value for this step); None keeps them.
    """

    tasks: list[Task] = field(default_factory=list)
    group_size: int = 1
    seed: int = 0
    phase: str = "train"
    step: int = 0
    first_episode: int = 0
    group_offset: int = 0
    max_turns: int | None = None
    context_budget: int | None = None
    task_offset: int = 0
    """These tasks are a shard of a larger request, from its task ``task_offset`` on: episode ``k`` of
    ``tasks[i]`` is played (seeded, grouped, given demonstrations) as task ``task_offset + i`` of the whole
    (``ctxrl.distributed``: a request split across rollout workers plays exactly the episodes it would whole)."""
    policies: dict[str, str] = field(default_factory=dict)
    """Role -> policy for this request's matches (a multi-role environment), over the spec's ``roles.policies``:
    evaluation against an opponent pins the roles the learner does not play."""

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, not {self.phase!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")

    def limits(self, spec: RolloutSpec) -> RolloutLimits:
        """The phase's limits with this request's turn cap and context budget."""
        limits = spec.train if self.phase == "train" else spec.eval
        if self.max_turns is not None:
            limits = dataclasses.replace(limits, max_turns=self.max_turns)
        if self.context_budget is not None:
            limits = dataclasses.replace(limits, context=dataclasses.replace(
                limits.context, max_context_tokens=self.context_budget))
        return limits

    def attempts(self, spec: RolloutSpec) -> int:
        """The trial budget of this request's phase (``attempts_of``)."""
        return attempts_of(spec.meta, self.phase)

    def meta(self, spec: RolloutSpec) -> MetaConfig:
        """The ``[meta]`` section with this phase's trial budget as ``num_attempts``: what a trial reads."""
        return dataclasses.replace(spec.meta, num_attempts=self.attempts(spec))


def attempts_of(meta: MetaConfig, phase: str) -> int:
    """Attempts per trial in ``phase``: ``meta.num_attempts`` in training, ``meta.eval_attempts`` in evaluation (0:
    the same as training's); 1 = single episodes."""
    return meta.num_attempts if phase == "train" else meta.eval_attempts or meta.num_attempts
