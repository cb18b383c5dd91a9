"""Every check of a configuration on its own, run once when a config is loaded (``ctxrl.config.from_dict``).

A value out of its choices, a name no registry knows (an estimator, a context manager, a metric sink, a component's
table), and settings that do not combine (a KL penalty in the reward of an estimator that takes no per-token
rewards, trials without the meta estimator, a judge of a multi-role environment, ...) are each a ``ConfigError``
naming the key and the fix. The numbers were checked already, each against its field's metadata, when the
``Config`` was built (``ctxrl.config.Config``): that needs no registry.

This is the one place of the config's path that imports the registries (lazily, inside the checks), after the
packages whose registrations a config may name: ``STAGE_PACKAGES`` and ``run.plugins``. It does not import
``ctxrl.config``, which calls it: it reads the config's sections by name (``ctxrl.sections.SECTIONS``).

What needs more than the config (the environment's tasks, files, packages, the models named, the tokenizer) is
``ctxrl.run.preflight``'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ctxrl.errors import ConfigError
from ctxrl.plugins import import_plugins
from ctxrl.run.components import component_table, env_class
from ctxrl.sections import SECTIONS, AlgoConfig
from ctxrl.settings import settings_table

if TYPE_CHECKING:
    from ctxrl.config import Config

STAGE_PACKAGES = ("ctxrl.meta", "ctxrl.serve.harness", "ctxrl.train.tiny")
"""ctxrl's own stages above the library that register by name: episode runners (trials and annealed
demonstrations; the harness environment's runner) and the ``tiny`` model preparer (``ctxrl.models.prepare``),
imported before a config is checked as ``run.plugins`` are: rollout and the model loader never import them, and a
run finds each by name (``ctxrl.rollout.runners``, ``ctxrl.models.prepare``)."""


def _choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of every choice field, read from where each set is defined (never copied here)."""
    from ctxrl.algo.losses import AGG_MODES, KL_KINDS, OLD_LOGPROBS
    from ctxrl.algo.roles import REWARD_MODES
    from ctxrl.chat.formats import format_names
    from ctxrl.engine.factory import KINDS as ENGINE_KINDS
    from ctxrl.learner.flat import MODES as FLAT_MODES
    from ctxrl.learner.learner import MINI_BATCH_ORDERS
    from ctxrl.learner.shared_prefix.micro_batches import MODES as SHARING_MODES
    from ctxrl.meta.rollout import CARRIES
    from ctxrl.models.loader import DTYPES

    return {"algo.old_logprobs": OLD_LOGPROBS, "algo.kl_kind": KL_KINDS,
            "algo.kl_placement": ("loss", "reward"), "algo.agg": AGG_MODES,
            "model.dtype": DTYPES, "sft.context_demos": ("auto", "on", "off"),
            "train.objective": ("rl", "sft"),
            "meta.carry": CARRIES,
            "report.wandb_mode": ("offline", "online", "disabled"), "model.tool_format": ("auto", *format_names()),
            "train.master_weights": ("float32", "model"), "rollout.engine": ENGINE_KINDS,
            "distributed.backend": ("none", "ray"), "train.flat_forward": FLAT_MODES,
            "train.shared_prefix": SHARING_MODES, "train.mini_batch_order": MINI_BATCH_ORDERS,
            "roles.rewards": REWARD_MODES}


