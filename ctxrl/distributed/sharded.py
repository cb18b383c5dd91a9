"""A causal LM sharded over the learner's ranks with torch's FSDP2 (``fully_shard``): wrap, optimise, update, gather.

Every rank holds ``1/world`` of each parameter, of its gradient and of the optimiser's state (``DTensor`` shards
along dimension 0); a decoder layer's full weights exist only while that layer runs (all-gathered before its
forward and again before its backward, freed after), and gradients are reduce-scattered back to the shards.
What is here:

- ``shard_model``: each decoder layer its own ``fully_shard`` unit, then the root (embeddings, final norm and
  output head, tied or not); on CUDA a ``MixedPrecisionPolicy`` (bfloat16 compute, float32 gradient reduction)
  over float32 sharded parameters, which are then the float32 masters; on the CPU float32 throughout (no mixed
  precision: the CPU gives nothing for it and the tests compare to float32 updates). Gradients are **summed**
  across ranks (divide factor 1), not averaged: each rank's loss is already normalised by the whole batch's
  token count (``masked_token_loss``), as in ``data_parallel``, so uneven shares weigh as in one process.
- ``sharded_optimizer``: AdamW over the sharded parameters (its state is sharded with them).
- ``sharded_update``: one optimiser step on this rank's rows: forward and backward of a masked token loss through
  ``ctxrl.learner.logprobs.token_logprobs``, the gradient norm of the **whole** model (each rank's shard norms
  combined), clipping by it, the step.
- ``ShardedRanks``: the ``Learner``'s view of sharded ranks (``Learner(..., parallel=ShardedRanks())``): rows shared
  as under data parallelism, gradients reduced inside backward (no all-reduce after), the gradient norm of the
  whole model, and as many micro-batches on every rank as on the busiest (``most``), since every forward and
  backward of a sharded model is collective.
- ``full_state_layers``: the full weights, one decoder layer at a time (peak memory one layer above the shards),
  for a rollout engine's weight sync (``sync_engine``).

Checkpoints are in ``sharded_checkpoint`` and the per-rank memory plan in ``sharded_memory``.

What it deliberately does not do (yet): it is not wired into ``ctxrl train`` (the ``Learner`` takes it; the run's
build, its follower protocol for the engine's sync and the sharded checkpoints are the next step; docs/scaling.md);
a critic is refused; the chunked output head of ``token_logprobs``
(``chunk > 0``) calls the backbone and the head separately, which bypasses the root unit's all-gather, so the
update uses the full-logits path (``chunk=0``); no activation checkpointing, LoRA or CUDA-graphed layers here;
no GPU figures exist yet.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ctxrl.distributed.data_parallel import DataParallel
from ctxrl.learner.logprobs import token_logprobs


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers``), each of which becomes a unit."""
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__} has no decoder layers at model.model.layers: shard_model wraps "
                         "Hugging Face causal LMs (Llama, Qwen2, Qwen3-MoE, OLMoE, ...)")
    return layers


