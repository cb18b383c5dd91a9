"""The warm start: supervised fine-tuning on scripted demonstrations before RL (``[sft]``).

Demonstrations are the environment's scripted solutions played through the real agent loop
(``ctxrl.demos.play.build_demos``), ``sft.shortcut_fraction`` of them deliberately imperfect and
``sft.redundant_fraction`` of them with a tool call too many. Two
kinds can join them:

- *context demos* (``sft.context_demos``): played under the run's context manager when its side
  requests can be scripted (``summarize`` with the environment's ``summary`` hook), so the policy
  has seen a summary request before RL asks for one, or when the manager's whole solutions can be
  (``fold`` with the environment's ``folded`` hook: demos that branch and return);
- *trial demos* (``sft.trial_demos``): a fraction played as scripted trials, a failed attempt, its
  reflection, the solution (``ctxrl.meta.trial_demos``).

``context_demos`` decides (and says why not), ``check_demos_fit`` plays a sample of the demos under the
manager before the model loads (a budget they cannot fit stops the run before any GPU time), ``warm_start``
builds the demos and trains.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

from ctxrl.chat.render import ChatRenderer
from ctxrl.demos.play import DEMO_MAX_TURNS, build_demos, demo_mix_problem
from ctxrl.envs.hooks import has_trial_hooks
from ctxrl.errors import ConfigError
from ctxrl.learner.precision import Precision
from ctxrl.rollout.managers.base import get_manager
from ctxrl.rollout.spec import RolloutLimits, RolloutSpec, attempts_of
from ctxrl.seeds import Seeds
from ctxrl.train.sft import sft_train
from ctxrl.types import Episode


def context_demos(config: Any, env_cls: type) -> bool:
    """Whether the warm start plays its demos under the run's context manager (``sft.context_demos``).

    ``on`` with an environment that cannot script the manager's requests is a config error, raised
    before the model loads; ``auto`` then plays full-context demos, and the warm start says so once.
    """
    manager = get_manager(config.context.manager)
    if config.sft.context_demos == "off" or not manager.scripts_demos() or config.sft.format_demos_env:
        return False  # (a format-only warm start shows the manager on another environment only)
    if manager.demo_ready(env_cls):
        return True
    if config.sft.context_demos == "on":
        raise ConfigError(f"sft.context_demos=on, but environment {config.env.name!r} has no {manager.demo_hooks()} "
                          "hook to script its demos; add one (docs/environments.md) or set sft.context_demos=auto "
                          "or off")
    return False


def check_demos(config: Any, env_cls: type) -> None:
    """A config error, before the model loads, when demos are asked of an environment that cannot script them."""
    c = config.sft
    if not c.enabled:
        return
    problem = demo_mix_problem(env_cls, c.shortcut_fraction, c.redundant_fraction)
    if problem:
        raise ConfigError(problem)
    if c.trial_demos > 0 and not has_trial_hooks(env_cls):
        raise ConfigError(f"sft.trial_demos={c.trial_demos:g}, but environment {config.env.name!r} has "
                          "no failure(task) and reflection(task, messages) hooks to script a trial; add them "
                          "(docs/meta.md) or set sft.trial_demos = 0")


FIT_SAMPLE = 64
"""Demos ``check_demos_fit`` plays before the model loads."""


def check_demos_fit(config: Any, spec: RolloutSpec, env_cls: type, renderer: ChatRenderer, *,
                    under_manager: bool) -> None:
    """A config error, before the model loads, when the warm start's demos do not fit the run's context budget.

    Demos played under a context manager (``context_demos``) must fit its working budget
    (``context.max_context_tokens``, with a turn of ``rollout.max_new_tokens`` free); found only when the warm
    start builds them, a misfit would stop the run after its model loaded. Here ``FIT_SAMPLE`` of them are played
    (scripted, no model: about a second) with ``build_demos``'s own error. Issue 31 lost runs on a GPU to this:
    ``select`` at 384 tokens with SmolLM2's tokenizer leaves a quarter of fact_hunt's demos no room for a turn.
    """
    c = config.sft
    if not c.enabled:
        return
    if c.format_demos_env and c.format_demos > 0:
        try:
            play_format_demos(config, spec, renderer, min(FIT_SAMPLE, c.format_demos))
        except RuntimeError as exc:  # (the demos' budget is sft.format_demos_budget, whatever the message calls it)
            detail = str(exc).replace("context.max_context_tokens", "sft.format_demos_budget")
            raise ConfigError(f"sft.format_demos_env={c.format_demos_env!r}: its demos do not fit "
                              f"sft.format_demos_budget (found before loading the model, on "
                              f"{min(FIT_SAMPLE, c.format_demos)} of them): {detail}") from exc
    if not under_manager or c.demos <= 0:
        return
    try:
        play_demos(config, spec, env_cls, renderer, min(FIT_SAMPLE, c.demos), under_manager=True)
    except RuntimeError as exc:
        raise ConfigError(f"the warm start's demos do not fit the context budget (found before loading the model, "
                          f"on {min(FIT_SAMPLE, c.demos)} of them): {exc}") from exc


def play_demos(config: Any, spec: RolloutSpec, env_cls: type, renderer: ChatRenderer, n: int, *,
               under_manager: bool, seed: int | None = None) -> list[Episode]:
    """``n`` of the warm start's scripted demos (``sft``'s mix; ``seed``, by default the warm start's), played under
    the run's context manager or with the full context; ``build_demos``'s error when one cannot finish."""
    c = config.sft
    seed = Seeds(config.run.seed).warm_start_demos if seed is None else seed
    return asyncio.run(build_demos(env_cls, renderer, n, shortcut_fraction=c.shortcut_fraction,
                                   redundant_fraction=c.redundant_fraction, seed=seed, other_worlds=c.other_worlds,
                                   limits=demo_limits(spec, under_manager)))


def play_format_demos(config: Any, spec: RolloutSpec, renderer: ChatRenderer, n: int, *,
                      seed: int | None = None) -> list[Episode]:
    """``n`` demos of ``sft.format_demos_env`` played under the run's context manager at ``sft.format_demos_budget``
    (a format-only warm start: ``ctxrl.sections.SFTConfig.format_demos_env``); plain solutions, no shortcuts."""
    from ctxrl.envs.registry import get_env_class

    c = config.sft
    limits = demo_limits(spec, True)
    budget = c.format_demos_budget or limits.context.max_context_tokens
    limits = dataclasses.replace(limits, context=dataclasses.replace(limits.context, max_context_tokens=budget))
    seed = Seeds(config.run.seed).format_demos if seed is None else seed
    return asyncio.run(build_demos(get_env_class(c.format_demos_env), renderer, n, seed=seed, limits=limits))


def demo_limits(spec: RolloutSpec, under_manager: bool) -> RolloutLimits | None:
    """The limits demos are played under: the run's context manager at its final budget, or None.

    None: the demos' generous full-context defaults. Under a manager, the run's turn and total
    limits too, since where the manager steps in depends on them; the budget is
    ``context.max_context_tokens`` (a budget curriculum's last and smallest, the one evaluation uses).
    """
    if not under_manager:
        return None
    return dataclasses.replace(spec.train, max_turns=DEMO_MAX_TURNS, temperature=1.0, top_p=1.0, top_k=0,
                               timeout_s=0.0)


def demo_mix(config: Any, spec: RolloutSpec, env_cls: type, renderer: ChatRenderer, n: int, *, under_manager: bool,
             seeds: tuple[int, int, int]) -> list[Episode]:
    """``n`` demos of the warm start's mix, drawn with ``seeds`` (the environment's demos, its scripted trials, the
    format-only warm start's other environment's): ``sft.trial_demos`` of them trials, and the other environment's
    in the proportion ``sft.format_demos / sft.demos`` (so ``n = sft.demos`` gives exactly ``sft.format_demos``).
    The warm start and the SFT-only control (``ctxrl.train.sft_control``) both draw from it."""
    from ctxrl.meta.trial_demos import build_trial_demos

    c = config.sft
    demo_seed, trial_seed, format_seed = seeds
    n_trials = round(n * c.trial_demos)
    demos = play_demos(config, spec, env_cls, renderer, n - n_trials, under_manager=under_manager, seed=demo_seed)
    n_format = round(n * c.format_demos / c.demos) if c.format_demos_env and c.demos else 0
    if n_format:
        demos += play_format_demos(config, spec, renderer, n_format, seed=format_seed)
    if n_trials:
        # the notes say "attempt 2 of K" for the largest K the run plays
        k = max(2, attempts_of(spec.meta, "train"), attempts_of(spec.meta, "eval"))
        policy = dataclasses.replace(spec.meta, num_attempts=k)
        demos += asyncio.run(build_trial_demos(env_cls, renderer, n_trials, policy, seed=trial_seed))
    return demos


def warm_start(config: Any, spec: RolloutSpec, env_cls: type, renderer: ChatRenderer, model, *,
               under_manager: bool, on_step: Callable[[int, int, float], None] | None = None,
               precision: Precision | None = None, micro_batch_tokens: int = 0) -> tuple[dict[str, Any], list[Episode]]:
    """Build the demos and train ``model`` on them (under ``precision``, micro-batches of at most
    ``micro_batch_tokens``: the run's budget, 0 for ``sft.batch_size`` rows); returns the metrics row and the demos."""
    c, seeds = config.sft, Seeds(config.run.seed)
    t0 = time.perf_counter()
    manager = get_manager(config.context.manager)
    purpose = manager.scripted_hook
    if manager.scripts_demos() and not under_manager and c.context_demos == "auto" and not c.format_demos_env:
        shown = f"{purpose} requests" if purpose else f"{manager.name} solutions"
        warnings.warn(f"environment {config.env.name!r} has no {manager.demo_hooks()} hook: its warm-start demos "
                      f"use the full context and show no {shown} (sft.context_demos=auto)", stacklevel=2)
    demos = demo_mix(config, spec, env_cls, renderer, c.demos, under_manager=under_manager,
                     seeds=(seeds.warm_start_demos, seeds.trial_demos, seeds.format_demos))
    n_trials = round(c.demos * c.trial_demos)
    losses = sft_train(model, demos, pad_token_id=renderer.tokenizer.pad_token_id, epochs=c.epochs,
                       batch_size=c.batch_size, lr=c.lr, seed=seeds.sft_order, on_step=on_step, precision=precision,
                       chunk=config.train.logprob_chunk_tokens, max_tokens=micro_batch_tokens)
    row = {"phase": "sft", "step": 0, "demos": len(demos), "sft_steps": len(losses),
           "sft_loss_first": losses[0], "sft_loss_last": losses[-1], "seconds": time.perf_counter() - t0,
           "context_demos": under_manager, "trial_demos": n_trials,
           "format_demos": c.format_demos if c.format_demos_env else 0,
           "demo_summaries_per_episode": sum(e.info.get("summaries", 0) for e in demos) / len(demos),
           "demo_branches_per_episode": sum(e.info.get("branches", 0) for e in demos) / len(demos),
           "demo_tool_calls_per_episode": sum(e.tool_calls for e in demos) / len(demos)}
    return row, demos
