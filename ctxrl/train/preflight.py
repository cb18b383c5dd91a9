"""What every command checks before it builds, converts, downloads or loads a model.

A run that would stop for its config should stop in seconds, not after a tiny model was built for an hour or a
checkpoint downloaded: ``preflight`` checks, in this order, the environment (its name, its data file, the lengths
of its tasks), the splits the command needs, the warm start's demos, the optional packages the config asks for
(metric sinks, Ray), the files it names, and the model (a local path with weights, a named model's package, a hub
name that exists), a distillation teacher and a local judge the same way, and a judge's rubric (and, for an
endpoint, its client package). ``ctxrl config`` runs the same function as ``ctxrl train``, so it never calls valid
what a run refuses.

What it does not check: what needs the tokenizer (the chat template's prefix check, warm-start demos that fit the
context budget: ``trainer.check_before_load``, which still runs before the weights load) and the CUDA memory plan.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ctxrl.config import Config
from ctxrl.envs.hooks import available_splits
from ctxrl.errors import ConfigError, CtxrlError
from ctxrl.models.loader import check_available
from ctxrl.report.sinks import sink_names
from ctxrl.rollout.spec import RolloutSpec
from ctxrl.rollout.worker import spec_env_class
from ctxrl.train.teacher import teacher_name
from ctxrl.train.warm_start import check_demos, context_demos

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
    """A judge's rubric file, and its endpoint's client package or its model (``reward.judge``)."""
    r = config.reward
    if not r.judge:
        return
    from ctxrl.judge.backends import is_endpoint, require_openai
    from ctxrl.judge.rubric import load_rubric

    try:
        load_rubric(r.judge_rubric)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if is_endpoint(r.judge):
        require_openai()
    else:
        check_named(r.judge, "reward.judge")


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
    m = config.meta
    if m.demos_max > 0 and m.demos_source != "solve" and not Path(m.demos_source).expanduser().is_file():
        raise ConfigError(f"meta.demos_source: demonstration file {m.demos_source!r} does not exist")
