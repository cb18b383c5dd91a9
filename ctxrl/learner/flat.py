"""The decoder's forward pass over sequences laid end to end, for the learner.

HF's forward pass over a right-padded batch spends compute on padding, builds a mask per call,
and runs a dozen small element-wise kernels per norm, rotation and activation; on a 0.5B model
those kernels, not the matrix products, were most of a training step (docs/performance.md).
``FlatDecoder`` runs the same model differently:

- **No padding.** The micro-batch's sequences are concatenated into one ``[N]`` row of tokens
  with positions restarting at each sequence (``ctxrl.learner.packing.flatten``); attention is
  causal within each sequence, from cumulative sequence lengths (flash attention's variable-
  length kernel on CUDA; one causal SDPA call per sequence elsewhere). Grouped K/V is read as it
  is where the kernel allows (``enable_gqa``), expanded otherwise.
- **The model's own weights.** Embeddings, projections, MLPs and the output head are the HF
  modules' weights, used on ``[N, hidden]``, so their gradients and the optimiser are the ones
  the rest of ctxrl uses. The q, k and v projections run as one matrix product over the three
  weights laid end to end (``fused.qkv_projections``). The MLP keeps only its two projections'
  outputs for the backward pass and recomputes the SiLU and product there (``gated_mlp``: half its
  activations). Norms, rotary embedding, residual adds and the gated SiLU use
  ``ctxrl.models.fused`` (the same arithmetic as the HF modules, compiled into few kernels on
  CUDA, forward and backward).
- **Checked.** The first use compares it with the HF forward pass on a short input; a model it
  does not reproduce (``check_tolerance``) is refused, and the learner uses the HF path.

Layer by layer activation checkpointing follows the model's own setting
(``gradient_checkpointing_enable``). Supported models: ``ctxrl.models.layout``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ctxrl.learner.layer_graphs import Bucket, CaptureFailed, LayerGraphs, pad
from ctxrl.models.fused import Fused, guarded_compile, rotated_qkv
from ctxrl.models.fused import rms_norm as fused_rms_norm
from ctxrl.models.fused import rotate as fused_rotate
from ctxrl.models.gated_mlp import gated_mlp, supports
from ctxrl.models.layout import norm_args, rope_type, unsupported_reason

log = logging.getLogger(__name__)


class FlatDecoder:
    """Final hidden states of a Llama-layout HF causal LM over flat packed sequences (module docstring)."""

    def __init__(self, model, *, compile: bool = False, compile_layers: bool = False, graphed: bool = False) -> None:
        reason = unsupported_reason(model, 0, training=True)
        if reason is not None:
            raise ValueError(f"{type(model).__name__} cannot run through the flat forward pass: {reason}")
        self._model = weakref.ref(model)  # (the cache of decoders is keyed weakly by the model)
        self.head = model.lm_head
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.fused = Fused(compile)
        self.lean_mlp = all(supports(layer.mlp) for layer in self.layers)
        """The MLPs keep ``2 I`` values a token for the backward pass, not ``4 I`` (``ctxrl.models.gated_mlp``)."""
        config = model.config
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.q_heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.q_heads
        self.scaling = attn.scaling
        window = getattr(config, "sliding_window", None)
        self.window = int(window) if window and getattr(config, "use_sliding_window", True) else None
        """Sequences longer than a sliding window are not for this pass (``fits``): the HF pass applies the window."""
        self.exact_rotary = rope_type(config) == "longrope"  # its tables depend on the length: never rounded up
        self._cos = self._sin = None
        self.compiled_layers = None
        """Each decoder layer as one compiled graph (``layer_math``: ``train.flat_forward = "compiled"``), or None."""
        if compile_layers:
            self.compiled_layers = guarded_compile(layer_math, "a decoder layer", fullgraph=False)
        self.graphs = LayerGraphs(self.layers, self._block) if graphed else None
        """The layers as CUDA graphs for a training micro-batch (``train.flat_forward = "graphed"``), or None."""

    def fits(self, longest: int) -> bool:
        """Whether sequences of ``longest`` tokens run here exactly (not past a sliding window)."""
        return self.window is None or longest <= self.window

    def rotary(self, positions: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[N, 1, head_dim]`` of each token's position, by the model's own rotary module."""
        stale = self._cos is None or self._cos.shape[0] < longest or (self.exact_rotary and
                                                                      self._cos.shape[0] != longest)
        if stale:
            # grown by powers of two: few recomputations (longrope: exactly ``longest``, as HF computes it)
            size = longest if self.exact_rotary else 1 << max(longest - 1, 1).bit_length()
            param = self.inner.embed_tokens.weight
            with torch.no_grad():
                probe = torch.zeros(1, dtype=param.dtype, device=param.device)
                cos, sin = self.inner.rotary_emb(probe, torch.arange(size, device=param.device).unsqueeze(0))
            self._cos, self._sin = cos[0], sin[0]
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)

    def hidden_states(self, ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                      longest: int) -> torch.Tensor:
        """``[N, hidden]`` final (normed) hidden states of the flat tokens ``ids`` ``[N]``.

        ``positions`` ``[N]``: each token's position in its sequence; ``cu_seqlens`` ``[S + 1]`` int32:
        where each sequence starts (and the total); ``longest``: the longest sequence.
        """
        model = self._model()
        recompute = torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", False)
                                                    for m in (model, self.inner, self.layers[0]))
        # (longrope's tables depend on the length asked for: a bucket's longer one would change the real tokens')
        if (self.graphs is not None and torch.is_grad_enabled() and not recompute and not self.exact_rotary
                and self.inner.embed_tokens.weight.requires_grad):
            return self._graphed(ids, positions, cu_seqlens, longest)
        cos, sin = self.rotary(positions, longest)
        x = self.inner.embed_tokens(ids)
        block = self._compiled_block if self.compiled_layers is not None else self._block
        for layer in self.layers:
            if recompute:
                x = checkpoint(block, layer, x, cos, sin, cu_seqlens, longest, use_reentrant=False)
            else:
                x = block(layer, x, cos, sin, cu_seqlens, longest)
        return self.fused.rms_norm(x, *norm_args(self.inner.norm))

    def _graphed(self, ids, positions, cu_seqlens, longest):
        """``hidden_states`` through the layers' CUDA graphs: the micro-batch laid into a bucket, then cut back."""
        n = ids.shape[0]
        bucket = Bucket.covering(n, cu_seqlens.shape[0] - 1, longest, current=self.graphs.bucket,
                                 min_tokens=self.graphs.min_tokens)
        padded_ids, padded_positions, padded_cu = pad(ids, positions, cu_seqlens, bucket)
        cos, sin = self.rotary(padded_positions, bucket.longest)
        try:
            x = self.graphs.run(self.inner.embed_tokens(padded_ids), cos, sin, padded_cu, bucket)
        except CaptureFailed as exc:  # (the eager layers still train: slower, never wrong)
            log.warning("learner: the decoder layers run eagerly from now on: %s", exc)
            self.graphs.release()
            self.graphs = None
            return self.hidden_states(ids, positions, cu_seqlens, longest)
        return self.fused.rms_norm(x[:n], *norm_args(self.inner.norm))

    def _compiled_block(self, layer, x, cos, sin, cu_seqlens, longest):
        """``_block`` as one compiled graph: the layer's tensors passed in, so every layer shares the graph."""
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon) if hasattr(
            attn, "q_norm") else None
        return self.compiled_layers(
            x, cos, sin, cu_seqlens, longest, *norm_args(layer.input_layernorm),
            [m.weight for m in projections], [m.bias for m in projections], attn.o_proj.weight, attn.o_proj.bias,
            norms, *norm_args(layer.post_attention_layernorm), mlp.gate_proj.weight, mlp.up_proj.weight,
            mlp.down_proj.weight, (self.q_heads, self.kv_heads, self.head_dim), self.scaling)

    def _block(self, layer, x, cos, sin, cu_seqlens, longest):
        f = self.fused
        h = f.rms_norm(x, *norm_args(layer.input_layernorm))
        out = self._attention(layer.self_attn, h, cos, sin, cu_seqlens, longest)
        x, h = f.add_rms_norm(x, out, *norm_args(layer.post_attention_layernorm))
        mlp = layer.mlp
        if self.lean_mlp:
            return x + gated_mlp(mlp, h, f.silu_mul_grads)
        return x + mlp.down_proj(f.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))

    def _attention(self, attn, h, cos, sin, cu_seqlens, longest):
        q, k, v = rotated_qkv(self.fused, attn, h, cos, sin, self.q_heads, self.kv_heads, self.head_dim, fuse=True)
        out = causal_attention(q, k, v, cu_seqlens, longest, self.scaling)
        return attn.o_proj(out.reshape(h.shape[0], self.q_heads * self.head_dim))


