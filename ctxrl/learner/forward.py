"""The learner's forward passes, chosen in one place: ``choose(module, train, role)`` says how a module's
micro-batches are cut and run, and ``Forward`` cuts and runs them.

Four passes give the same log-probs (the tests check them against each other):

- **flat**: the micro-batch's sequences laid end to end without padding through ctxrl's own decoder
  (``ctxrl.learner.flat``; CUDA, Llama-layout models), where its decoder takes the micro-batch's width;
- **packed**: several sequences per row, each with its own positions and a block-diagonal mask
  (``ctxrl.learner.packing``, ``train.pack_sequences``);
- **padded**: HF's forward pass over right-padded rows (``ctxrl.learner.logprobs.token_logprobs``);
- **tree**: rows that share a prefix as one packed token trie through HF's forward pass with an ancestor-only
  mask, the prefix computed once (``ctxrl.learner.shared_prefix``, ``train.shared_prefix``): on CUDA through
  FlexAttention's block-sparse kernel (``shared_prefix.flex``), elsewhere an additive 4D mask through SDPA. Such a
  micro-batch is a ``TreeBatch``, cut by ``Forward.micro_batches``.

Who runs what (``choose``) is what ran before the choice was made here: the policy runs flat where it can, else
packed if asked, else padded; with ``train.shared_prefix = auto`` its shared trees run as trees and the rows no tree
takes run as they would without sharing (the flat decoder's variable-length kernel cannot express an ancestor mask,
so a tree never runs flat, and a forced flat pass, ``flat_forward = on | compiled | graphed``, is refused here and by
the config's validation); the KL reference, the distillation teacher, the critic and the warm start's SFT run
padded. Letting the reference and the teacher follow the policy's layout would change their log-probs on CUDA by
kernel rounding (KL and distillation figures), so it is a measured change of its own, not done here; the critic
cannot run flat until the flat decoder gives hidden states to a value head. This module does not decide micro-batch
sizes (``ctxrl.learner.batch``) nor what a run's memory plan predicts (``ctxrl.learner.sizing``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ctxrl.learner.batch import Batch, micro_batches
from ctxrl.learner.flat import FlatDecoder, training_decoder
from ctxrl.learner.logprobs import flat_token_logprobs, token_logprobs, token_topk, tree_token_logprobs
from ctxrl.learner.packing import pack
from ctxrl.learner.shared_prefix.flex import available as flex_available
from ctxrl.learner.shared_prefix.micro_batches import MODES as SHARING_MODES
from ctxrl.learner.shared_prefix.micro_batches import TreeBatch, tree_micro_batches
from ctxrl.learner.shared_prefix.plan import TREE_COST_ON_FLAT, ModelShape

ROLES = ("policy", "reference", "teacher", "critic", "sft")
"""The modules whose forward pass ``choose`` decides: the trained policy, the KL reference, the distillation
teacher, the PPO critic, the warm start's supervised policy."""


@dataclass(frozen=True)
class Layout:
    """How one module's micro-batches run: through ``decoder``'s flat pass where it takes the micro-batch's width,
    else on packed rows (``packed``) or padded ones; with ``tree`` (the model's shape, which the sharing plan weighs
    FLOPs by) the rows that share a prefix worth sharing run as one tree each (a ``TreeBatch``)."""

    decoder: FlatDecoder | None = None
    packed: bool = False
    tree: ModelShape | None = None
    tree_kernel: str = "dense"
    """How a tree's attention runs: ``dense`` (an additive mask, HF's SDPA) or ``flex`` (FlexAttention, CUDA)."""

    def kind(self, width: int) -> str:
        """``flat``, ``packed`` or ``padded``: what a micro-batch ``width`` tokens wide (its longest row) runs as."""
        if self.decoder is not None and self.decoder.fits(width):  # (past a sliding window, HF's pass)
            return "flat"
        return "packed" if self.packed else "padded"


PADDED = Layout()