def _registered(key: str, value: str, names: list[str]) -> None:
    if value not in names:
        close = difflib.get_close_matches(value, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{key} must be one of {', '.join(names)} (or a name registered before the config "
                          f"is loaded); got {value!r}{hint}")


def import_stages() -> None:
    """Import ``STAGE_PACKAGES``, whose registrations (episode runners, the tiny model preparer) a command needs."""
    for module in STAGE_PACKAGES:
        importlib.import_module(module)


def validate(config: Config) -> None:
    """Every check of a whole configuration; the first problem is a ``ConfigError`` naming the key."""
    from ctxrl.algo.estimators import estimator_names, get_estimator
    from ctxrl.algo.policy_losses import policy_loss_names
    from ctxrl.report.sinks import sink_names
    from ctxrl.rollout.managers import get_manager, manager_names
    from ctxrl.tasks.curriculum import curriculum_names

    import_stages()
    import_plugins(config.run.plugins)  # their registrations are what the names below are checked against
    _validate_fields(config)
    for key, table in list(config.components.items()):
        config.components[key] = component_table(key, table)
    sink_names(config.report.sinks)
    _registered("algo.advantage", config.algo.advantage, estimator_names())
    _registered("algo.loss", config.algo.loss, policy_loss_names())
    _registered("context.manager", config.context.manager, manager_names())
    _registered("curriculum.kind", config.curriculum.kind, curriculum_names())
    estimator, manager = get_estimator(config.algo.advantage), get_manager(config.context.manager)
    _validate_algo(config, estimator)
    _validate_meta(config, estimator)
    _validate_context(config, estimator, manager)
    _validate_training(config, estimator)
    _validate_distributed(config)
    _validate_judge(config)
    _validate_roles(config, estimator, manager)
    _validate_warm_start(config, manager)
    _validate_inputs(config)
    if config.sft.context_demos == "on" and not manager.scripts_demos():
        raise ConfigError(f"sft.context_demos=on plays demos whose context manager's requests the environment scripts "
                          f"(summarize: its summary hook; fold: its folded hook); context.manager="
                          f"{config.context.manager!r} asks for none; use sft.context_demos=auto or off")


DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
"""What ``model.device`` may name."""
MIN_TEMPERATURE = 1e-3
"""The smallest sampling temperature above 0 (greedy): logits divided by less overflow to infinity."""


def _validate_inputs(config: Config) -> None:
    """Values a run would trip on only later, deep in a traceback: a device, a temperature, a template, an
    environment name, text that TOML or UTF-8 cannot hold."""
    m = config.model
    if not DEVICE.fullmatch(m.device):
        raise ConfigError(f"model.device={m.device!r} is not a device: use auto, cpu, cuda, cuda:N or mps")
    for key, value in (("rollout.temperature", config.rollout.temperature),
                       ("eval.temperature", config.eval.temperature)):
        if 0 < value < MIN_TEMPERATURE:
            raise ConfigError(f"{key}={value!r} is too small to sample at (logits divided by it overflow): use 0 "
                              f"for greedy decoding or at least {MIN_TEMPERATURE:g}")
    _check_template(m.chat_template)
    _check_text(config)
    _check_env_name(config.env.name)


def _check_template(template: str) -> None:
    """``model.chat_template``: a Jinja template that parses, or a path to an existing file (not text that merely
    looks like one, which would be rendered as the template)."""
    if not template:
        return
    if "{" not in template:
        if not Path(template).expanduser().is_file():
            raise ConfigError(f"model.chat_template={template!r} is neither a template (it has no {{% or {{{{) nor "
                              "an existing file; give the template's text or its path")
        return
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"model.chat_template does not parse as a Jinja template (line {exc.lineno}: "
                          f"{exc.message})") from None


def _check_text(config: Config) -> None:
    """Every text setting, a component's table's too, holds text UTF-8 can write (a lone surrogate such as
    ``\\ud800`` cannot)."""
    settings = [(f"{section}.{f.name}", getattr(getattr(config, section), f.name))
                for section in SECTIONS for f in dataclasses.fields(getattr(config, section))]
    settings += [(f"{component}.{key}", value) for component, table in config.components.items()
                 for key, value in table.items()]
    for key, value in settings:
        for text in (value if isinstance(value, list) else [value]):
            if isinstance(text, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in text):
                raise ConfigError(f"{key} holds a lone surrogate (an escape such as \\ud800 that is no character); "
                                  "remove it")


def _check_env_name(name: str) -> None:
    """``env.name`` resolves to an environment class (``module:Class`` names a class, not any attribute), found now
    rather than when the first rollout starts."""
    from ctxrl.envs.base import EnvError

    try:
        found = env_class(name)
    except EnvError as exc:
        raise ConfigError(f"env.name: {exc}") from None
    if not isinstance(found, type):
        raise ConfigError(f"env.name={name!r} names {type(found).__name__} {name.partition(':')[2]!r}, not an "
                          "environment class; a class outside ctxrl is named as 'package.module:ClassName'")


