"""LoRA adapters through PEFT: wrapping a model with the adapters the ``[lora]`` section asks for.

The learner wraps its policy (``ctxrl.learner.policy``); a rollout worker that loads its own copy of
the model wraps it the same way (``RolloutSpec.lora``, the section itself), so the adapter tensors have the same
names on both sides and ``load_weights(adapters, partial=True)`` fits.
"""

from __future__ import annotations

import torch

from ctxrl.sections import LoRAConfig

DEFAULT_ADAPTER = "default"
"""PEFT's name of the first adapter: the shared policy's (a role with a policy of its own has one named after it)."""


def peft_config(lora: LoRAConfig):
    """PEFT's ``LoraConfig`` of the ``[lora]`` section: rank, scaling, dropout and target modules."""
    from peft import LoraConfig

    modules = lora.target_modules.strip()
    targets = modules if modules == "all-linear" else [m.strip() for m in modules.split(",") if m.strip()]
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM")


def wrap_lora(base, lora: LoRAConfig, *, adapter_dtype: torch.dtype = torch.float32):
    """``base`` frozen, with PEFT LoRA adapters in ``adapter_dtype`` on ``lora.target_modules``."""
    from peft import get_peft_model

    for p in base.parameters():
        p.requires_grad_(False)
    try:
        model = get_peft_model(base, peft_config(lora))
    except ValueError as exc:  # PEFT names the modules it could not find
        raise ValueError(f"lora.target_modules={lora.target_modules!r}: {exc}") from None
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(adapter_dtype)
    return model


def add_adapters(model, names: tuple[str, ...], lora: LoRAConfig, dtype: torch.dtype) -> None:
    """More LoRA adapters on the PEFT ``model`` (in ``dtype``), one per name, the default one left active: the
    roles with policies of their own (``ctxrl.run.roles``)."""
    clash = [n for n in names if n == DEFAULT_ADAPTER or any(f".{n}." in p for p, _ in model.named_parameters())]
    if clash:
        raise ValueError(f"{clash[0]!r} cannot name an adapter: it is PEFT's default or a module of the model")
    for name in names:
        model.add_adapter(name, peft_config(lora))
    for name, p in model.named_parameters():
        if "lora_" in name and any(f".{n}." in name for n in names):
            p.data = p.data.to(dtype)
    if names:
        model.set_adapter(DEFAULT_ADAPTER)


def adapter_parameters(model, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The parameters of one adapter, by their names in ``model``."""
    return {n: p for n, p in model.named_parameters() if "lora_" in n and f".{adapter}." in n}
