"""The policy-loss registry and the figures every loss logs.

A policy loss is a pure function ``loss_fn(logprobs, old_logprobs, advantages, mask, *, agg, norm_length,
denominator, token_weights, on_device, **its own settings) -> (scalar loss, metrics)``, with the shapes and
conventions of ``ctxrl.algo.losses.policy_loss``: all tensors [B,T], ``mask`` the loss mask, ``agg`` /
``norm_length`` / ``denominator`` passed to ``ctxrl.algo.losses.aggregate`` (the denominator of the whole
mini-batch under gradient accumulation), ``token_weights`` (no gradient) multiplying each token's loss before
aggregation (e.g. an off-policy correction's weights), and ``metrics`` floats unless ``on_device``.

``POLICY_LOSSES`` names them (``register_policy_loss``); the built-ins are named by the package's ``__init__``.
Nothing chooses among them yet: the learner still picks ``ppo_clip`` or ``gspo`` itself (its loss choice is being
redesigned to read this registry).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ctxrl.registry import Registry

PolicyLoss = Callable[..., tuple[torch.Tensor, dict]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", entry_point_group="ctxrl.policy_losses")
"""The policy losses by name; the built-ins, which import this module, are named by ``ctxrl.algo.policy_losses``."""


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register a loss function as ``name``."""
    def add(fn: PolicyLoss) -> PolicyLoss:
        return POLICY_LOSSES.register(name, fn)
    return add


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
