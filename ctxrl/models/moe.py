"""Mixture-of-experts diagnostics: the router's load-balancing loss of a Hugging Face MoE causal LM, as a figure.

A MoE layer's router sends each token to ``k`` of ``E`` experts. The load-balancing (auxiliary) loss of Switch
Transformer / Mixtral, ``E * sum_e f_e * P_e`` (``f_e`` the fraction of tokens routed to expert ``e``, each of a
token's ``k`` choices counted, ``P_e`` its mean router probability, over all layers' tokens), is ``k`` when the
load is even and grows as a few experts take the tokens: what practitioners watch during RL fine-tuning.
Transformers computes it when a forward pass is asked for the router logits (``output_router_logits=True``);
``router_balance_loss`` reads it.

What this does not do: add the loss to the policy loss (the learner does not train with it yet), or record and
replay the rollout's expert choices in the learner (router replay; not built).
"""

from __future__ import annotations

import torch


def is_moe(model) -> bool:
    """Whether ``model``'s config describes routed experts (Qwen3-MoE, OLMoE, Mixtral, ...)."""
    config = getattr(model, "config", None)
    return any(getattr(config, key, None) for key in ("num_experts", "num_local_experts"))


@torch.no_grad()
def router_balance_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> float | None:
    """The load-balancing loss of ``model``'s routers over the tokens ``attention_mask`` keeps (``[B, T]`` each),
    from one extra forward pass without a gradient; None for a model without routers. Unscaled: the model's
    ``router_aux_loss_coef`` is what a trainer would multiply it by."""
    if not is_moe(model):
        return None
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True, use_cache=False)
    aux = getattr(out, "aux_loss", None)
    return None if aux is None else float(aux)
