"""Rotary positions and the cache write in one kernel: from the joined q/k/v product to rotated queries and the
slot cache's new keys and values.

Per token, from ``qkv`` ``[T, (q_heads + 2 kv_heads) * head_dim]`` (``joined``'s product: q's columns, then
k's, then v's): the queries rotated (``[T, q_heads, head_dim]``, returned), the keys rotated and written with
the values into the token's slot at its position (``cache_k[slot, :, pos]``, ``cache_v[slot, :, pos]``). The
rotation is HF's ``rotate_half`` form, ``x * cos + rotate_half(x) * sin``, computed in float32 and rounded
once, as the compiled ``fused.rotate`` computes it.

Unfused, these are five kernels a layer (two rotations, a copy of v, two indexed writes); on CUDA with Triton
they are one program per (token, head): a query head, or a key head with its value head. Elsewhere (CPU, no
Triton, a head size that is not a power of two) the same steps run as before (``reference``).
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU builds go without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def reference(fused, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
              write_pos: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, q_heads: int, kv_heads: int,
              head_dim: int) -> torch.Tensor:
    """The unfused steps: ``fused.rotate`` of q and k (``cos``/``sin`` ``[T, 1, head_dim]``), indexed writes."""
    tokens = qkv.shape[0]
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = fused.rotate(q.reshape(tokens, q_heads, head_dim), cos, sin)
    k = fused.rotate(k.reshape(tokens, kv_heads, head_dim), cos, sin)
    cache_k[slots, :, write_pos] = k.to(cache_k.dtype)
    cache_v[slots, :, write_pos] = v.reshape(tokens, kv_heads, head_dim).to(cache_v.dtype)
    return q


if triton is not None:

    @triton.jit
    def _rope_write_kernel(QKV, COS, SIN, POS, SLOT, WPOS, QOUT, CK, CV,
                           s_qkv, s_cos, s_qo_t, s_qo_h, s_c_b, s_c_h, s_c_l,
                           Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, HALF)
        pos = tl.load(POS + t)
        cos1 = tl.load(COS + pos * s_cos + d).to(tl.float32)
        cos2 = tl.load(COS + pos * s_cos + HALF + d).to(tl.float32)
        sin1 = tl.load(SIN + pos * s_cos + d).to(tl.float32)
        sin2 = tl.load(SIN + pos * s_cos + HALF + d).to(tl.float32)
        row = QKV + t * s_qkv
        if h < Q_HEADS:
            x1 = tl.load(row + h * 2 * HALF + d).to(tl.float32)
            x2 = tl.load(row + h * 2 * HALF + HALF + d).to(tl.float32)
            out = QOUT + t * s_qo_t + h * s_qo_h
            tl.store(out + d, (x1 * cos1 - x2 * sin1).to(QOUT.dtype.element_ty))
            tl.store(out + HALF + d, (x2 * cos2 + x1 * sin2).to(QOUT.dtype.element_ty))
        else:
            kh = h - Q_HEADS
            slot = tl.load(SLOT + t)
            where = tl.load(WPOS + t)
            k_in = row + (Q_HEADS + kh) * 2 * HALF
            x1 = tl.load(k_in + d).to(tl.float32)
            x2 = tl.load(k_in + HALF + d).to(tl.float32)
            k_out = CK + slot * s_c_b + kh * s_c_h + where * s_c_l
            tl.store(k_out + d, (x1 * cos1 - x2 * sin1).to(CK.dtype.element_ty))
            tl.store(k_out + HALF + d, (x2 * cos2 + x1 * sin2).to(CK.dtype.element_ty))
            v_in = row + (Q_HEADS + KV_HEADS + kh) * 2 * HALF
            v_out = CV + slot * s_c_b + kh * s_c_h + where * s_c_l
            tl.store(v_out + d, tl.load(v_in + d))
            tl.store(v_out + HALF + d, tl.load(v_in + HALF + d))


def kernel_ready(qkv: torch.Tensor, head_dim: int) -> bool:
    """Whether the Triton kernel serves these inputs: CUDA, Triton, a power-of-two head size of at least 16."""
    return triton is not None and qkv.is_cuda and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def rope_write(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, write_pos: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
               q_heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The rotated queries ``[T, q_heads, head_dim]``; the rotated keys and the values written into the cache.

    ``cos_table``/``sin_table`` ``[positions, head_dim]`` are indexed by ``positions`` (the rotation's); the
    write goes to ``write_pos`` of each token's slot. The caller checks ``kernel_ready``; the cache must be
    contiguous in its last dimension and in the model's dtype."""
    tokens = qkv.shape[0]
    qkv = qkv.contiguous()
    out = torch.empty(tokens, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return out
    _rope_write_kernel[(tokens, q_heads + kv_heads)](
        qkv, cos_table, sin_table, positions, slots, write_pos, out, cache_k, cache_v,
        qkv.stride(0), cos_table.stride(0), out.stride(0), out.stride(1),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HALF=head_dim // 2)
    return out