def mixed_precision_for(device: torch.device | str) -> MixedPrecisionPolicy | None:
    """bfloat16 compute with float32 gradient reduction on CUDA; None (float32 throughout) elsewhere."""
    if torch.device(device).type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def shard_model(model: torch.nn.Module, *, mixed_precision: MixedPrecisionPolicy | None | str = "auto",
                mesh=None) -> torch.nn.Module:
    """Shard ``model`` in place over the default process group (or ``mesh``): each decoder layer, then the root.

    ``mixed_precision``: a ``MixedPrecisionPolicy``, None for none, or ``"auto"`` (``mixed_precision_for`` the
    parameters' device). The parameters should be float32 (they become the masters); a model loaded in bfloat16
    is refused under a mixed-precision policy, since its "masters" would be bfloat16.
    Returns ``model`` (now also an ``FSDPModule``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard_model needs torch.distributed initialised (torchrun, or "
                           "torch.distributed.init_process_group) before the model is sharded")
    if isinstance(model, FSDPModule):
        raise ValueError("the model is already sharded (an FSDPModule); shard it once")
    device = next(model.parameters()).device
    policy = mixed_precision_for(device) if mixed_precision == "auto" else mixed_precision
    if policy is not None and policy.param_dtype is not None:
        stored = {p.dtype for p in model.parameters()}
        if stored != {torch.float32}:
            raise ValueError(f"mixed precision computes in {policy.param_dtype} from float32 masters, but the model's "
                             f"parameters are {sorted(map(str, stored))}: load it in float32 (model.dtype = "
                             "\"float32\") before sharding")
    options = {"mp_policy": policy} if policy is not None else {}
    if mesh is not None:
        options["mesh"] = mesh
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: each rank's loss is normalised by the whole batch
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no AVG or PREMUL_SUM)
    return model


class ShardedRanks(DataParallel):
    """The learner's ranks over a model ``shard_model`` has wrapped (the module docstring). The row shares, the
    figures' sums and the control channel are ``DataParallel``'s; what differs is that the gradients are
    reduce-scattered inside backward (``reduce_gradients`` does nothing), the norm to clip by is the whole
    model's (``clip_gradients``), and every forward is a collective (``most``)."""

    sharded = True

    def reduce_gradients(self, params: list[torch.Tensor]) -> None:
        """Nothing: each backward already summed the shards' gradients across ranks (``shard_model``)."""

    def clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip ``params``' gradients by the norm of the whole model's gradient (a collective) and return that norm,
        equal on every rank."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=False)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, norm,
                                             foreach=False)
        return norm

    def most(self, count: int) -> int:
        """The largest ``count`` over the ranks: each of this rank's ``count`` micro-batches is one forward (and
        backward) of the sharded model, which every rank must run as often as the busiest one does."""
        most = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.control)
        return int(most)