def choose(module, train: Any, role: str) -> Layout:
    """The one place a forward pass is chosen: ``role``'s layout for ``module`` under ``train`` (a ``TrainConfig``:
    ``flat_forward``, ``pack_sequences``; only the policy reads it). An unusable ``flat_forward`` for ``module``
    (``on`` for a model the flat pass cannot run) is an error here, when the learner is built."""
    if role not in ROLES:
        raise ValueError(f"unknown forward role {role!r}; choose one of {', '.join(ROLES)}")
    if role != "policy":
        return PADDED
    sharing = getattr(train, "shared_prefix", "off")
    if sharing not in SHARING_MODES:
        raise ValueError(f"train.shared_prefix must be one of {', '.join(SHARING_MODES)}, not {sharing!r}")
    if sharing == "off":
        return Layout(training_decoder(module, train.flat_forward), packed=train.pack_sequences)
    shape = tree_shape(module, train.flat_forward)  # (refuses a forced flat pass before one is built)
    # the rows no tree takes run as they would without sharing: flat where the flat pass runs
    return Layout(training_decoder(module, train.flat_forward), packed=train.pack_sequences, tree=shape,
                  tree_kernel=tree_kernel(module))


def tree_kernel(module) -> str:
    """``flex`` on CUDA (FlexAttention's block-sparse kernel), unless the model trains with attention dropout,
    which only the dense mask's SDPA applies; ``dense`` elsewhere."""
    dropout = float(getattr(getattr(module, "config", None), "attention_dropout", 0.0) or 0.0)
    return "flex" if flex_available(next(module.parameters()).device) and dropout == 0.0 else "dense"


def tree_shape(module, flat_forward: str) -> ModelShape:
    """The shape the sharing plan weighs ``module``'s trees by, or an error naming the fix where a tree cannot run:
    a forced flat pass (``flat_forward`` other than ``auto`` or ``off``), an attention without additive 4D masks
    (HF's ``sdpa`` and ``eager`` take them; ``flash_attention_2`` does not), a config the FLOP estimate cannot
    read."""
    if flat_forward not in ("auto", "off"):
        raise ValueError(f"train.shared_prefix=auto runs shared trees through HF's forward pass with an ancestor "
                         f"mask, and train.flat_forward={flat_forward} forces ctxrl's flat pass, which cannot take "
                         "one: set train.flat_forward=auto (or off), or train.shared_prefix=off")
    config = getattr(module, "config", None)
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"train.shared_prefix=auto needs an attention that takes an additive 4D mask (sdpa or "
                         f"eager); this model uses {attention!r}: load it with sdpa, or set train.shared_prefix=off")
    try:
        return ModelShape.from_config(config)
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"train.shared_prefix=auto weighs a tree's FLOPs by a Llama-layout config (hidden, "
                         f"intermediate and vocabulary sizes, layers, heads); {type(module).__name__}'s cannot be "
                         f"read ({exc}): set train.shared_prefix=off") from None


