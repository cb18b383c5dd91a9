"""Per-token log-probs and entropy of a causal LM, without holding full-vocabulary logits.

``token_logprobs(model, ids, attention_mask)`` gives ``log p(ids[t+1] | ids[:t+1])`` for every
position, as ``[B, T-1]``. Done naively (``model(...).logits``) it materialises ``B x T x V``
logits in float32: 10 GB for 32 sequences of 512 tokens with Qwen's 152k vocabulary, and a
second copy for the softmax's backward. Here, given ``chunk > 0``:

1. the backbone runs once and gives the final hidden states ``[B, T, H]`` (``H`` is ~1000x
   smaller than ``V``);
2. only the positions the caller needs are kept (``mask``: the loss mask; the rest come back as 0);
3. the output head, log-softmax and entropy run over ``chunk`` positions at a time
   (``ctxrl.learner.head.linear_logprobs``: one pass over the vocabulary, the logits freed after the
   forward pass and recomputed in the backward pass), so at most one chunk's logits exist at any
   time; an entropy with a gradient (an entropy bonus) runs through autograd's own operations under
   activation checkpointing instead.

The gradient is the full computation's (the same operations, recomputed), which the tests check.
The split ``head(backbone(x))`` must reproduce ``model(x).logits``: it is checked once per model
on a short input; a model whose logits are more than a linear head of the last hidden state
(final logit soft-capping, a logit scale) falls back to full logits, with a warning.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ctxrl.algo.losses import entropy_from_logits
from ctxrl.learner.head import linear_logprobs
from ctxrl.learner.packing import flatten
from ctxrl.models.kernels import attention_kernels

_SPLITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                   mask: torch.Tensor | None = None, chunk: int = 0, with_entropy: bool = False,
                   entropy_grad: bool = False, return_logits: bool = False, position_ids: torch.Tensor | None = None,
                   extra_ids: torch.Tensor | None = None):
    """Log-probs ``[B, T-1]`` of each next token under ``model`` at ``temperature``.

    ``mask`` ``[B, T-1]``: the positions wanted (others are 0, and cost nothing in the chunked path).
    ``chunk``: positions per chunk of the output head (0 = the model's full logits).
    ``with_entropy``: also return the entropy ``[B, T-1]`` of each position's distribution, as a
    figure (no gradient) unless ``entropy_grad``: an entropy the loss never uses must not build a
    graph, or a checkpointed chunk's recomputation would keep that graph's tensors (a few bytes per
    vocabulary entry per token) alive until the backward pass ends.
    ``return_logits`` (full path only, for tests): also return the ``[B, T-1, V]`` logits.
    ``position_ids``: positions per token, for packed rows (``ctxrl.learner.packing``), whose
    ``attention_mask`` is then the 4D block-diagonal one.
    ``extra_ids`` ``[B, T-1, K]``: also return the log-probs ``[B, T-1, K]`` of these tokens at each position (a
    distillation teacher's top ``K``), with their gradient, last in the returned tuple.
    """
    if temperature <= 0:
        temperature = 1.0
    split = None if chunk <= 0 or return_logits else _split(model)
    if split is None:
        return _full(model, input_ids, attention_mask, temperature, mask, with_entropy, entropy_grad, return_logits,
                     position_ids, extra_ids)
    backbone, head = split
    extra = {} if position_ids is None else {"position_ids": position_ids}
    with attention_kernels(input_ids.device):
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
    hidden = hidden.last_hidden_state
    wanted = torch.ones_like(input_ids[:, 1:], dtype=torch.bool) if mask is None else mask.bool()
    return _head_stats(hidden[:, :-1][wanted], input_ids[:, 1:][wanted], head, wanted, temperature=temperature,
                       chunk=chunk, with_entropy=with_entropy, entropy_grad=entropy_grad,
                       extra_ids=None if extra_ids is None else extra_ids[wanted])


@torch.no_grad()
def token_topk(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, mask: torch.Tensor, k: int,
               temperature: float = 1.0, chunk: int = 1024, vocab: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From one forward pass, at each wanted position (``mask`` [B, T-1]) at ``temperature``: the log-prob of the
    next token itself [B, T-1] (``token_logprobs``'s figure), the ``k`` likeliest next tokens [B, T-1, k] and their
    probabilities [B, T-1, k]; zeros elsewhere. Through the backbone and
    ``chunk`` positions of the head at a time where the model splits (``_split``), else the full logits.
    ``vocab > 0``: only ids below it are candidates (a head padded past the tokenizer; the probabilities are still
    of the whole distribution)."""
    if temperature <= 0:
        temperature = 1.0
    wanted = mask.bool()
    targets = input_ids[:, 1:][wanted]
    ids = torch.zeros((*wanted.shape, k), dtype=torch.long, device=input_ids.device)
    probs = torch.zeros((*wanted.shape, k), dtype=torch.float32, device=input_ids.device)
    split = _split(model) if chunk > 0 else None
    if split is None:
        with attention_kernels(input_ids.device):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        states, project = logits[wanted], (lambda x: x)
    else:
        backbone, head = split
        with attention_kernels(input_ids.device):
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        states, project = hidden[:, :-1][wanted], (lambda x: F.linear(x, head.weight, head.bias))
    step = chunk if chunk > 0 else max(int(states.shape[0]), 1)
    target_parts, top_ids, top_probs = [], [], []
    for start in range(0, states.shape[0], step):
        logprobs = torch.log_softmax(_at_least_fp32(project(states[start:start + step])) / temperature, dim=-1)
        target_parts.append(logprobs.gather(-1, targets[start:start + step].unsqueeze(-1)).squeeze(-1))
        values, index = (logprobs[:, :vocab] if vocab > 0 else logprobs).topk(k, dim=-1)
        top_ids.append(index)
        top_probs.append(values.exp().float())
    if top_ids:
        ids[wanted] = torch.cat(top_ids)
        probs[wanted] = torch.cat(top_probs)
    return _scatter(target_parts, wanted, wanted.device), ids, probs


def flat_token_logprobs(decoder, input_ids: torch.Tensor, lengths: torch.Tensor, *, mask: torch.Tensor,
                        temperature: float = 1.0, chunk: int = 1024, with_entropy: bool = False,
                        entropy_grad: bool = False, extra_ids: torch.Tensor | None = None):
    """``token_logprobs`` through a ``FlatDecoder`` (``ctxrl.learner.flat``): the rows of ``input_ids`` ([B, T],
    right-padded to ``lengths``) run laid end to end, without padding; the results come back ``[B, T-1]``.
    ``mask`` is required and must lie within each row's length (a loss mask does); ``extra_ids`` as there."""
    if temperature <= 0:
        temperature = 1.0
    flat = flatten(input_ids, lengths)
    wanted = mask.bool()
    at = flat.index(wanted)  # (refuses a mask past a row's end)
    with attention_kernels(input_ids.device):
        hidden = decoder.hidden_states(flat.ids, flat.positions, flat.cu_seqlens, flat.longest)
    return _head_stats(hidden[at], flat.ids[at + 1], decoder.head, wanted, temperature=temperature,
                       chunk=chunk if chunk > 0 else max(int(at.numel()), 1), with_entropy=with_entropy,
                       entropy_grad=entropy_grad, extra_ids=None if extra_ids is None else extra_ids[wanted])


def tree_token_logprobs(model, packed, *, temperature: float = 1.0, chunk: int = 1024, with_entropy: bool = False,
                        entropy_grad: bool = False):
    """``token_logprobs`` of a packed tree (``ctxrl.learner.shared_prefix.layout.TreePack``), one value per node
    ``[L]``: node ``q``'s token scored at its parent's hidden state, at the nodes some row's loss mask wants (0
    elsewhere); with ``with_entropy``, each wanted node's entropy too. One forward pass with the tree's ancestor mask
    and positions, then the chunked head at the wanted nodes' parents, as the padded pass does at its rows'
    positions (``TreePack.unpack`` gives the rows' ``[B, T-1]`` layout)."""
    if temperature <= 0:
        temperature = 1.0
    from ctxrl.learner.shared_prefix.layout import tree_inputs

    at = packed.wanted.nonzero(as_tuple=True)[0]
    targets = packed.input_ids[0, at]
    split = _split(model) if chunk > 0 else None
    inputs, kernel = tree_inputs(model, packed)
    if split is not None:
        backbone, head = split
        with kernel:
            hidden = backbone(**inputs).last_hidden_state[0]
        return _head_stats(hidden[packed.parent[at]], targets, head, packed.wanted, temperature=temperature,
                           chunk=chunk, with_entropy=with_entropy, entropy_grad=entropy_grad)
    with kernel:
        logits = _at_least_fp32(model(**inputs).logits[0][packed.parent[at]])
    if temperature != 1.0:
        logits = logits / temperature
    values = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    logprobs = values.new_zeros(packed.wanted.shape).index_put((at,), values)
    if not with_entropy:
        return logprobs
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = values.new_zeros(packed.wanted.shape).index_put((at,), entropy_from_logits(logits))
    return logprobs, entropy


def _head_stats(states, targets, head, wanted, *, temperature, chunk, with_entropy, entropy_grad, extra_ids=None):
    """Log-probs (and entropy) of ``targets`` at hidden ``states`` [n, H], ``chunk`` at a time, scattered into
    ``wanted``'s shape; with ``extra_ids`` [n, K], the log-probs of those tokens too (through autograd's own
    operations under activation checkpointing, as an entropy with a gradient is)."""
    logprob_parts, entropy_parts, extra_parts = [], [], []
    for start in range(0, states.shape[0], chunk):
        if extra_ids is not None:
            args = (states[start:start + chunk], head.weight, head.bias, targets[start:start + chunk], temperature,
                    with_entropy, entropy_grad, extra_ids[start:start + chunk])
            lp, ent, extra = (checkpoint(_chunk_stats, *args, use_reentrant=False) if torch.is_grad_enabled()
                              else _chunk_stats(*args))
            logprob_parts.append(lp)
            entropy_parts.append(ent)
            extra_parts.append(extra)
            continue
        if not (with_entropy and entropy_grad):  # the fused head: one pass over the vocabulary, no checkpoint
            lp, ent = linear_logprobs(states[start:start + chunk], head.weight, head.bias,
                                      targets[start:start + chunk], temperature, with_entropy)
            logprob_parts.append(lp)
            entropy_parts.append(ent)
            continue
        args = (states[start:start + chunk], head.weight, head.bias, targets[start:start + chunk], temperature,
                with_entropy, entropy_grad)
        if torch.is_grad_enabled():
            lp, ent, _ = checkpoint(_chunk_stats, *args, use_reentrant=False)
        else:
            lp, ent, _ = _chunk_stats(*args)
        logprob_parts.append(lp)
        entropy_parts.append(ent)
    out = [_scatter(logprob_parts, wanted, wanted.device)]
    if with_entropy:
        out.append(_scatter(entropy_parts, wanted, wanted.device))
    if extra_ids is not None:
        out.append(_scatter_rows(extra_parts, wanted, extra_ids.shape[-1], out[0].dtype))
    return out[0] if len(out) == 1 else tuple(out)


def _chunk_stats(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                 temperature: float, with_entropy: bool, entropy_grad: bool, extra_ids: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets``, (optionally) entropy, and (optionally) the log-probs of ``extra_ids`` [n, K] at
    ``states`` [n, H] through the head ``weight``."""
    logits = _at_least_fp32(F.linear(states, weight, bias))
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    extra = None if extra_ids is None else logits.gather(-1, extra_ids) - lse.unsqueeze(-1)
    if not with_entropy:
        return logprobs, logprobs.new_zeros(()), extra
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logprobs, entropy_from_logits(logits), extra


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Softmax maths in float32 (or float64, for a float64 model: the tests' exact comparisons)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def _scatter(parts: list[torch.Tensor], wanted: torch.Tensor, device) -> torch.Tensor:
    values = torch.cat(parts) if parts else torch.zeros(0)
    out = torch.zeros(wanted.shape, dtype=values.dtype if parts else torch.float32, device=device)
    if parts and wanted.any():
        out = out.masked_scatter(wanted, values)
    return out


def _scatter_rows(parts: list[torch.Tensor], wanted: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """``[n, K]`` rows into ``[*wanted.shape, K]`` at ``wanted``'s positions (zeros elsewhere), keeping the graph."""
    out = torch.zeros((*wanted.shape, k), dtype=dtype, device=wanted.device)
    if parts and wanted.any():
        out = out.index_put((wanted,), torch.cat(parts).to(dtype))
    return out


def _full(model, input_ids, attention_mask, temperature, mask, with_entropy, entropy_grad, return_logits,
          position_ids=None, extra_ids=None):
    """The plain computation: the model's full logits."""
    extra = {} if position_ids is None else {"position_ids": position_ids}
    with attention_kernels(input_ids.device):
        logits = _at_least_fp32(model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits[:, :-1])
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:]
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if mask is not None:
        logprobs = logprobs * mask
    out = [logprobs]
    if with_entropy:
        wanted = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask.bool()
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = torch.zeros_like(logprobs)
            entropy[wanted] = entropy_from_logits(logits[wanted])
        out.append(entropy)
    if extra_ids is not None:
        extra = logits.gather(-1, extra_ids) - torch.logsumexp(logits, dim=-1, keepdim=True)
        out.append(extra if mask is None else extra * mask.unsqueeze(-1))
    if return_logits:
        out.append(logits)
    return out[0] if len(out) == 1 else tuple(out)


def _split(model):
    """``(backbone, head)`` with ``model(x).logits == head(backbone(x).last_hidden_state)``, or None."""
    if model in _SPLITS:
        return _SPLITS[model]
    split = _find_split(model)
    if split is not None and not _agrees(model, *split):
        warnings.warn(f"{type(model).__name__}'s logits are not a linear head of its last hidden state (e.g. logit "
                      "soft-capping); computing log-probs from full logits, which needs more memory",
                      stacklevel=3)
        split = None
    _SPLITS[model] = split
    return split


def _find_split(model):
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model wraps the LM
    prefix = getattr(lm, "base_model_prefix", "")
    backbone = getattr(lm, prefix, None) if prefix else None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if backbone is None or backbone is lm or not isinstance(head, torch.nn.Linear):
        return None
    return backbone, head


@torch.no_grad()
def _agrees(model, backbone, head) -> bool:
    device = head.weight.device
    ids = torch.arange(3, 11, device=device).unsqueeze(0) % head.weight.shape[0]
    attention = torch.ones_like(ids)
    was_training = model.training
    model.eval()
    try:
        with attention_kernels(device):
            full = model(input_ids=ids, attention_mask=attention).logits.float()
            hidden = backbone(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
        split = head(hidden).float()
    finally:
        model.train(was_training)
    scale = full.abs().max().clamp(min=1.0)
    return bool(((full - split).abs().max() / scale) < 1e-2)
