"""The policy-loss registry and the figures every loss logs.

A policy loss is a pure function ``loss_fn(logprobs, old_logprobs, advantages, mask, *, agg, norm_length,
denominator, token_weights, on_device, **its own settings) -> (scalar loss, metrics)``, with the shapes and
conventions of ``ctxrl.algo.losses.policy_loss``: all tensors [B,T], ``mask`` the loss mask, ``agg`` /
``norm_length`` / ``denominator`` passed to ``ctxrl.algo.losses.aggregate`` (the denominator of the whole
mini-batch under gradient accumulation), ``token_weights`` (no gradient) multiplying each token's loss before
aggregation (e.g. an off-policy correction's weights), and ``metrics`` floats unless ``on_device``.

``POLICY_LOSSES`` names them (``register_policy_loss``); the built-ins are named by the package's ``__init__``.
``algo.loss`` chooses one by name and the learner calls it (``ctxrl.learner.objective``); nothing else dispatches
on a loss's name. Registering declares, as attributes of the function, what the configuration and the learner read
(``declared``): its ``Settings`` (the ``[algo.NAME]`` table, whose fields are the function's own keywords), the
``figures`` it returns that the learner logs, whether ``algo.clip_low`` / ``algo.clip_high`` are its clip range
(``shared_clips``) and which ``algo.agg`` modes it is defined for (``aggregations``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ctxrl.registry import Registry
from ctxrl.settings import settings_table

PolicyLoss = Callable[..., tuple[torch.Tensor, dict]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", entry_point_group="ctxrl.policy_losses")
"""The policy losses by name; the built-ins, which import this module, are named by ``ctxrl.algo.policy_losses``."""


FIGURES = ("clip_frac_low", "clip_frac_high", "approx_kl")
"""What a PPO-style loss logs: the fractions of sampled tokens clipped below and above, the approximate KL."""


@dataclass(frozen=True)
class Declared:
    """What a registered loss declares (``register_policy_loss``'s keywords)."""

    Settings: type | None = None
    figures: tuple[str, ...] = FIGURES
    shared_clips: bool = False
    aggregations: tuple[str, ...] | None = None


def register_policy_loss(name: str, *, settings: type | None = None, figures: tuple[str, ...] = FIGURES,
                         shared_clips: bool = False, aggregations: tuple[str, ...] | None = None
                         ) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register a loss function as ``name``, declaring

    - ``settings``: its settings dataclass, read from ``[algo.NAME]``; each field is passed as the function's keyword
      of that name (None: no settings of its own);
    - ``figures``: the metrics it returns that the learner logs per step, each a mean over sampled tokens (the
      learner weights each micro-batch's by its tokens); every key must be in the metrics it returns;
    - ``shared_clips``: ``algo.clip_low`` / ``algo.clip_high`` are passed as its ``clip_low`` / ``clip_high``
      (PPO's clip range); a loss with a clip range of its own declares it in ``settings`` instead;
    - ``aggregations``: the ``algo.agg`` modes it is defined for (None: every one); the config refuses others.
    """
    def add(fn: PolicyLoss) -> PolicyLoss:
        fn.declared = Declared(settings, tuple(figures), shared_clips, aggregations)
        return POLICY_LOSSES.register(name, fn)
    return add


def declared(fn: PolicyLoss) -> Declared:
    """What ``fn`` declared when it was registered (a function registered straight into ``POLICY_LOSSES``: the
    defaults, no settings)."""
    return getattr(fn, "declared", None) or Declared()


def loss_keywords(fn: PolicyLoss, algo: Any, options: Any = None) -> dict[str, Any]:
    """The keywords ``fn`` takes from a run's config beside the common arguments: ``algo.clip_low`` /
    ``algo.clip_high`` where it shares PPO's clip range, and its own settings (``options``, an instance of its
    ``Settings``; None: their defaults)."""
    d = declared(fn)
    shared = {"clip_low": algo.clip_low, "clip_high": algo.clip_high} if d.shared_clips else {}
    if d.Settings is None:
        return shared
    own = options if options is not None else d.Settings()
    return {**shared, **settings_table(own)}


def policy_loss_names() -> list[str]:
    """Every registered policy loss, built-ins first."""
    return POLICY_LOSSES.names()


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered as ``name``; an unknown name is an error listing the known ones."""
    return POLICY_LOSSES.get(name)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over mask-1 positions (0 when there are none)."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


@torch.no_grad()
def ratio_figures(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """``approx_kl`` (``0.5 (log r)^2``) and ``ratio_mean`` over sampled tokens, as ``policy_loss`` logs them."""
    log_ratio = torch.where(mask.bool(), logprobs.detach() - old_logprobs, 0.0)
    return {"approx_kl": masked_mean(0.5 * log_ratio.square(), mask),
            "ratio_mean": masked_mean(torch.exp(log_ratio), mask)}


def finish(metrics: dict, on_device: bool) -> dict:
    """Detached 0-d tensors where they were computed (``on_device``) or floats."""
    metrics = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
    return metrics if on_device else {k: float(v) for k, v in metrics.items()}