def _validate_fields(config: Config) -> None:
    """Each field on its own: one of its choices (its numbers were checked when the ``Config`` was built)."""
    choices = _choices()
    for section in SECTIONS:
        obj = getattr(config, section)
        for f in dataclasses.fields(obj):
            key, value = f"{section}.{f.name}", getattr(obj, f.name)
            if key in choices and value not in choices[key]:
                raise ConfigError(f"{key} must be one of {', '.join(choices[key])}; got {value!r}")


def _validate_warm_start(config: Config, manager: type) -> None:
    """A format-only warm start (``sft.format_demos_env``) and the SFT-only control (``train.objective=sft``)."""
    c = config.sft
    if config.train.objective == "sft" and config.train.steps > 0 and not c.enabled:
        raise ConfigError("train.objective=sft trains each step on the warm start's demos: it is the SFT-only "
                          "control of a warm-started RL run, so it needs sft.enabled=true")
    if not c.format_demos_env:
        if c.format_demos:
            raise ConfigError(f"sft.format_demos={c.format_demos} needs sft.format_demos_env, the environment that "
                              "plays them (or set sft.format_demos=0)")
        return
    if c.format_demos_env == config.env.name:
        raise ConfigError(f"sft.format_demos_env={c.format_demos_env!r} is the run's own environment; a format-only "
                          "warm start shows the manager on another one (or use sft.context_demos for this one)")
    if not manager.scripts_demos():
        raise ConfigError(f"sft.format_demos_env shows how context.manager scripts its requests, and "
                          f"context.manager={config.context.manager!r} makes none; use summarize, select or fold")
    if c.format_demos <= 0:
        raise ConfigError(f"sft.format_demos_env={c.format_demos_env!r} needs sft.format_demos > 0 (the demos it "
                          "plays)")
    if c.context_demos == "on":
        raise ConfigError("sft.format_demos_env plays this environment's demos with the full context; "
                          "sft.context_demos=on asks for the opposite: set it to auto or off")
    from ctxrl.envs.base import EnvError

    try:
        other = env_class(c.format_demos_env)
    except EnvError as exc:
        raise ConfigError(f"sft.format_demos_env: {exc}") from None
    if not manager.demo_ready(other):
        raise ConfigError(f"sft.format_demos_env={c.format_demos_env!r} has no {manager.demo_hooks()} hook to script "
                          f"{config.context.manager} demos; pick an environment that has one (`ctxrl check-env NAME` "
                          "lists what each environment's hooks enable)")


def _validate_distributed(config: Config) -> None:
    d = config.distributed
    if d.max_staleness > 0:
        if d.backend != "ray" and config.roles.policies and any(p.partition("=")[2].strip() == "own"
                                                                 for p in config.roles.policies):
            raise ConfigError("distributed.max_staleness > 0 in one process holds back the shared policy's weights "
                              "only, and roles.policies gives a role a policy of its own, which would play on-policy; "
                              "set distributed.max_staleness = 0 or distributed.backend = \"ray\"")
        if config.algo.old_logprobs != "recompute":
            raise ConfigError("distributed.max_staleness > 0 trains on episodes of older policies: set "
                              "algo.old_logprobs = \"recompute\" (the decoupled PPO objective: clip against the "
                              "learner's recomputed log-probs, weight by the behaviour ratio with algo.tis_cap)")
        if config.algo.dynamic_sampling:
            raise ConfigError("distributed.max_staleness > 0 does not combine with algo.dynamic_sampling yet")
    if config.rollout.partial_step_tokens > 0:
        _validate_partial(config)


