"""The trainable policy: its module (full fine-tuning or LoRA), and what the engine and the KL reference get.

``Policy.load(config, device)`` builds the learner's module:

- **full fine-tuning** (``lora.rank = 0``): the checkpoint in ``model.dtype``;
- **LoRA** (``lora.rank > 0``): the checkpoint in ``model.dtype``, frozen, wrapped by PEFT with
  adapters (also in ``model.dtype``) on ``lora.target_modules``; only the adapters train.

Either way the optimiser (``Precision.optimizer``) keeps float32 masters of what trains when
``model.dtype`` is lower (``ctxrl.learner.precision``).

What the other parts get:

- ``engine_model()``: the engine's own copy, in ``model.dtype``. Full fine-tuning: a cast copy
  of every weight. LoRA: a second PEFT wrapper that *shares* the frozen base tensors (never
  written by anyone) with its own copy of the adapters, so a 7B base is held once.
- ``engine_state()``: what ``engine.load_weights`` needs after an optimiser step: every weight,
  or only the adapters (``partial``).
- ``reference()``: the KL reference. Full fine-tuning: a frozen copy in ``model.dtype`` of the
  policy as it is now (after the warm start). LoRA: the same module with its adapters switched
  off (``disable_adapter``): the base, without a second copy of the weights.
- ``save(path, tokenizer)``: the final weights for other tools: a full HF checkpoint in
  ``model.dtype``, or the adapters in PEFT's format (``PeftModel.from_pretrained`` loads them),
  plus ``export_merged`` for a merged checkpoint to serve.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from ctxrl.errors import CheckpointError
from ctxrl.learner.logprobs import token_logprobs
from ctxrl.learner.precision import Precision
from ctxrl.models.lora import add_adapters, wrap_lora
from ctxrl.sections import LoRAConfig

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def name_base_as_configured(adapter_config: Path, name: str) -> None:
    """Write ``name`` as the adapters' base when it is a name ctxrl resolves to a cache directory (``tiny``, a named
    real model, a ``.gguf`` file): PEFT records the directory the base was loaded from, which exists only on this
    machine, while ``ctxrl merge`` and ``ctxrl eval`` resolve the name anywhere."""
    import json

    from ctxrl.models.loader import resolves_to_cache

    if not name or not resolves_to_cache(name) or not adapter_config.exists():
        return
    data = json.loads(adapter_config.read_text())
    data["base_model_name_or_path"] = name
    adapter_config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


class Reference:
    """The KL reference policy's log-probs: a frozen module, or the policy with its adapters switched off."""

    def __init__(self, module, *, disable=None) -> None:
        self.module = module
        self._disable = disable

    @property
    def frozen_copy(self):
        """The module that a checkpoint must hold (None when the reference is the policy's own base)."""
        return None if self._disable is not None else self.module

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> torch.Tensor:
        with self._disable() if self._disable is not None else contextlib.nullcontext():
            return token_logprobs(self.module, input_ids, attention_mask, **kwargs)


