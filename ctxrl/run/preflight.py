"""What every command checks before it builds, converts, downloads or loads a model.

A run that would stop for its config should stop in seconds, not after a tiny model was built for an hour or a
checkpoint downloaded: ``preflight`` checks, in this order, the environment (its name, its data file, the lengths
of its tasks), the splits the command needs, the warm start's demos, the optional packages the config asks for
(metric sinks, Ray), the files it names, and the model (a local path with weights, a named model's package, a hub
name that exists), a distillation teacher and a local judge the same way, and a judge's rubric (and, for an
endpoint, its client package). ``ctxrl config`` runs the same function as ``ctxrl train``, so it never calls valid
what a run refuses. The config on its own was checked when it was loaded (``ctxrl.run.validate``).

Then, once the tokenizer is loaded and before the weights are, ``check_before_load``: what the tokenizer alone can
refuse (the chat template's segments, warm-start demos that fit the context budget, a teacher that tokenizes
otherwise). What it does not check: the CUDA memory plan (``ctxrl.learner.sizing``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from ctxrl.envs.hooks import available_splits
from ctxrl.errors import ConfigError, CtxrlError
from ctxrl.learner.teacher import check_teacher, teacher_name
from ctxrl.models.loader import check_available
from ctxrl.report.sinks import sink_names
from ctxrl.rollout.spec import RolloutSpec
from ctxrl.rollout.worker import spec_env_class
from ctxrl.train.warm_start import check_demos, check_demos_fit, context_demos

if TYPE_CHECKING:
    from ctxrl.config import Config

SINK_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
"""A metric sink -> (the module it imports, the ctxrl extra that installs it)."""


def preflight(config: Config, *, training: bool = True, split: str | None = None) -> type:
    """Every check of ``config`` that needs no model; returns the environment class. ``training``: the run trains
    (it needs train tasks, and its warm start's demos are checked); ``split``: the one split an evaluation asks
    for (``eval --split``)."""
    env_cls = spec_env_class(RolloutSpec.from_config(config))
    have = available_splits(env_cls)
    if training:
        check_train_split(config, have)
        check_demos(config, env_cls)
        context_demos(config, env_cls)
    if split is not None and split not in have:
        raise ConfigError(f"--split {split}: environment {config.env.name!r} has no {split!r} tasks "
                          f"(it has {', '.join(have)})")
    check_packages(config)
    check_files(config)
    check_available(config.model.name)
    teacher = teacher_name(config)
    if teacher:
        check_named(teacher, f"[algo.{config.algo.advantage}] teacher")
    check_judge(config)
    return env_cls


def check_named(name: str, what: str) -> None:
    """``check_available(name)`` for a model the run loads beside the policy, its error naming the setting."""
    try:
        check_available(name)
    except ConfigError:
        raise
    except CtxrlError as exc:  # the loader's own (a missing path, no hub), said for the setting
        raise ConfigError(f"{what}: {exc}") from None


def check_judge(config: Config) -> None:
    """A judge's rubric file, and its endpoint's client package or its model (``[reward.judge]``)."""
    judge = config.settings_of("reward", "judge")
    if not judge.enabled:
        return
    from ctxrl.judge.backends import is_endpoint, require_openai
    from ctxrl.judge.rubric import load_rubric

    try:
        load_rubric(judge.rubric)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if is_endpoint(judge.target):
        require_openai()
    else:
        check_named(judge.target, "reward.judge.target")


def check_train_split(config: Config, have: tuple[str, ...]) -> None:
    if "train" not in have:
        raise ConfigError(f"environment {config.env.name!r} has no 'train' tasks (it has {list(have)}); training "
                          "needs some: label tasks \"split\": \"train\" or leave them unlabelled")


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None in sys.modules
        return False


def check_packages(config: Config) -> None:
    """The optional packages the config asks for: each missing one is an error naming the extra to install."""
    for sink in sink_names(config.report.sinks)[1:]:
        module, extra = SINK_PACKAGES[sink]
        if not installed(module):
            raise ConfigError(f"report.sinks has {sink}, but the {module} package is not installed; "
                              f"pip install -e '.[{extra}]' (in a clone of ctxrl) or remove it from report.sinks")
    if config.distributed.backend == "ray" and not installed("ray"):
        raise ConfigError("distributed.backend=ray, but the ray package is not installed; pip install -e '.[ray]' "
                          "(in a clone of ctxrl) or set distributed.backend=none")


def check_files(config: Config) -> None:
    """Files the config names besides the model and the environment's data (which their own checks read)."""
    demos = config.settings_of("meta", "demos")
    if demos.max > 0 and demos.source != "solve" and not Path(demos.source).expanduser().is_file():
        raise ConfigError(f"meta.demos.source: demonstration file {demos.source!r} does not exist")


def check_before_load(config: Config, spec: RolloutSpec, env_cls: type, renderer, *, under_manager: bool) -> None:
    """What the tokenizer alone can refuse, before the model loads: a template that splits segments where the run
    needs them whole, warm-start demos that do not fit the context budget, a teacher that tokenizes otherwise."""
    check_template_segments(config, renderer)
    check_demos_fit(config, spec, env_cls, renderer, under_manager=under_manager)
    teacher = teacher_name(config)
    if teacher:
        check_teacher(teacher, renderer.tokenizer, student=config.model.name)


def check_template_segments(config: Config, renderer) -> None:
    """Warn when the chat template cuts episodes with user messages into segments that this run cannot train.

    A template that rewrites history at a user message (``ChatRenderer.rewrites_history``) makes
    segments wherever an episode gets one. Trials and context managers are validated for segments
    already (``ctxrl.run.validate``); an environment that replies as the user is not known in advance, so
    this is a warning now rather than a surprise at the first step that meets one.
    """
    from ctxrl.algo.estimators import get_estimator

    estimator = get_estimator(config.algo.advantage)
    problems = []
    if not (estimator.one_per_episode or estimator.credits_attempts or estimator.handles_segments):
        problems.append(f"algo.advantage={config.algo.advantage} (needs one advantage per episode)")
    if config.algo.agg != "token-mean":
        problems.append(f"algo.agg={config.algo.agg} (a seq-mean aggregation would count segments)")
    if config.algo.kl_coef > 0 and config.algo.kl_placement == "reward":
        problems.append("algo.kl_placement=reward (the penalty would miss closed segments)")
    if not problems or not renderer.rewrites_history():
        return
    import warnings

    warnings.warn(f"the chat template of {config.model.name!r} rewrites earlier turns once a user message follows "
                  "(docs/tool-formats.md): an episode that gets one trains as segments, which "
                  + " and ".join(problems) + " cannot do, and the run would stop at that step. If the environment "
                  "can reply as the user, use an outcome estimator (grpo, rloo, ...) with algo.agg=token-mean and "
                  "any KL in the loss", stacklevel=2)