def _validate_partial(config: Config) -> None:
    """Partial rollouts (``rollout.partial_step_tokens``): episodes kept in this process's event loop across steps,
    trained with the decoupled objective; the agent loop's episodes only (``ctxrl.rollout.partial``)."""
    key = "rollout.partial_step_tokens"
    if config.distributed.backend != "none":
        raise ConfigError(f"{key} keeps the episodes it carries over in this process; with distributed.backend="
                          f"{config.distributed.backend} they would live on the workers, which is not built: set "
                          f"distributed.backend=none or {key}=0")
    if config.distributed.max_staleness > 0:
        raise ConfigError(f"{key} continues episodes on the learner's current weights; distributed.max_staleness > 0 "
                          f"holds the engine's weights back as well: set one of them to 0")
    if config.algo.old_logprobs != "recompute":
        raise ConfigError(f"{key} trains episodes whose early turns older weights sampled: set algo.old_logprobs="
                          "\"recompute\" (the decoupled PPO objective; algo.offpolicy corrects the old tokens)")
    if config.algo.dynamic_sampling:
        raise ConfigError(f"{key} does not combine with algo.dynamic_sampling yet: set one of them off")
    if config.rollout.episode_timeout_s > 0:
        raise ConfigError(f"{key}: an episode carried over waits out the update, which the episode deadline "
                          f"(rollout.episode_timeout_s={config.rollout.episode_timeout_s:g}) would count: set "
                          "rollout.episode_timeout_s=0 (tool calls keep their own timeouts)")
    if config.meta.num_attempts > 1 or config.settings_of("meta", "demos").max > 0:
        raise ConfigError(f"{key} plays single episodes of the agent loop, not trials (meta.num_attempts > 1) nor "
                          f"annealed demonstrations (meta.demos.max > 0): set {key}=0 or leave [meta] at one attempt")
    if config.settings_of("reward", "judge").enabled:
        raise ConfigError(f"{key} does not combine with reward.judge yet: set {key}=0 or reward.judge.target=\"\"")
    from ctxrl.envs.base import EnvError
    from ctxrl.envs.roles import is_multi_role

    try:
        env_cls = env_class(config.env.name)
    except EnvError:
        return  # (an unknown environment is the rollout's error, with the known names)
    if is_multi_role(env_cls) or getattr(env_cls, "runner", None):
        what = f"its own runner ({env_cls.runner})" if getattr(env_cls, "runner", None) else "several roles"
        raise ConfigError(f"{key}: environment {config.env.name!r} plays {what}; partial rollouts play the agent "
                          f"loop's episodes only: set {key}=0")


def _validate_judge(config: Config) -> None:
    """A judge's settings that make no sense on their own (its rubric, endpoint and model are preflight's)."""
    judge = config.settings_of("reward", "judge")
    if not judge.enabled:
        return
    if judge.weight == 0:
        raise ConfigError(f"reward.judge.target={judge.target!r} grades every episode, but reward.judge.weight=0 adds "
                          "none of its scores to the reward; set a weight (1 is the default) or "
                          "reward.judge.target=\"\"")
    if judge.target.startswith(("http:", "https:")) and not judge.target.startswith(("http://", "https://")):
        raise ConfigError(f"reward.judge.target={judge.target!r} is not a URL; an endpoint is written "
                          "http://HOST:PORT/v1")
    from ctxrl.envs.base import EnvError
    from ctxrl.envs.roles import is_multi_role

    try:
        env_cls = env_class(config.env.name)
    except EnvError:
        return  # (an unknown environment is the rollout's error, with the known names)
    if is_multi_role(env_cls):
        raise ConfigError(f"reward.judge grades one agent's episodes; environment {config.env.name!r} plays "
                          f"several roles ({', '.join(env_cls.roles)}), whose seats a judge does not grade yet: "
                          "set reward.judge.target=\"\" (docs/judges.md)")


def _validate_loss(config: Config) -> None:
    """The policy loss's declarations against the config: the aggregations it is defined for, PPO's clip range only
    where the loss reads it, and no other loss's table set (it would be ignored)."""
    from ctxrl.algo.policy_losses import POLICY_LOSSES, declared, get_policy_loss

    a = config.algo
    loss = declared(get_policy_loss(a.loss))
    if loss.aggregations is not None and a.agg not in loss.aggregations:
        raise ConfigError(f"algo.loss={a.loss} is defined for algo.agg={' or '.join(loss.aggregations)}; "
                          f"set algo.agg={loss.aggregations[0]} (got {a.agg!r})")
    defaults = AlgoConfig()
    if not loss.shared_clips:
        for key in ("clip_low", "clip_high"):
            if getattr(a, key) != getattr(defaults, key):
                own = loss.Settings is not None and key in {f.name for f in dataclasses.fields(loss.Settings)}
                where = f"set [algo.{a.loss}].{key} instead" if own else f"algo.loss={a.loss} has no clip range"
                readers = [n for n in POLICY_LOSSES.names() if declared(get_policy_loss(n)).shared_clips]
                raise ConfigError(f"algo.{key} is PPO's clip range (read by {', '.join(readers)}), which "
                                  f"algo.loss={a.loss} does not read: {where}")
    for key, table in config.components.items():
        section, _, name = key.partition(".")
        if section == "algo" and name != a.loss and name in POLICY_LOSSES:
            settings = declared(get_policy_loss(name)).Settings
            if settings is not None and table != settings_table(settings()):
                raise ConfigError(f"[{key}] sets the settings of policy loss {name!r}, but algo.loss={a.loss}: "
                                  f"set algo.loss={name}, or leave [{key}] out")


