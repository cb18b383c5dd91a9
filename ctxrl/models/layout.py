"""Which decoders ctxrl runs through its own forward pass: Llama's module layout.

The fast engine (``ctxrl.engine.fast``) and the learner's flat forward (``ctxrl.learner.flat``)
call the HF model's own modules (embeddings, projections, norms, MLPs, head) but arrange the
attention themselves. That needs Llama's layout: ``model.model.layers`` of pre-norm blocks with
RMS norms, a gated SiLU MLP, rotary positions fixed per position, and ``q/k/v/o`` projections.
Llama, Qwen2, Qwen2.5, Qwen3 (with its per-head q/k norms) and Mistral (without a sliding
window shorter than the sequence) have it. ``unsupported_reason`` says why another model does
not; callers then use the HF forward pass instead.
"""

from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
"""Norms computed as ``weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)`` (``fused.rms_norm``)."""
STATIC_ROPE = ("default", "llama3", "linear", "yarn", "longrope", None)


def rope_type(config) -> str | None:
    for attr in ("rope_parameters", "rope_scaling"):
        value = getattr(config, attr, None)
        if isinstance(value, dict):
            return value.get("rope_type", value.get("type"))
    return None


def unsupported_reason(model, max_len: int, *, training: bool = False) -> str | None:
    """Why ``model`` cannot run through ctxrl's own forward pass (``None``: it can).

    ``max_len``: the longest sequence it will see. ``training``: for the learner (attention
    dropout matters there).
    """
    if hasattr(model, "peft_config"):
        return "a PEFT (LoRA) model: its adapters live outside the weights this forward pass reads"
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"model type {kind!r} is not one of the supported families {', '.join(FAMILIES)}"
    if rope_type(config) not in STATIC_ROPE:
        return f"rope type {rope_type(config)!r} depends on the sequence length"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and max_len > window:
        return f"sliding-window attention ({window} tokens) shorter than max_total_tokens ({max_len})"
    if training and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return f"attention dropout ({config.attention_dropout}) is not implemented here"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("layers", "norm", "rotary_emb", "embed_tokens")):
        return "the model does not have Llama's module layout (model.layers, model.norm, model.rotary_emb)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only SiLU is fused)"
    layer = inner.layers[0]
    norms = [inner.norm, layer.input_layernorm, layer.post_attention_layernorm]
    odd = [type(n).__name__ for n in norms if type(n).__name__ not in RMS_NORMS]
    if odd:
        return f"norm {odd[0]} is not one of {', '.join(RMS_NORMS)}"
    if not all(hasattr(layer.mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
        return "the MLP is not a gated (gate_proj, up_proj, down_proj) one"
    return None


def norm_args(module) -> tuple[torch.Tensor, float]:
    """An RMS norm module's ``(weight, eps)``."""
    return module.weight, module.variance_epsilon