class Policy:
    """The learner's module and its precision (see the module docstring)."""

    def __init__(self, model, precision: Precision, *, lora: LoRAConfig | None = None, name: str = "") -> None:
        self.model = model
        self.precision = precision
        self.lora = lora if lora is not None and lora.rank > 0 else None
        self.name = name

    @classmethod
    def load(cls, config, device: str, roles: tuple[str, ...] = ()) -> Policy:
        """Load ``model.name`` as the run's trainable policy on ``device``; ``roles``: an adapter each beside the
        shared one (LoRA; the roles with policies of their own, ``ctxrl.run.roles``)."""
        from ctxrl.models.loader import load_model

        precision = Precision(config.model.dtype, config.train.master_weights, device)
        lora = config.lora
        model = load_model(config.model.name, dtype=config.model.dtype, device=device)
        if lora.rank > 0:
            model = wrap_lora(model, lora, adapter_dtype=precision.storage)
            add_adapters(model, roles, lora, precision.storage)
        if config.train.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        return cls(model, precision, lora=lora, name=config.model.name)

    @property
    def is_lora(self) -> bool:
        return self.lora is not None

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # -- the engine ------------------------------------------------------------------------------------
    def engine_model(self, adapter: str = "default"):
        """The engine's own copy in the storage dtype (LoRA: sharing the frozen base tensors; ``adapter`` active,
        a role's own policy: ``ctxrl.run.roles``)."""
        copy = module_copy(self.model, self.precision.storage, share_frozen=self.is_lora)
        if adapter != "default":
            copy.set_adapter(adapter)
        return copy.eval()

    def trainable_copy(self):
        """An independent trainable copy of the module (the critic's trunk starts as one)."""
        return module_copy(self.model, self.precision.storage, trainable=True)

    def engine_state(self) -> tuple[dict[str, torch.Tensor], bool]:
        """``(state, partial)`` for ``engine.load_weights``: every weight, or (LoRA) only the adapters."""
        if self.is_lora:
            return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}, True
        return self.model.state_dict(), False

    # -- the KL reference ------------------------------------------------------------------------------
    def reference(self) -> Reference:
        if self.is_lora:
            return Reference(self.model, disable=self.model.disable_adapter)
        frozen = self.engine_model()  # a cast copy: model.dtype, no gradients
        return Reference(frozen)

    # -- saving ------------------------------------------------------------------------------------------
    def save(self, path: Path, tokenizer) -> Path:
        """Final weights for other tools: an HF checkpoint in model.dtype, or PEFT adapters."""
        path = Path(path)
        if self.is_lora:
            self.model.save_pretrained(path)
            name_base_as_configured(path / "adapter_config.json", self.name)
            config = getattr(self.model.get_base_model(), "generation_config", None)
            if config is not None:  # the base's end ids, for whoever samples from the adapters (generation_end_ids)
                config.save_pretrained(path)
        else:
            storage = self.precision.storage
            state = {k: v.detach().to(storage) for k, v in self.model.state_dict().items()}
            self.model.save_pretrained(path, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(path)
        return path

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapters under PEFT's names (what ``adapter_model.safetensors`` holds)."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.model)

    def load_adapter_state(self, state: dict[str, torch.Tensor], source: str) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, state)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        missing = [k for k in getattr(result, "missing_keys", []) or [] if "lora_" in k and ".default." in k]
        # (the adapters of roles with policies of their own are loaded apart: ctxrl.run.roles)
        if unexpected or missing:
            raise CheckpointError(f"{source} does not fit the model's adapters: unexpected {unexpected[:3]}, missing "
                                  f"{missing[:3]}; were lora.* or model.name changed since it was written?")


def module_copy(model, dtype: torch.dtype, *, share_frozen: bool = False, trainable: bool = False):
    """A deep copy of ``model`` whose parameters are new tensors in ``dtype`` (``trainable``: requiring grad).

    ``share_frozen``: parameters that do not train are the same tensors in the copy (never written), except
    LoRA adapters (an adapter not active now, a role's own policy, still trains when its role's turn comes).
    New ``Parameter`` objects also mean the copy carries none of the originals' hooks (a
    ``MasterAdamW`` hooks every parameter it trains).
    """
    memo = {}
    adapters = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    for p in model.parameters():
        if id(p) in memo:
            continue
        if share_frozen and not p.requires_grad and id(p) not in adapters:
            memo[id(p)] = p
        else:
            memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=trainable)
    return copy.deepcopy(model, memo)


def enable_gradient_checkpointing(model) -> None:
    """Recompute activations layer by layer in the backward pass (HF's own checkpointing, non-reentrant)."""
    if not getattr(model, "supports_gradient_checkpointing", True) and not hasattr(model, "get_base_model"):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing; set "
                         "train.gradient_checkpointing=false")
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name from transformers 5.2x on
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    if hasattr(model, "config"):
        model.config.use_cache = False


def export_merged(adapter_dir: str | Path, out: str | Path, *, base: str | None = None, dtype: str = "float32",
                  device: str = "cpu") -> Path:
    """Load the base named in ``adapter_dir``'s ``adapter_config.json`` (``base``: this name or path instead),
    merge the adapters in, save to ``out``.

    The base is made ready first (a ``tiny`` one built, a GGUF file converted), as for any model a command loads.
    The result is a plain HF checkpoint in ``dtype`` (with the tokenizer, when ``adapter_dir`` has
    one) for serving with any engine.
    """
    from ctxrl.models.loader import load_adapters, load_tokenizer, resolves_to_cache
    from ctxrl.models.prepare import prepare

    adapter_dir, out = Path(adapter_dir), Path(out)
    missing = [f for f in ADAPTER_FILES if not (adapter_dir / f).exists()]
    if missing:
        raise CheckpointError(f"{adapter_dir} holds no LoRA adapters ({', '.join(missing)} missing)")
    prepare(base if base and resolves_to_cache(base) else str(adapter_dir))
    model = load_adapters(str(adapter_dir), base=base, dtype=dtype, device=device)
    model.save_pretrained(out, safe_serialization=True)
    with contextlib.suppress(Exception):  # an adapter directory without a tokenizer: weights only
        load_tokenizer(str(adapter_dir)).save_pretrained(out)
    return out