def _validate_offpolicy(config: Config) -> None:
    """``algo.offpolicy``: a registered correction, between recomputed old log-probs and the behaviour ones, not
    with ``tis_cap`` (the older token TIS), and no other correction's table set (it would be ignored)."""
    from ctxrl.algo.offpolicy import OFFPOLICY_CORRECTIONS, correction_settings, offpolicy_correction_names

    a = config.algo
    if a.offpolicy:
        _registered("algo.offpolicy", a.offpolicy, offpolicy_correction_names())
        if a.old_logprobs != "recompute":
            raise ConfigError(f"algo.offpolicy={a.offpolicy} corrects recomputed old log-probs against the behaviour "
                              "ones; set algo.old_logprobs=recompute")
        if a.tis_cap:
            raise ConfigError(f"algo.tis_cap is token TIS, a correction of its own; with algo.offpolicy={a.offpolicy} "
                              "set algo.tis_cap=0 (token TIS by name: algo.offpolicy=token_tis, [algo.token_tis].cap)")
    for key, table in config.components.items():
        section, _, name = key.partition(".")
        if section == "algo" and name != a.offpolicy and name in OFFPOLICY_CORRECTIONS:
            if table != settings_table(correction_settings(name)()):
                raise ConfigError(f"[{key}] sets the settings of off-policy correction {name!r}, but algo.offpolicy="
                                  f"{a.offpolicy or '(none)'}: set algo.offpolicy={name}, or leave [{key}] out")


def _validate_algo(config: Config, estimator: type) -> None:
    """The loss, the old policy, reward shaping and group sizes: what they combine with."""
    from ctxrl.algo.estimators import estimator_names, get_estimator

    a = config.algo
    estimator.check_config(config.settings_of("algo", a.advantage), config)
    _validate_loss(config)
    if a.kl_coef > 0 and a.kl_placement == "reward" and not estimator.accepts_token_rewards:
        raise ConfigError(f"algo.advantage={a.advantage} takes no per-token rewards, so a KL penalty placed in the "
                          "reward would be lost; use algo.kl_placement=loss")
    if a.tis_cap and a.old_logprobs != "recompute":
        raise ConfigError("algo.tis_cap > 0 corrects recomputed old log-probs; set algo.old_logprobs=recompute")
    _validate_offpolicy(config)
    if config.reward.overlong_buffer > config.rollout.max_total_tokens:
        raise ConfigError(f"reward.overlong_buffer ({config.reward.overlong_buffer}) must not exceed "
                          f"rollout.max_total_tokens ({config.rollout.max_total_tokens})")
    if config.rollout.group_size < 2 and config.train.steps > 0 and estimator.needs_groups:
        ungrouped = ", ".join(n for n in estimator_names() if not get_estimator(n).needs_groups)
        raise ConfigError("rollout.group_size must be >= 2: group-relative advantages need at least two "
                          f"episodes per task (or use an algo.advantage without groups: {ungrouped})")