def sharded_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0,
                      betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over the model's sharded parameters: its moments are shards too (``foreach=False``: the per-tensor
    loop, the same arithmetic an unsharded AdamW with ``foreach=False`` does, for the equality tests)."""
    if not isinstance(model, FSDPModule):
        raise ValueError("sharded_optimizer takes a model shard_model has wrapped; an unsharded one would hold "
                         "full optimiser state on every rank")
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                             foreach=False)


def masked_token_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, total_tokens: float,
                      advantages: torch.Tensor | None = None) -> torch.Tensor:
    """``-sum_t A_b * mask_bt * logp_bt / total_tokens``: a policy-gradient loss over this rank's rows.

    ``logprobs``, ``loss_mask``: ``[B, T-1]`` (the log-prob of each next token, 1 where it is trained);
    ``advantages``: ``[B]`` (1 for every row if None, i.e. the masked negative log-likelihood);
    ``total_tokens``: the mask's sum over the **whole** batch (all ranks), so the ranks' losses add up to the
    one-process loss and their summed gradients to its gradient.
    """
    if total_tokens <= 0:
        raise ValueError(f"total_tokens is {total_tokens}: the batch has no trained token (its loss_mask is all 0)")
    weights = loss_mask.to(logprobs.dtype)
    if advantages is not None:
        weights = weights * advantages.to(logprobs.dtype).unsqueeze(-1)
    return -(weights * logprobs).sum() / total_tokens


def global_grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The L2 norm of the whole model's gradient: each rank's shard norms combined (a collective: every rank calls
    it). A plain float tensor, equal on every rank."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        raise ValueError("no parameter has a gradient: run the backward pass before asking for its norm")
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=False)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def sharded_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, loss_mask: torch.Tensor, *, total_tokens: float | None = None,
                   advantages: torch.Tensor | None = None, max_grad_norm: float = 1.0) -> dict[str, float]:
    """One optimiser step of a sharded model on this rank's rows; every rank calls it together.

    ``input_ids``, ``attention_mask``: ``[B, T]``; ``loss_mask``: ``[B, T-1]``, aligned with the next-token
    log-probs; ``advantages``: ``[B]`` or None. ``total_tokens``: the whole batch's ``loss_mask`` sum, summed
    over the ranks here when None (one small all-reduce). A rank with no rows (``B == 0``) still takes part in
    the collectives: it runs one masked-out row of two pad tokens. Returns, equal on every rank, ``loss`` (the whole
    batch's: the ranks' shares summed), ``grad_norm`` (the whole model's, before clipping) and ``tokens``.
    """
    if input_ids.shape != attention_mask.shape or loss_mask.shape != (input_ids.shape[0], input_ids.shape[1] - 1):
        raise ValueError(f"shapes disagree: input_ids {tuple(input_ids.shape)}, attention_mask "
                         f"{tuple(attention_mask.shape)}, loss_mask {tuple(loss_mask.shape)} (want [B, T], [B, T], "
                         "[B, T-1])")
    local_tokens = loss_mask.sum().to(torch.float64)
    if total_tokens is None:
        total = local_tokens.clone()
        dist.all_reduce(total)
        total_tokens = float(total)
    if input_ids.shape[0] == 0:  # an idle rank: the all-gathers and reduce-scatters still need it
        input_ids = torch.zeros(1, 2, dtype=torch.long, device=input_ids.device)
        attention_mask = torch.ones_like(input_ids)
        loss_mask = torch.zeros(1, 1, device=input_ids.device)
        advantages = None
    optimizer.zero_grad(set_to_none=True)
    logprobs = token_logprobs(model, input_ids, attention_mask, mask=loss_mask, chunk=0)
    loss = masked_token_loss(logprobs, loss_mask, total_tokens, advantages)
    loss.backward()
    grad_norm = global_grad_norm(model)
    torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_grad_norm,
                                         grad_norm, foreach=False)
    optimizer.step()
    loss_sum = loss.detach().to(torch.float64).reshape(1)
    dist.all_reduce(loss_sum)
    return {"loss": float(loss_sum), "grad_norm": float(grad_norm), "tokens": float(total_tokens)}


def _layer_of(name: str, layers_prefix: str) -> str:
    """``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3.``; any other name -> ``""`` (the root's)."""
    if name.startswith(layers_prefix):
        index = name[len(layers_prefix):].split(".", 1)[0]
        return f"{layers_prefix}{index}."
    return ""


@torch.no_grad()
def full_state_layers(model: torch.nn.Module, *, to_cpu: bool = False,
                      dtype: torch.dtype | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The full weights of a sharded model as ``state_dict`` pieces, one decoder layer at a time (the root's
    tensors, the embeddings first and the final norm and head last, as pieces of their own), under the names an
    unsharded copy has.

    Every rank must iterate to the end together (each tensor is one all-gather); a rank that does not decode
    drops the pieces. Only the piece being yielded is full, so the peak is one piece above the shards (a layer;
    the embeddings' piece may be the largest) as long as the caller does not keep them (copy each into the
    engine, then let it go). ``to_cpu`` moves each piece to the CPU, ``dtype`` casts it (an engine in bfloat16).
    Tied weights appear under each name. The pieces are copies: later steps do not change them.
    """
    layers_prefix = "model.layers."
    piece: dict[str, torch.Tensor] = {}
    current = None
    for name, tensor in model.state_dict().items():
        group = _layer_of(name, layers_prefix)
        if piece and group != current:
            yield piece  # consecutive names of one layer (or of the root) make one piece
            piece = {}
        current = group
        full = _full_copy(tensor)
        if to_cpu:
            full = full.cpu()
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        piece[name] = full
    if piece:
        yield piece


def _full_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor`` in memory of its own. On a mesh of one rank ``full_tensor`` returns the live shard
    itself, which the next optimiser step would change under the caller (``tests/test_sharded.py`` caught it)."""
    if not isinstance(tensor, DTensor):
        return tensor.detach().clone()
    full = tensor.full_tensor()
    if full.untyped_storage().data_ptr() == tensor.to_local().untyped_storage().data_ptr():
        full = full.clone()
    return full


def sync_engine(model: torch.nn.Module, engine, *, version: int, decodes: bool) -> int:
    """Give ``engine`` the sharded model's full weights, one layer at a time (``engine.load_weights(..., partial=
    True)``, which ctxrl's HF and fast engines take). Every rank calls it; those with ``decodes`` False only take
    part in the gathers. Returns the number of tensors loaded here."""
    loaded = 0
    for piece in full_state_layers(model):
        if decodes:
            engine.load_weights(piece, version=version, partial=True)
            loaded += len(piece)
    return loaded