class Forward:
    """``module``'s log-probs of a micro-batch's tokens as ``layout`` says, at ``temperature``, with ``chunk``
    positions of the output head at a time (``ctxrl.learner.logprobs``)."""

    def __init__(self, module, layout: Layout, *, temperature: float = 1.0, chunk: int = 1024) -> None:
        self.module = module
        self.layout = layout
        self.temperature = temperature
        self.chunk = chunk

    def runs_flat(self, width: int) -> bool:
        """Whether a micro-batch whose longest row is ``width`` tokens runs through the flat pass."""
        return self.layout.kind(width) == "flat"

    def micro_batches(self, batch: Batch, size: int, device, max_tokens: int = 0, *, padded: bool = True):
        """``(rows, micro_batch)`` pairs covering ``batch``: ``ctxrl.learner.batch.micro_batches``, or under a tree
        layout the shared trees first, each whole in one ``TreeBatch`` (``tree_micro_batches``)."""
        if self.layout.tree is None:
            return micro_batches(batch, size, device, max_tokens, padded=padded)
        # a tree's pass (HF's) costs more per FLOP than the flat pass its rows would otherwise take
        factor = TREE_COST_ON_FLAT if self.layout.decoder is not None else 1.0
        return tree_micro_batches(batch, size, device, max_tokens, self.layout.tree, padded=padded,
                                  dtype=self._mask_dtype(), kernel=self.layout.tree_kernel, cost_factor=factor)

    def logprobs(self, micro: Batch, *, with_entropy: bool = False, entropy_grad: bool = False,
                 extra_ids: torch.Tensor | None = None):
        """The log-probs ``[B, T-1]`` of ``micro``'s sampled tokens (0 where its loss mask is 0), and with
        ``with_entropy`` each position's entropy (with a gradient only under ``entropy_grad``: an entropy bonus).
        Packed rows come back in ``micro``'s padded layout. ``extra_ids`` [B, T-1, K]: also the log-probs of those
        tokens (last in the tuple), on the flat or the padded pass (packed rows and trees do not take them).
        A ``TreeBatch`` runs as its tree, its log-probs read back in its padded layout."""
        if isinstance(micro, TreeBatch) and extra_ids is None:
            return self._tree(micro, with_entropy=with_entropy, entropy_grad=entropy_grad)
        kind = self.layout.kind(micro.input_ids.shape[1])  # (a micro-batch is cut to its longest row: its width)
        if kind == "flat":
            return flat_token_logprobs(self.layout.decoder, micro.input_ids, micro.lengths, mask=micro.loss_mask,
                                       temperature=self.temperature, chunk=self.chunk, with_entropy=with_entropy,
                                       entropy_grad=entropy_grad, extra_ids=extra_ids)
        if kind == "padded" or extra_ids is not None:
            return token_logprobs(self.module, micro.input_ids, micro.attention_mask, temperature=self.temperature,
                                  mask=micro.loss_mask, chunk=self.chunk, with_entropy=with_entropy,
                                  entropy_grad=entropy_grad, extra_ids=extra_ids)
        packed = pack(micro.input_ids, micro.lengths, pad_id=0, dtype=self._mask_dtype())
        out = token_logprobs(self.module, packed.input_ids, packed.attention_mask, temperature=self.temperature,
                             mask=packed.to_packed(micro.loss_mask), chunk=self.chunk, with_entropy=with_entropy,
                             entropy_grad=entropy_grad, position_ids=packed.position_ids)
        if with_entropy:
            return packed.unpack(out[0]), packed.unpack(out[1])
        return packed.unpack(out)

    def _mask_dtype(self) -> torch.dtype:
        """An additive mask's dtype: the module's compute dtype (float32 for a quantised one)."""
        dtype = next(self.module.parameters()).dtype
        return dtype if dtype.is_floating_point else torch.float32

    def _tree(self, micro: TreeBatch, *, with_entropy: bool, entropy_grad: bool):
        """``micro``'s tree in one forward pass; a prefix token's value is read by every row through it, and kept
        only where that row's own loss mask is 1 (as the padded pass keeps it)."""
        out = tree_token_logprobs(self.module, micro.tree, temperature=self.temperature, chunk=self.chunk,
                                  with_entropy=with_entropy, entropy_grad=entropy_grad)
        wanted = micro.loss_mask.bool()

        def rows(values: torch.Tensor) -> torch.Tensor:
            return torch.where(wanted, micro.tree.unpack(values), values.new_zeros(()))

        return (rows(out[0]), rows(out[1])) if with_entropy else rows(out)

    def topk(self, micro: Batch, k: int, *, vocab: int = 0):
        """From one padded forward pass: ``micro``'s sampled tokens' log-probs [B, T-1], the ``k`` likeliest next
        tokens [B, T-1, k] (ids below ``vocab``, 0: any) and their probabilities (``token_topk``)."""
        if self.layout != PADDED:
            raise ValueError("top-K scores run on the padded pass only (a distillation teacher's)")
        return token_topk(self.module, micro.input_ids, micro.attention_mask, mask=micro.loss_mask, k=k,
                          temperature=self.temperature, chunk=self.chunk, vocab=vocab)
