"""Whether a model fits each rank of a sharded (FSDP2) run, said before anything is loaded: a pure function.

Per rank, in bytes (``N`` parameters, ``W`` ranks, ``U`` the parameters of the largest ``fully_shard`` unit:
the root's embeddings and output head, or a decoder layer, whichever is larger; ``b`` the compute dtype's size):

- **sharded state**: ``ceil(N / W) x (m + g + o)``: the shards of the float32 masters (``m`` = 4 bytes; the
  sharded parameters themselves), of their gradients (``g`` = 4, reduced in float32) and of the optimiser's
  state (``o``: 8 for AdamW's two float32 moments);
- **gathered units**: ``2 x U x (b + 4)``: the unit that computes and the next one, prefetched, each with its
  full weights in ``b`` and, in the backward pass, its full float32 gradient before the reduce-scatter;
- **activations**: what the caller reserves for the micro-batch's activations (``activation_bytes``);
- **headroom**: ``headroom_fraction`` of the card kept free (the allocator's fragmentation, the CUDA context,
  NCCL's buffers).

``plan_sharded_memory`` returns the plan when the sum fits ``device_bytes x (1 - headroom_fraction)``, and
raises ``ShardedMemoryError`` naming the numbers and the fix when it does not: the smallest world size that
fits, or, when even infinitely many ranks would not (the gathered units and activations alone fill the card),
LoRA, activation checkpointing or a smaller model.

It does not size micro-batches or engine slots (``ctxrl.learner.memory`` does that for one card; joining the
two waits for the learner redesign), and it counts no rollout engine on the learner's ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1 << 30
MASTER_BYTES = 4
"""Bytes per parameter of the sharded float32 masters, and of their float32 gradients."""
ADAMW_STATE_BYTES = 8
"""AdamW's two float32 moments, per parameter."""


class ShardedMemoryError(ValueError):
    """A sharded model that does not fit its ranks: the message names the numbers and the fix."""


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n:,} bytes"  # small sizes (tests) in bytes


@dataclass(frozen=True)
class ShardedMemoryPlan:
    """Bytes per rank of a sharded run, by part (see the module docstring for each formula)."""

    parameters: int
    world_size: int
    device_bytes: int
    sharded_state_bytes: int
    gathered_bytes: int
    activation_bytes: int
    headroom_bytes: int

    @property
    def per_rank_bytes(self) -> int:
        """What one rank needs, headroom excluded."""
        return self.sharded_state_bytes + self.gathered_bytes + self.activation_bytes

    @property
    def budget_bytes(self) -> int:
        return self.device_bytes - self.headroom_bytes

    @property
    def fits(self) -> bool:
        return self.per_rank_bytes <= self.budget_bytes

    def summary(self) -> str:
        return (f"{self.parameters:,} parameters over {self.world_size} ranks: per rank "
                f"{_gib(self.sharded_state_bytes)} sharded state + {_gib(self.gathered_bytes)} gathered units + "
                f"{_gib(self.activation_bytes)} activations = {_gib(self.per_rank_bytes)} of a "
                f"{_gib(self.budget_bytes)} budget ({_gib(self.device_bytes)} card less {_gib(self.headroom_bytes)} "
                "headroom)")


def _sharded_state(parameters: int, world_size: int, optimizer_state_bytes: int) -> int:
    return math.ceil(parameters / world_size) * (MASTER_BYTES + MASTER_BYTES + optimizer_state_bytes)


def plan_sharded_memory(parameters: int, *, dtype_bytes: int, world_size: int, device_bytes: int,
                        largest_unit_parameters: int, optimizer_state_bytes: int = ADAMW_STATE_BYTES,
                        activation_bytes: int = 0, headroom_fraction: float = 0.1) -> ShardedMemoryPlan:
    """The per-rank plan of a full fine-tune sharded over ``world_size`` ranks of ``device_bytes`` each, or a
    ``ShardedMemoryError`` saying why it cannot fit and what would.

    ``dtype_bytes``: the compute dtype's size (2 for bfloat16, 4 for float32); ``largest_unit_parameters``: the
    parameters of the largest ``fully_shard`` unit (``unit_sizes``); ``optimizer_state_bytes``: per parameter
    (8 for AdamW, 0 for SGD without momentum).
    """
    for name, value in (("parameters", parameters), ("world_size", world_size), ("device_bytes", device_bytes),
                        ("largest_unit_parameters", largest_unit_parameters)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dtype_bytes not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes must be 1, 2, 4 or 8 (a dtype's size in bytes), got {dtype_bytes!r}")
    if optimizer_state_bytes < 0 or activation_bytes < 0:
        raise ValueError(f"optimizer_state_bytes ({optimizer_state_bytes}) and activation_bytes "
                         f"({activation_bytes}) cannot be negative")
    if not 0 <= headroom_fraction < 1:
        raise ValueError(f"headroom_fraction must be in [0, 1), got {headroom_fraction!r}")
    if largest_unit_parameters > parameters:
        raise ValueError(f"largest_unit_parameters ({largest_unit_parameters}) exceeds the model's parameters "
                         f"({parameters}): a unit is part of the model")
    plan = ShardedMemoryPlan(
        parameters=parameters, world_size=world_size, device_bytes=device_bytes,
        sharded_state_bytes=_sharded_state(parameters, world_size, optimizer_state_bytes),
        gathered_bytes=2 * largest_unit_parameters * (dtype_bytes + MASTER_BYTES),
        activation_bytes=activation_bytes, headroom_bytes=math.ceil(device_bytes * headroom_fraction))
    if plan.fits:
        return plan
    fixed = plan.gathered_bytes + plan.activation_bytes
    per_parameter = MASTER_BYTES + MASTER_BYTES + optimizer_state_bytes
    if fixed >= plan.budget_bytes:
        raise ShardedMemoryError(
            f"{plan.summary()}: does not fit at any world size, since the gathered units "
            f"({_gib(plan.gathered_bytes)}: two units of {largest_unit_parameters:,} parameters) and the activations "
            f"({_gib(plan.activation_bytes)}) alone exceed the budget. Fixes: train LoRA adapters instead of every "
            "weight, checkpoint activations or shrink the micro-batch, or pick a smaller model")
    room = plan.budget_bytes - fixed
    shard = room // per_parameter  # the most parameters one rank's shard may hold
    need = math.ceil(parameters / shard)  # then ceil(N / need) <= shard: its state fits the room
    raise ShardedMemoryError(
        f"{plan.summary()}: over by {_gib(plan.per_rank_bytes - plan.budget_bytes)}. Fixes: shard over at least "
        f"{need} ranks of this card, train LoRA adapters instead of every weight, or pick a smaller model")


def unit_sizes(config) -> tuple[int, int]:
    """``(parameters, largest_unit_parameters)`` of a Hugging Face decoder's ``config`` (dense or MoE), counted on
    the meta device (nothing is allocated): the whole model's parameters, and those of its largest
    ``fully_shard`` unit, the root (embeddings, final norm, output head) or one decoder layer."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = model.model.layers
    in_layers = {id(p) for p in layers.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_layers)
    layer = max(sum(p.numel() for p in block.parameters()) for block in layers)
    return sum(p.numel() for p in model.parameters()), max(root, layer)
