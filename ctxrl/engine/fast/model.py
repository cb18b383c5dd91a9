"""The decoder forward the fast engine runs: the HF model's own modules, attention over a slot cache.

Embeddings, norms, projections, MLPs and the LM head are the HF modules' own weights, so their
in-place updates reach the engine and the numerics match the learner's. Two changes of layout, not of
maths: the q/k/v and the gate/up projections run as one matrix product each over their weights laid
end to end (``joined``: the modules' parameters become views of the joined tensors), and on CUDA the
rotary positions and the cache write are one kernel (``kv_write``). Attention is the engine's: each new
token's keys and values are written in place into its slot of a preallocated cache (``SlotCache``), and
queries attend to their slot's keys without expanding grouped K/V to every query head: the query heads
that share a KV head are folded into the query axis (``[rows, kv_heads, group * queries, head_dim]``), so one
scaled-dot-product call reads each cached key once.

Supported families: decoders with Llama's layout (Llama, Qwen2, Qwen2.5, Qwen3 with its q/k
norms, Mistral without a sliding window; ``ctxrl.models.layout``). ``unsupported_reason`` says why
another model cannot run here; the engine factory then falls back to ``HFEngine``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import ctxrl.engine.fast.kv_write as kv_write
from ctxrl.engine.fast.attention import decode_attention
from ctxrl.engine.fast.joined import JoinedLayer, join_layer
from ctxrl.models.fused import Fused, rotated_qkv
from ctxrl.models.layout import norm_args as _norm_args
from ctxrl.models.layout import unsupported_reason

__all__ = ["Batch", "DecoderView", "SlotCache", "bucket", "to_device", "unsupported_reason"]


class SlotCache:
    """Keys and values of every layer, ``[slots, kv_heads, capacity, head_dim]`` each, written in place.

    All layers' keys are one tensor (``k_all``, ``[layers, slots, ...]``; the same for values) and ``k[i]`` is
    layer ``i``'s view of it, so copying prefixes between slots is one indexed copy for every layer at once
    (``copy_prefixes``), not one per layer and slot."""

    COPY_BYTES = 256 << 20
    """Most bytes one batched copy gathers at once (its temporary); more copies run in several batches."""

    def __init__(self, layers: int, slots: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (layers, slots, kv_heads, capacity, head_dim)
        self.k_all = torch.zeros(shape, dtype=dtype, device=device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))
        self.slots, self.capacity = slots, capacity

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_all, self.v_all))

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make slot ``dst`` hold the first ``length`` positions of slot ``src``."""
        self.k_all[:, dst, :, :length].copy_(self.k_all[:, src, :, :length])
        self.v_all[:, dst, :, :length].copy_(self.v_all[:, src, :, :length])

    def copy_prefixes(self, copies: list[tuple[int, int, int]]) -> None:
        """Each ``(src, dst, length)`` of ``copies``, in order; see ``copy_prefix``.

        Where no destination is also a source (or twice a destination), order cannot matter and the copies run
        batched: every layer's first ``max(length)`` positions of all the sources gathered at once, then written
        to the destinations. A destination receives positions past its own length too; nothing reads them
        before a prefill or a decode step writes them (a row reads its slot only below its own position)."""
        copies = [(s, d, n) for s, d, n in copies if n > 0 and s != d]
        if not copies:
            return
        dsts = [d for _, d, _ in copies]
        if len(set(dsts)) < len(dsts) or set(dsts) & {s for s, _, _ in copies}:
            for src, dst, length in copies:
                self.copy_prefix(src, dst, length)
            return
        length = max(n for _, _, n in copies)
        layers, _, heads, _, dim = self.k_all.shape
        per_copy = layers * heads * length * dim * self.k_all.element_size()
        batch = max(1, self.COPY_BYTES // max(1, per_copy))
        for start in range(0, len(copies), batch):
            part = copies[start:start + batch]
            src = to_device([s for s, _, _ in part], self.k_all.device)
            dst = to_device([d for _, d, _ in part], self.k_all.device)
            for cache in (self.k_all, self.v_all):
                cache[:, dst, :, :length] = cache[:, src, :, :length]


def to_device(values: list[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` as a tensor on ``device`` without waiting for the device: on CUDA through pinned host memory and
    a non-blocking copy (``torch.tensor(values, device="cuda")`` waits for every kernel queued before it, which
    stalls the engine's host thread behind a whole decode chunk)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class Batch:
    """Where the tokens of one forward pass go.

    ``tokens``, ``positions`` and ``slots`` are flat (one entry per new token); ``rows`` are the
    cache slots attended over (``None``: slots ``0..n-1`` in order, the decode layout), ``row_of``
    and ``offset`` place each token in its row's padded query block of width ``width``, and
    ``key_len`` is how many cached positions attention reads (a bucket at least as long as the
    longest row).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor | None
    row_of: torch.Tensor | None
    offset: torch.Tensor | None
    width: int
    n_rows: int
    key_len: int


def bucket(n: int, smallest: int, largest: int) -> int:
    """The power-of-two multiple of ``smallest`` at least ``n``, at most ``largest``: few distinct shapes (a
    ``key_len`` or a decode batch), so compiled kernels and captured graphs are reused."""
    size = smallest
    while size < n:
        size *= 2
    return min(size, largest)


class DecoderView:
    """Runs an HF Llama-layout causal LM over a ``SlotCache``; see the module docstring."""

    def __init__(self, model, max_positions: int, compile: bool = False, *, join: bool = True,
                 fuse_kv_write: bool = True) -> None:
        """``join``: the joined products (``joined``); ``fuse_kv_write``: the rotary-and-write kernel where it can run
        (``kv_write.kernel_ready``). Both on by default; off, the modules' own products and the unfused steps
        (what a benchmark compares against)."""
        self.model = model
        self.fused = Fused(compile)
        self.inner = model.model
        config = model.config
        self.layers = list(self.inner.layers)
        self.joined = [join_layer(layer) if join else JoinedLayer(None, None) for layer in self.layers]
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.q_heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.q_heads
        self.group = self.q_heads // self.kv_heads
        self.scaling = attn.scaling
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        # cos/sin for every position, computed by the model's own rotary module (its scaling included).
        with torch.no_grad():
            positions = torch.arange(max_positions, device=self.device).unsqueeze(0)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self.inner.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # [max_positions, head_dim]
        self.kernel_write = (fuse_kv_write and not hasattr(attn, "q_norm")
                             and all(j.qkv is not None for j in self.joined)
                             and kv_write.kernel_ready(self.cos, self.head_dim))
        """Every layer's rotation and cache write runs as ``kv_write``'s kernel (which reads the cos/sin tables by
        position itself)."""

    def cache_bytes(self, slots: int, capacity: int) -> int:
        """What ``new_cache(slots, capacity)`` allocates."""
        per_token = 2 * len(self.layers) * self.kv_heads * self.head_dim * self.dtype.itemsize
        return per_token * slots * capacity

    def new_cache(self, slots: int, capacity: int) -> SlotCache:
        return SlotCache(len(self.layers), slots, self.kv_heads, capacity, self.head_dim, self.dtype, self.device)

    def forward(self, batch: Batch, cache: SlotCache, last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (in the model's dtype) of the tokens at flat indices ``last`` (all tokens if ``None``)."""
        f = self.fused
        x = self.inner.embed_tokens(batch.tokens)  # [T, hidden]
        cos = sin = None
        if not self.kernel_write:
            cos = self.cos[batch.positions].unsqueeze(1)  # [T, 1, head_dim]
            sin = self.sin[batch.positions].unsqueeze(1)
        write_pos = batch.positions.clamp(max=cache.capacity - 1)
        mask = None
        if batch.rows is not None:  # prefill: each query sees its slot's positions up to its own
            keys = torch.arange(batch.key_len, device=x.device)
            query_pos = torch.zeros(batch.n_rows, batch.width, dtype=torch.long, device=x.device)
            query_pos[batch.row_of, batch.offset] = batch.positions
            mask = (keys.view(1, 1, -1) <= query_pos.unsqueeze(-1))  # [n, width, key_len]
            mask = mask.unsqueeze(1).expand(-1, self.group, -1, -1).reshape(batch.n_rows, 1, -1, batch.key_len)
        h = f.rms_norm(x, *_norm_args(self.layers[0].input_layernorm))
        for index, layer in enumerate(self.layers):
            out = self._attention(layer.self_attn, h, cos, sin, batch, cache, index, write_pos, mask)
            x, h = f.add_rms_norm(x, out, *_norm_args(layer.post_attention_layernorm))
            mlp, gate_up = layer.mlp, self.joined[index].gate_up
            if gate_up is not None:
                out = mlp.down_proj(f.silu_mul_joined(F.linear(h, gate_up.weight, gate_up.bias)))
            else:
                out = mlp.down_proj(f.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
            if index + 1 < len(self.layers):
                x, h = f.add_rms_norm(x, out, *_norm_args(self.layers[index + 1].input_layernorm))
            else:
                x = x + out
        if last is not None:
            x = x[last]
        return self.model.lm_head(f.rms_norm(x, *_norm_args(self.inner.norm)))

    def _attention(self, attn, h, cos, sin, batch: Batch, cache: SlotCache, index: int, write_pos, mask):
        cache_k, cache_v = cache.k[index], cache.v[index]
        qkv = self.joined[index].qkv
        if qkv is not None and not hasattr(attn, "q_norm"):  # Qwen3's per-head norms come before the rotation
            joined = F.linear(h, qkv.weight, qkv.bias)
            if self.kernel_write:
                q = kv_write.rope_write(joined, self.cos, self.sin, batch.positions, batch.slots, write_pos, cache_k,
                                        cache_v, self.q_heads, self.kv_heads, self.head_dim)
            else:
                q = kv_write.reference(self.fused, joined, cos, sin, batch.slots, write_pos, cache_k, cache_v,
                                       self.q_heads, self.kv_heads, self.head_dim)
        else:
            q, k, v = rotated_qkv(self.fused, attn, h, cos, sin, self.q_heads, self.kv_heads, self.head_dim)
            cache_k[batch.slots, :, write_pos] = k.to(cache_k.dtype)
            cache_v[batch.slots, :, write_pos] = v.to(cache_v.dtype)
        n, width, g = batch.n_rows, batch.width, self.group
        if batch.rows is None:  # decode, width 1: the group is the query axis
            query = q.view(n, self.kv_heads, g, self.head_dim)
            out = decode_attention(query, cache_k, cache_v, write_pos, self.scaling, batch.key_len)
            return attn.o_proj(out.reshape(n, self.q_heads * self.head_dim))
        keys = cache_k.index_select(0, batch.rows)[:, :, : batch.key_len]
        values = cache_v.index_select(0, batch.rows)[:, :, : batch.key_len]
        padded = q.new_zeros(n, width, self.q_heads, self.head_dim)
        padded[batch.row_of, batch.offset] = q
        query = padded.view(n, width, self.kv_heads, g, self.head_dim).permute(0, 2, 3, 1, 4)
        query = query.reshape(n, self.kv_heads, g * width, self.head_dim)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scaling)
        out = out.view(n, self.kv_heads, g, width, self.head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(n, width, self.q_heads * self.head_dim)[batch.row_of, batch.offset]
        return attn.o_proj(out)