def _validate_training(config: Config, estimator: type) -> None:
    """Precision, LoRA and stops: what they combine with."""
    t, lora = config.train, config.lora
    if config.model.dtype == "float16" and t.master_weights == "model":
        raise ConfigError("model.dtype=float16 with train.master_weights=model would update float16 weights without "
                          "loss scaling (small gradients underflow, updates round away); set "
                          "train.master_weights=float32 (float32 master weights, loss scaling) or "
                          "model.dtype=bfloat16")
    if config.model.dtype == "float16" and config.model.device == "cpu":
        raise ConfigError("model.dtype=float16 trains with loss scaling on CUDA only; on the CPU use bfloat16 or "
                          "float32")
    if lora.rank and config.algo.kl_coef > 0 and config.sft.enabled and config.train.steps > 0:
        raise ConfigError("a LoRA run's KL reference is its base with the adapters switched off, which is the model "
                          "before the warm start, not after it: the penalty would pull RL back past the warm start. "
                          "Set sft.enabled=false (a pretrained policy needs none), algo.kl_coef=0, or lora.rank=0")
    if lora.rank and estimator.needs_critic:
        raise ConfigError(f"lora.rank > 0 with algo.advantage={config.algo.advantage}: the critic would be a second "
                          "full copy of the model, which LoRA is meant to avoid; use a critic-free advantage "
                          "(grpo, rloo, reinforce_pp, ...) or full fine-tuning (lora.rank=0)")
    if lora.rank and not lora.target_modules.strip():
        raise ConfigError("lora.target_modules is empty; use all-linear or module names such as q_proj,v_proj")
    if t.shared_prefix != "off" and t.flat_forward not in ("auto", "off"):
        raise ConfigError(f"train.shared_prefix={t.shared_prefix} runs shared trees through HF's forward pass with an "
                          f"ancestor mask, and train.flat_forward={t.flat_forward} forces ctxrl's flat pass, which "
                          "cannot take one: set train.flat_forward=auto (or off), or train.shared_prefix=off")
    if config.algo.world_model_coef > 0 and t.shared_prefix != "off":
        from ctxrl.learner.settings import WORLD_MODEL_AND_SHARING

        raise ConfigError(WORLD_MODEL_AND_SHARING)
    if any(i < 0 for i in config.rollout.stop_ids):
        raise ConfigError(f"rollout.stop_ids must be token ids (>= 0), got {config.rollout.stop_ids}")
    if any(not s for s in config.rollout.stop_strings):
        raise ConfigError("rollout.stop_strings holds an empty string, which would end every turn at once; remove it")


def _validate_context(config: Config, estimator: type, manager: type) -> None:
    """The context manager's budget and curriculum, and what training on segments needs."""
    from ctxrl.algo.estimators import estimator_names, get_estimator
    from ctxrl.rollout.managers import get_manager, manager_names

    ctx, total = config.context, config.rollout.max_total_tokens
    if manager.keeps_budget(ctx.max_context_tokens):  # fold's is optional: checked when set
        if ctx.max_context_tokens <= 0:
            raise ConfigError(f"context.manager={ctx.manager} needs context.max_context_tokens > 0 "
                              "(the working budget)")
        if ctx.max_context_tokens > total:
            raise ConfigError(f"context.max_context_tokens ({ctx.max_context_tokens}) must not exceed "
                              f"rollout.max_total_tokens ({total})")
        if ctx.budget_start_tokens and not ctx.max_context_tokens <= ctx.budget_start_tokens <= total:
            raise ConfigError(f"context.budget_start_tokens ({ctx.budget_start_tokens}) must lie between "
                              f"context.max_context_tokens ({ctx.max_context_tokens}) and rollout.max_total_tokens "
                              f"({total}): the budget shrinks from it")
        if ctx.max_context_tokens <= config.rollout.max_new_tokens:
            raise ConfigError(f"context.max_context_tokens ({ctx.max_context_tokens}) must exceed "
                              f"rollout.max_new_tokens ({config.rollout.max_new_tokens}): no turn would ever fit")
    elif ctx.budget_start_tokens:
        budgeted = ", ".join(n for n in manager_names() if get_manager(n).uses_budget)
        optional = ", ".join(n for n in manager_names() if get_manager(n).budget_optional)
        budgeted += f"; {optional} with context.max_context_tokens > 0" if optional else ""
        raise ConfigError(f"context.budget_start_tokens applies to context managers with a budget ({budgeted}), "
                          f"not {ctx.manager!r} without one; set it to 0")
    if config.components.get("context.fold", {}).get("branch_reward") and ctx.manager != "fold":
        raise ConfigError(f"context.fold.branch_reward is fold's process reward, so it applies to "
                          f"context.manager=fold only (not {ctx.manager!r}); set it to 0")
    if ctx.budget_start_tokens and ctx.budget_steps <= 0:
        raise ConfigError("context.budget_start_tokens needs context.budget_steps > 0 (the steps it shrinks over)")
    if not manager.rewrites_context:
        return
    if config.algo.agg != "token-mean":
        raise ConfigError(f"context.manager={ctx.manager} trains one sequence per segment; use algo.agg=token-mean, "
                          "where cutting an episode into segments leaves every token's weight unchanged (a "
                          "seq-mean aggregation would count segments, so long episodes would weigh more)")
    if config.algo.kl_coef > 0 and config.algo.kl_placement == "reward":
        raise ConfigError(f"context.manager={ctx.manager} with algo.kl_placement=reward is not supported (the "
                          "penalty would miss closed segments); use algo.kl_placement=loss")
    if not (estimator.one_per_episode or estimator.handles_segments):
        outcome = ", ".join(n for n in estimator_names()
                            if get_estimator(n).one_per_episode or get_estimator(n).handles_segments)
        raise ConfigError(f"context.manager={ctx.manager} cuts episodes into segments: use an algo.advantage with one "
                          f"advantage per episode or rows per segment ({outcome}), not {config.algo.advantage!r}")


