"""LoRA adapters through PEFT: the settings (``[lora]``) and wrapping a model with them.

The learner wraps its policy (``ctxrl.train.policy``); a rollout worker that loads its own copy of
the model wraps it the same way (``ModelSpec.lora``), so the adapter tensors have the same names
on both sides and ``load_weights(adapters, partial=True)`` fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxrl.plain import PlainData


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