def layer_math(x, cos, sin, cu_seqlens, longest, in_norm, in_eps, qkv_weights, qkv_biases, o_weight, o_bias,
               head_norms, post_norm, post_eps, w_gate, w_up, w_down, heads, scale):
    """One Llama-layout decoder layer over flat tokens ``x`` ``[N, hidden]``, from its tensors alone: the same
    arithmetic as ``FlatDecoder._block`` through the modules, written for ``torch.compile`` to take whole (the
    q, k and v weights joined, the MLP's SiLU and product left to the compiler, which recomputes such element-wise
    steps in the backward pass rather than keep their outputs). ``heads``: (query heads, KV heads, head dim);
    ``head_norms``: Qwen3's (q weight, k weight, eps) or None."""
    q_heads, kv_heads, head_dim = heads
    tokens = x.shape[0]
    h = fused_rms_norm(x, in_norm, in_eps)
    bias = torch.cat(qkv_biases) if all(b is not None for b in qkv_biases) else None
    q, k, v = F.linear(h, torch.cat(qkv_weights), bias).split(
        [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(tokens, q_heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    v = v.reshape(tokens, kv_heads, head_dim)
    if head_norms is not None:
        q, k = fused_rms_norm(q, head_norms[0], head_norms[2]), fused_rms_norm(k, head_norms[1], head_norms[2])
    q, k = fused_rotate(q, cos, sin), fused_rotate(k, cos, sin)
    out = causal_attention(q, k, v, cu_seqlens, longest, scale)
    x = x + F.linear(out.reshape(tokens, q_heads * head_dim), o_weight, o_bias)
    h = fused_rms_norm(x, post_norm, post_eps)
    return x + F.linear(F.silu(F.linear(h, w_gate)) * F.linear(h, w_up), w_down)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, longest: int,
                     scale: float) -> torch.Tensor:
    """Causal attention within each sequence of flat ``q`` ``[N, Hq, D]``, ``k``/``v`` ``[N, Hkv, D]``."""
    varlen = _varlen() if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else None
    if varlen is not None:
        fn, causal, gqa, takes_scale = varlen
        if takes_scale or abs(scale - q.shape[-1] ** -0.5) < 1e-12:  # (an older kernel scales by 1/sqrt(D))
            if not gqa and k.shape[1] != q.shape[1]:
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            extra = {"enable_gqa": True} if gqa and k.shape[1] != q.shape[1] else {}
            if takes_scale:
                extra["scale"] = scale
            return fn(q, k, v, cu_seqlens, cu_seqlens, longest, longest, **causal, **extra)
    return per_sequence_attention(q, k, v, cu_seqlens, scale)


def per_sequence_attention(q, k, v, cu_seqlens, scale):
    """The reference (and CPU) path: one causal SDPA call per sequence."""
    group = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:  # (an empty sequence: a bucket's tail, ``ctxrl.learner.layer_graphs``)
            continue
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        if group > 1:
            ks, vs = ks.repeat_interleave(group, dim=0), vs.repeat_interleave(group, dim=0)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(out) if out else q.new_zeros(q.shape)


@functools.cache
def _varlen():
    """``(varlen_attn, its causal keyword, whether it takes enable_gqa, whether it takes scale)``, or None where
    torch has none (its signature changed between torch 2.10 and 2.12)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


MODES = ("auto", "on", "compiled", "graphed", "off")
AUTO_GRAPHED_MAX_HIDDEN = 1024
"""``auto`` on CUDA replays the layers as CUDA graphs in training (``ctxrl.learner.layer_graphs``) for models at most
this wide, whose micro-batches are otherwise bound by the host's kernel launches. Measured on an H200, the default
``ctxrl train`` step (docs/performance.md): graphed 8,192-token micro-batches against eager 32,768-token ones took
SmolLM2-135M (width 576) from 26.7 to 15.7 GiB at the same speed and Qwen2.5-0.5B's shape (896) from 41.1 to 22.8
GiB at 3.43 against 3.64 s, but made Qwen2.5-1.5B's shape (1536) 18% slower (6.78 against 5.72 s), whose kernels
are long enough to hide their launches; wider models keep the eager pass and its larger micro-batches."""


def auto_graphs(config) -> bool:
    """Whether ``train.flat_forward = auto`` runs the model of this HF config through CUDA-graphed layers: at most
    ``AUTO_GRAPHED_MAX_HIDDEN`` wide, and not longrope (whose rotary tables depend on the length asked for, so a
    bucket's padding would change them: ``FlatDecoder`` never graphs it)."""
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    hidden = getattr(config, "hidden_size", None)
    return (isinstance(hidden, int) and 0 < hidden <= AUTO_GRAPHED_MAX_HIDDEN
            and rope_type(config) != "longrope")


_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def training_decoder(model, mode: str) -> FlatDecoder | None:
    """The ``FlatDecoder`` the learner uses for ``model`` under ``train.flat_forward = mode``, or None (the HF path).

    ``auto``: on CUDA in bf16/fp16 where torch has the variable-length flash kernel, for a supported model that
    the check reproduces, with the layers replayed as CUDA graphs in training for narrow models (``auto_graphs``);
    ``on``: wherever supported (an error names why not), eager; ``compiled``: ``on``, with each decoder layer
    compiled as one graph (``layer_math``: fewer kernel launches from the host, a slower first step);
    ``graphed``: ``on``, with the layers' forward and backward passes captured as CUDA graphs
    (``ctxrl.learner.layer_graphs``; CUDA, bf16 / fp16); ``off``: never.
    Built once per model and mode.
    """
    if mode not in MODES:
        raise ValueError(f"train.flat_forward must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off":
        return None
    param = next(model.parameters())
    flash = param.device.type == "cuda" and param.dtype in (torch.bfloat16, torch.float16) and _varlen() is not None
    if mode == "auto" and not flash:
        return None  # (auto: only where the variable-length flash kernel runs; elsewhere HF's pass is faster)
    if mode == "graphed" and not flash:
        from ctxrl.errors import ConfigError

        raise ConfigError(f"train.flat_forward=graphed replays CUDA graphs of the variable-length flash kernel, which "
                          f"needs CUDA, bfloat16 or float16 and a torch that has it; this model is {param.dtype} on "
                          f"{param.device}: set train.flat_forward=on (or auto)")
    if mode == "auto":
        variant = "graphed" if auto_graphs(model.config) else "on"
    else:
        variant = mode
    built = _DECODERS.setdefault(model, {})
    if variant not in built:
        built[variant] = _checked_decoder(model, param.device, compile_layers=variant == "compiled",
                                          graphed=variant == "graphed")
        if built[variant][0] is None and mode == "auto":
            log.info("learner: the HF forward pass (flat forward unavailable: %s)", built[variant][1])
    decoder, reason = built[variant]
    if decoder is None and mode != "auto":
        from ctxrl.errors import ConfigError

        raise ConfigError(f"train.flat_forward={mode}, but {type(model).__name__} cannot use it: {reason}; set "
                          "train.flat_forward=auto (or off) to train through the HF forward pass")
    return decoder


def _checked_decoder(model, device: torch.device, *, compile_layers: bool = False, graphed: bool = False
                     ) -> tuple[FlatDecoder | None, str | None]:
    reason = unsupported_reason(model, 0, training=True)
    if reason is not None:
        return None, reason
    decoder = FlatDecoder(model, compile=device.type == "cuda", compile_layers=compile_layers, graphed=graphed)
    try:
        error = _disagreement(model, decoder)
    except Exception as exc:  # noqa: BLE001 - a kernel this machine lacks: the HF path still works
        return None, f"its check run failed ({type(exc).__name__}: {exc})"
    if error > check_tolerance(next(model.parameters()).dtype):
        return None, f"it does not reproduce the model's own forward pass (relative error {error:.2g} on a check input)"
    return decoder, None


def check_tolerance(dtype: torch.dtype) -> float:
    """How far (relative to the largest value) the flat pass's hidden states may be from HF's on the check input.

    In bfloat16 two correct forward passes that round in a different order differ by 2-3% of the largest hidden
    value after 24 layers (Qwen2.5-0.5B's shape: HF's own bf16 pass is 2.2% from its float32 pass), while the
    errors the check is for (attention across sequences, a wrong scale) are 80-140%; in float32 the flat pass is
    within 1e-6.
    """
    return 1e-3 if dtype in (torch.float32, torch.float64) else 0.25


@torch.no_grad()
def _disagreement(model, decoder: FlatDecoder) -> float:
    """Largest relative difference of final hidden states, flat vs HF forward, on two short sequences."""
    param = next(model.parameters())
    vocab = model.config.vocab_size
    lengths = [5, 9]
    ids = (torch.arange(sum(lengths), device=param.device) * 7 + 3) % vocab
    padded = torch.zeros(2, max(lengths), dtype=torch.long, device=param.device)
    padded[0, :5], padded[1] = ids[:5], ids[5:]
    attention = (torch.arange(max(lengths), device=param.device) < torch.tensor(lengths, device=param.device)
                 .unsqueeze(1)).long()
    was_training = model.training
    model.eval()
    try:
        want = model.model(input_ids=padded, attention_mask=attention, use_cache=False).last_hidden_state
        want = torch.cat([want[0, :5], want[1]])
        positions = torch.cat([torch.arange(n, device=param.device) for n in lengths])
        cu = torch.tensor([0, 5, 14], dtype=torch.int32, device=param.device)
        got = decoder.hidden_states(ids, positions, cu, max(lengths))
    finally:
        model.train(was_training)
    scale = want.float().abs().max().clamp(min=1.0)
    return float((got.float() - want.float()).abs().max() / scale)