def _validate_meta(config: Config, estimator: type) -> None:
    """Trials (meta.num_attempts > 1) and annealed demonstrations: what they combine with."""
    from ctxrl.rollout.managers import get_manager

    m, a = config.meta, config.algo
    training_trials = m.num_attempts > 1 and config.train.steps > 0
    if training_trials and not estimator.credits_attempts:
        raise ConfigError(f"meta.num_attempts={m.num_attempts} trains on trials, whose credit across attempts comes "
                          f"from the meta estimator ([algo.meta]); set algo.advantage=meta (not {a.advantage!r})")
    if estimator.credits_attempts or m.num_attempts > 1 or m.eval_attempts > 1:
        what = (f"algo.advantage={a.advantage}" if estimator.credits_attempts
                else "meta trials (num_attempts or eval_attempts > 1)")
        if get_manager(config.context.manager).rewrites_context:
            raise ConfigError(f"{what} trains one sequence per attempt and does not combine with a context manager "
                              f"inside attempts; set context.manager=full (not {config.context.manager!r}) and bound "
                              "the carried history with meta.max_context_tokens")
    if estimator.credits_attempts:
        if a.agg != "token-mean":
            raise ConfigError(f"algo.advantage={a.advantage} trains one sequence per attempt; use "
                              "algo.agg=token-mean, where a "
                              "token weighs the same however a trial is cut into attempts")
        if a.void_turn_filter:
            raise ConfigError(f"algo.void_turn_filter drops whole episodes; with algo.advantage={a.advantage} it "
                              "would drop whole trials for one void turn, so it is not supported; set it to false")
        rc = config.reward
        judged = config.settings_of("reward", "judge").enabled
        if rc.outcome != 1.0 or rc.overlong_buffer or rc.otc_weight or rc.format_weight or judged:
            raise ConfigError(f"algo.advantage={a.advantage} credits each attempt with the environment's own reward; "
                              "reward shaping (reward.outcome != 1, overlong_buffer, otc_weight, format_weight, judge) "
                              "shapes whole episodes and is not supported with it; leave [reward] at its defaults")
    demos = config.settings_of("meta", "demos")
    if demos.max > 0:
        if demos.steps <= 0:
            raise ConfigError(f"meta.demos.max={demos.max} needs meta.demos.steps > 0, the RL step at which the "
                              "demonstrations have faded to none (0 would give none at any step)")
        if demos.source == "solve" and demos.pool <= demos.max:
            raise ConfigError(f"meta.demos.pool ({demos.pool}) must exceed meta.demos.max ({demos.max}): a task's "
                              "own demo is left out of its prompt, so the pool needs more")
    if m.eval_trials > 1 and max(m.eval_attempts, m.num_attempts) <= 1:
        raise ConfigError(f"meta.eval_trials={m.eval_trials} sets the trials per task of an evaluation in trials; "
                          "set meta.eval_attempts (or num_attempts) > 1 too, or leave eval_trials at 1")
    if demos.source != "solve" and not demos.source.endswith(".jsonl"):
        raise ConfigError(f"meta.demos.source must be solve or a .jsonl file of demonstrations, got {demos.source!r}")


