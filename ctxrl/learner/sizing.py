"""How large a run's pieces may be on its device: the CUDA memory plan applied before the model loads, learner
micro-batches bounded off CUDA, the allocator's settings, and the peak memory a step reports."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from ctxrl.learner.memory import MemoryPlan
from ctxrl.report.progress import Progress

Config = Any
"""A run's whole configuration (the config package's ``Config``), read by section: the learner sits below the
config's package and does not import it (issue 50)."""

log = logging.getLogger(__name__)


def model_shape(config: Config):
    """``(hf_config, ModelShape)`` of ``config``'s model, read from its HF config and a ``meta``-device build (no
    memory), or the reason it cannot be (a LoRA adapter directory, an architecture without the sizes) as a string."""
    return shape_of(config.model.name)


def shape_of(name: str):
    """``model_shape`` of the model called ``name``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ctxrl.learner.memory import ModelShape
    from ctxrl.models.loader import resolve

    try:
        hf = AutoConfig.from_pretrained(resolve(name))
        with torch.device("meta"):
            parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
        return hf, ModelShape.from_hf_config(hf, parameters)
    except Exception as exc:  # noqa: BLE001 - the caller says what goes unsized
        return str(exc)


def micro_batch_tokens(config: Config, device: str, progress: Progress, *, critic: bool) -> int:
    """Off CUDA (no memory plan): the token budget of a learner micro-batch. The user's
    ``train.max_tokens_per_microbatch`` where set (or on CUDA, whose memory plan chooses); else a bound when
    ``train.micro_batch_size`` rows of ``rollout.max_total_tokens`` would hold more activations than
    ``DEFAULT_ACTIVATION_BYTES`` (4 GiB), said once; else 0 (``train.micro_batch_size`` rows at a time).

    A real model on a CPU needs it: SmolLM2-135M keeps about 1.9 MB of float32 activations per token, so 32
    rows of 500 tokens (a summarize warm start's segments) took 24 GB and the kernel killed the run. The tiny
    models never come near the bound, so their micro-batches stay as configured."""
    if torch.device(device).type == "cuda" or config.train.max_tokens_per_microbatch > 0:
        return config.train.max_tokens_per_microbatch
    found = model_shape(config)
    if isinstance(found, str):  # nothing to size it by: the micro-batches stay as configured
        return config.train.max_tokens_per_microbatch
    from ctxrl.learner.memory import RunSizes, activation_bytes_per_token, fitting_tokens

    run = RunSizes.from_config(config, found[1], device_bytes=0, engine=False, critic=critic, kv_tokens_per_slot=0)
    per_token = activation_bytes_per_token(run)
    tokens = max(fitting_tokens(run), config.rollout.max_total_tokens)
    if tokens >= config.train.micro_batch_size * config.rollout.max_total_tokens:
        return config.train.max_tokens_per_microbatch
    progress.message(f"learner micro-batches of at most {tokens} tokens ({per_token / 2**20:.2f} MiB of activations "
                     f"per token); train.max_tokens_per_microbatch sets another budget")
    return tokens


def memory_plan(config: Config, device: str, *, engine: bool, critic: bool,
                beside: tuple[tuple[str, str], ...] = ()) -> MemoryPlan | None:
    """The run's memory plan on CUDA (``ctxrl.learner.memory``), its allocator cap applied; None on the CPU.

    The model's shape comes from its HF config and its parameter count from the model built on the
    ``meta`` device (no memory), so a run that cannot fit stops before its weights are loaded. A plan
    that exceeds what the card has free now is a ``ConfigError`` too. ``engine``: the rollout engine
    lives in this process (not on a follower rank, not in Ray actors). ``beside``: ``(name, dtype)`` of the frozen
    models that share the card (a distillation teacher, a local judge): their weights are planned too.
    """
    if torch.device(device).type != "cuda":
        return None
    from ctxrl.engine.capacity import slot_capacity
    from ctxrl.learner.memory import RunSizes, check_free, plan_memory

    found = model_shape(config)
    if isinstance(found, str):
        log.warning("no memory plan for %s (%s): the KV pool and micro-batches keep the config's sizes, and "
                    "model.gpu_memory_fraction is not applied", config.model.name, found)
        return None
    hf, shape = found
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index  # (the cap needs one: "cuda" is not)
    free, total = torch.cuda.mem_get_info(index)
    positions = min(config.rollout.max_total_tokens, getattr(hf, "max_position_embeddings", None) or 10**9)
    sizes = RunSizes.from_config(config, shape, device_bytes=total, engine=engine, critic=critic,
                                 kv_tokens_per_slot=slot_capacity(positions),
                                 flat=expects_flat(config, hf), card_share=card_share(),
                                 graphed=expects_graphs(config, hf))
    if beside:
        sizes = dataclasses.replace(sizes, frozen_bytes=sum(frozen_bytes(name, dtype) for name, dtype in beside))
    plan = plan_memory(sizes)
    check_free(plan, free)
    if plan.capped:
        torch.cuda.set_per_process_memory_fraction(plan.budget_bytes / total, index)
        expandable_segments()
    return plan


def expects_flat(config: Config, hf_config) -> bool:
    """Whether the learner will run ctxrl's flat forward pass (``ctxrl.learner.flat.training_decoder``) on CUDA, as
    far as the config and the model's HF config tell before it loads: not ``off``, a 2-byte dtype, no LoRA, a
    supported family. (The pass also checks itself against HF's once the model is loaded, and a model that fails
    the check trains through HF's pass with rows capped at ``train.micro_batch_size``.)"""
    from ctxrl.models.layout import FAMILIES

    return (config.train.flat_forward != "off" and config.model.dtype in ("bfloat16", "float16")
            and config.lora.rank == 0 and getattr(hf_config, "model_type", None) in FAMILIES)


def expects_graphs(config: Config, hf_config=None) -> bool:
    """Whether the flat pass (where it runs) will replay its layers as CUDA graphs: ``train.flat_forward`` is
    ``graphed``, or ``auto`` for a model narrow enough and not longrope (``ctxrl.learner.flat.auto_graphs``, from
    its HF config); never with gradient checkpointing (which recomputes the layers instead)."""
    from ctxrl.learner.flat import auto_graphs

    if config.train.gradient_checkpointing:
        return False
    mode = config.train.flat_forward
    return mode == "graphed" or (mode == "auto" and auto_graphs(hf_config))


def card_share() -> float:
    """``CTXRL_GPU_SHARE`` (``ctxrl.learner.memory.GPU_SHARE_VARIABLE``): the share of the card this run's plan sizes
    its automatic parts from; 1 when unset. A value outside (0, 1] is a ``ConfigError``."""
    from ctxrl.errors import ConfigError
    from ctxrl.learner.memory import GPU_SHARE_VARIABLE

    text = os.environ.get(GPU_SHARE_VARIABLE, "").strip()
    if not text:
        return 1.0
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{GPU_SHARE_VARIABLE}={text!r}: it must be a share of the card in (0, 1], such as 0.25 "
                          f"for four runs a card; unset it to size from the whole card")
    return value


def frozen_bytes(name: str, dtype: str) -> int:
    """The weights of a frozen model loaded beside the policy (a teacher, a judge) in ``dtype``; 0, with a warning,
    when its size cannot be read."""
    found = shape_of(name)
    if isinstance(found, str):
        log.warning("%s is left out of the memory plan (%s): leave it room with model.gpu_memory_fraction, or put it "
                    "on another device", name, found)
        return 0
    return found[1].parameters * (4 if dtype == "float32" else 2)


def expandable_segments() -> bool:
    """Let torch's allocator grow segments in place (less fragmentation: under a cap it counts against the run,
    ``ctxrl.learner.memory.CAPPED_HEADROOM``), unless the user configured the allocator (``PYTORCH_CUDA_ALLOC_CONF``).
    True when it was turned on here."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return False
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return True


def peak_memory(device: str) -> dict[str, float]:
    """``peak_gpu_gib``: the most device memory torch's allocator has reserved so far (what the card sees of it,
    without the CUDA context); nothing on the CPU."""
    if torch.device(device).type != "cuda":
        return {}
    return {"peak_gpu_gib": torch.cuda.max_memory_reserved(torch.device(device)) / 2**30}
