"""LoRA adapters through PEFT: the settings (``[lora]``) and wrapping a model with them.

The learner wraps its policy (``ctxrl.train.policy``); a rollout worker that loads its own copy of
the model wraps it the same way (``ModelSpec.lora``), so the adapter tensors have the same names
on both sides and ``load_weights(adapters, partial=True)`` fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxrl.plain import PlainData

DEFAULT_ADAPTER = "default"
"""PEFT's name of the first adapter: the shared policy's (a role with a policy of its own has one named after it)."""


@dataclass(frozen=True)
class LoRASettings(PlainData):
    """Rank, scaling, dropout and target modules of the adapters (``[lora]``); rank 0 = no adapters."""

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str = "all-linear"

    @classmethod
    def from_config(cls, config) -> LoRASettings:
        c = config.lora
        return cls(rank=c.rank, alpha=c.alpha, dropout=c.dropout, target_modules=c.target_modules)

    def peft_config(self):
        from peft import LoraConfig

        modules = self.target_modules.strip()
        targets = modules if modules == "all-linear" else [m.strip() for m in modules.split(",") if m.strip()]
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          bias="none", task_type="CAUSAL_LM")


def wrap_lora(base, lora: LoRASettings, *, adapter_dtype: torch.dtype = torch.float32):
    """``base`` frozen, with PEFT LoRA adapters in ``adapter_dtype`` on ``lora.target_modules``."""
    from peft import get_peft_model

    for p in base.parameters():
        p.requires_grad_(False)
    try:
        model = get_peft_model(base, lora.peft_config())
    except ValueError as exc:  # PEFT names the modules it could not find
        raise ValueError(f"lora.target_modules={lora.target_modules!r}: {exc}") from None
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(adapter_dtype)
    return model


def add_adapters(model, names: tuple[str, ...], lora: LoRASettings, dtype: torch.dtype) -> None:
    """More LoRA adapters on the PEFT ``model`` (in ``dtype``), one per name, the default one left active: the
    roles with policies of their own (``ctxrl.train.role_adapters``)."""
    clash = [n for n in names if n == DEFAULT_ADAPTER or any(f".{n}." in p for p, _ in model.named_parameters())]
    if clash:
        raise ValueError(f"{clash[0]!r} cannot name an adapter: it is PEFT's default or a module of the model")
    for name in names:
        model.add_adapter(name, lora.peft_config())
    for name, p in model.named_parameters():
        if "lora_" in name and any(f".{n}." in name for n in names):
            p.data = p.data.to(dtype)
    if names:
        model.set_adapter(DEFAULT_ADAPTER)


def adapter_parameters(model, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The parameters of one adapter, by their names in ``model``."""
    return {n: p for n, p in model.named_parameters() if "lora_" in n and f".{adapter}." in n}