def _validate_roles(config: Config, estimator: type, manager: type) -> None:
    """``[roles]``: only for a multi-role environment, each policy one of its roles' and one it can play."""
    from ctxrl.envs.base import EnvError
    from ctxrl.envs.roles import is_multi_role, opponents_of

    r = config.roles
    try:
        env_cls = env_class(config.env.name)
    except EnvError:
        env_cls = None  # (an unknown environment is the rollout's error, with the known names)
    if env_cls is None or not is_multi_role(env_cls):
        if r.policies or r.rewards != "env" or r.eval_opponents:
            raise ConfigError(f"[roles] applies to multi-role environments (kuhn_poker, propose_solve, ...); "
                              f"environment {config.env.name!r} has one role: leave [roles] out")
        return
    policies = role_policies(r.policies, env_cls.roles)
    scripts = opponents_of(env_cls)
    for where, policy in [*((f"roles.policies {role}", p) for role, p in policies.items()),
                          *(("roles.eval_opponents", p) for p in r.eval_opponents)]:
        _check_policy(where, policy, scripts, env_cls.name, opponent=where == "roles.eval_opponents")
        if policy.startswith("scripted:") and manager.scripted_hook is not None:
            raise ConfigError(f"{where}={policy}: a scripted seat cannot answer context.manager={manager.name}'s "
                              f"{manager.scripted_hook} requests; use context.manager=full or window")
    if all(p not in ("shared", "own") for p in ({role: "shared" for role in env_cls.roles} | policies).values()):
        raise ConfigError("roles.policies pins every role; leave at least one role to a policy that trains (shared, "
                          "or own)")
    own = [role for role, p in policies.items() if p == "own"]
    if own and (config.lora.rank <= 0 or config.distributed.backend != "none"):
        raise ConfigError(f"roles.policies {own[0]}=own trains a LoRA adapter of the role's own beside the shared "
                          "one: it needs lora.rank > 0 and rollouts in this process (distributed.backend=none)")
    if max(config.meta.num_attempts, config.meta.eval_attempts) > 1 or config.settings_of("meta", "demos").max or \
            estimator.credits_attempts:
        raise ConfigError(f"environment {config.env.name!r} has several roles; trials of attempts and annealed "
                          "demonstrations are single-agent (set meta.num_attempts=1, meta.eval_attempts=0, "
                          "meta.demos.max=0 and an algo.advantage other than meta)")


def role_policies(pairs: list[str], roles: tuple[str, ...]) -> dict[str, str]:
    """``roles.policies`` (``ROLE=POLICY`` strings) as a dict, each role one of ``roles`` and named once."""
    out: dict[str, str] = {}
    for pair in pairs:
        role, sep, policy = pair.partition("=")
        if not sep or role.strip() not in roles:
            raise ConfigError(f"roles.policies entry {pair!r} must be ROLE=POLICY with ROLE one of {', '.join(roles)}")
        if role.strip() in out:
            raise ConfigError(f"roles.policies names role {role.strip()!r} twice")
        out[role.strip()] = policy.strip()
    return out


def _check_policy(where: str, policy: str, scripts: dict, env_name: str, *, opponent: bool) -> None:
    from ctxrl.rollout.spec import parse_policy

    try:
        kind, argument = parse_policy(policy)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if opponent and kind in ("shared", "own"):
        raise ConfigError(f"{where}: an opponent is scripted:NAME or frozen:PATH; the trained policies are the learner")
    if kind == "scripted" and argument not in scripts:
        raise ConfigError(f"{where}={policy}: {env_name} has no scripted player {argument!r}; it has "
                          f"{', '.join(scripts) or 'none'}")
    if kind == "frozen" and not Path(argument).is_dir():
        raise ConfigError(f"{where}={policy}: {argument} is not a directory; name a checkpoint of this model "
                          "(RUN/checkpoints/step-N or final)")
