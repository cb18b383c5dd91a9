"""The learner's forward passes, chosen in one place: ``choose(module, train, role)`` says how a module's
micro-batches run, and ``Forward`` runs them.

Three passes give the same log-probs (the tests check them against each other):

- **flat**: the micro-batch's sequences laid end to end without padding through ctxrl's own decoder
  (``ctxrl.learner.flat``; CUDA, Llama-layout models), where its decoder takes the micro-batch's width;
- **packed**: several sequences per row, each with its own positions and a block-diagonal mask
  (``ctxrl.learner.packing``, ``train.pack_sequences``);
- **padded**: HF's forward pass over right-padded rows (``ctxrl.learner.logprobs.token_logprobs``).

Who runs what (``choose``) is what ran before the choice was made here: the policy runs flat where it can, else
packed if asked, else padded; the KL reference, the distillation teacher, the critic and the warm start's SFT run
padded. Letting the reference and the teacher follow the policy's layout would change their log-probs on CUDA by
kernel rounding (KL and distillation figures), so it is a measured change of its own, not done here; the critic
cannot run flat until the flat decoder gives hidden states to a value head. This module does not decide micro-batch
sizes (``ctxrl.learner.batch``) nor what a run's memory plan predicts (``ctxrl.learner.sizing``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ctxrl.learner.batch import Batch
from ctxrl.learner.flat import FlatDecoder, training_decoder
from ctxrl.learner.logprobs import flat_token_logprobs, token_logprobs, token_topk
from ctxrl.learner.packing import pack

ROLES = ("policy", "reference", "teacher", "critic", "sft")
"""The modules whose forward pass ``choose`` decides: the trained policy, the KL reference, the distillation
teacher, the PPO critic, the warm start's supervised policy."""


@dataclass(frozen=True)
class Layout:
    """How one module's micro-batches run: through ``decoder``'s flat pass where it takes the micro-batch's width,
    else on packed rows (``packed``) or padded ones."""

    decoder: FlatDecoder | None = None
    packed: bool = False

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
    return Layout(training_decoder(module, train.flat_forward), packed=train.pack_sequences)


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

    def logprobs(self, micro: Batch, *, with_entropy: bool = False, entropy_grad: bool = False,
                 extra_ids: torch.Tensor | None = None):
        """The log-probs ``[B, T-1]`` of ``micro``'s sampled tokens (0 where its loss mask is 0), and with
        ``with_entropy`` each position's entropy (with a gradient only under ``entropy_grad``: an entropy bonus).
        Packed rows come back in ``micro``'s padded layout. ``extra_ids`` [B, T-1, K]: also the log-probs of those
        tokens (last in the tuple), on the flat or the padded pass (packed rows do not take them)."""
        kind = self.layout.kind(micro.input_ids.shape[1])  # (a micro-batch is cut to its longest row: its width)
        if kind == "flat":
            return flat_token_logprobs(self.layout.decoder, micro.input_ids, micro.lengths, mask=micro.loss_mask,
                                       temperature=self.temperature, chunk=self.chunk, with_entropy=with_entropy,
                                       entropy_grad=entropy_grad, extra_ids=extra_ids)
        if kind == "padded" or extra_ids is not None:
            return token_logprobs(self.module, micro.input_ids, micro.attention_mask, temperature=self.temperature,
                                  mask=micro.loss_mask, chunk=self.chunk, with_entropy=with_entropy,
                                  entropy_grad=entropy_grad, extra_ids=extra_ids)
        dtype = next(self.module.parameters()).dtype
        packed = pack(micro.input_ids, micro.lengths, pad_id=0,
                      dtype=dtype if dtype.is_floating_point else torch.float32)
        out = token_logprobs(self.module, packed.input_ids, packed.attention_mask, temperature=self.temperature,
                             mask=packed.to_packed(micro.loss_mask), chunk=self.chunk, with_entropy=with_entropy,
                             entropy_grad=entropy_grad, position_ids=packed.position_ids)
        if with_entropy:
            return packed.unpack(out[0]), packed.unpack(out[1])
        return packed.unpack(out)

    def topk(self, micro: Batch, k: int, *, vocab: int = 0):
        """From one padded forward pass: ``micro``'s sampled tokens' log-probs [B, T-1], the ``k`` likeliest next
        tokens [B, T-1, k] (ids below ``vocab``, 0: any) and their probabilities (``token_topk``)."""
        if self.layout != PADDED:
            raise ValueError("top-K scores run on the padded pass only (a distillation teacher's)")
        return token_topk(self.module, micro.input_ids, micro.attention_mask, mask=micro.loss_mask, k=k,
                          temperature=self.temperature, chunk=self.chunk, vocab=vocab)
