"""``train(config, run_dir)``: what ``ctxrl train`` runs: check the run directory, build the run, fit it.

A run is built by ``ctxrl.run.build.build(config, run_dir) -> Run`` (``ctxrl.run.parts``: the assembled parts, no
logic) and run by functions of it: ``ctxrl.run.loop.fit`` (warm start, evaluations, the RL steps, checkpoints, the
final save), ``ctxrl.run.step.rl_step`` (collect -> filter -> estimate -> update -> sync the engine -> log). What
the default "GRPO" is: group-normalised outcome advantages (Bessel std), a PPO-clip surrogate with the behaviour
log-probs as the old policy, token-mean aggregation, optional k1/k2/k3 KL to the warm-start policy (off by
default), no value function (docs/algorithms.md).

Before anything is built, ``train`` checks what needs no model (``preflight``), refuses a run directory that holds
another run (or none, on ``--resume``), and builds or converts the models once with their progress shown
(``prepare_model``); under ``torchrun`` it joins the learner's data-parallel ranks (``data_parallel``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ctxrl.algo.filters import drop_small_groups  # noqa: F401 - its old path (tests import it from here)
from ctxrl.config import Config
from ctxrl.errors import CheckpointError, ConfigError
from ctxrl.judge.backends import is_endpoint
from ctxrl.learner.teacher import teacher_name
from ctxrl.models.prepare import prepare
from ctxrl.report.progress import Progress
from ctxrl.rollout.spec import RolloutSpec
from ctxrl.rollout.worker import spec_env_class, spec_renderer
from ctxrl.run import loop
from ctxrl.run.build import (
    build,
    frozen_beside,  # noqa: F401 - its old path (tests import it from here)
)
from ctxrl.run.health import TrainingAborted
from ctxrl.run.preflight import (
    check_before_load,
    check_template_segments,  # noqa: F401 - its old path (tests import it from here)
    preflight,
)
from ctxrl.run.roles import own_roles
from ctxrl.train.tiny import prepare_tiny, tiny_tokenizer  # noqa: F401 - prepare_tiny: registers the tiny preparer
from ctxrl.train.warm_start import context_demos


def train(config: Config, run_dir: str | Path, *, progress: Progress | None = None,
          resume: bool = False) -> dict[str, Any]:
    """Check ``run_dir``, ``build`` the run and ``fit`` it: what ``ctxrl train`` runs."""
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
    return loop.fit(build(config, run_dir, progress=progress, parallel=parallel), resume=resume)


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




def check_before_build(config: Config) -> None:
    """When the policy is a tiny model not built yet (minutes on a CPU), what ``check_before_load`` refuses, on its
    tokenizer alone (seconds): demos that cannot fit the budget stop the run before the build, not after it.
    ``build`` checks again with the built model's own tokenizer."""
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
