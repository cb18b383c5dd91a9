"""The learner's settings: the run's ``[algo]`` and ``[train]`` sections as they are, and the few values derived from
the rest of the run (``ctxrl.run.build.learner_settings`` computes them once)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ctxrl.algo.losses import OLD_LOGPROBS
from ctxrl.algo.offpolicy import correction_keywords, get_offpolicy_correction
from ctxrl.algo.policy_losses import declared, get_policy_loss, loss_keywords
from ctxrl.learner.batch import Batch
from ctxrl.learner.flat import MODES as FLAT_MODES
from ctxrl.learner.forward import PADDED, SHARING_MODES, Forward, choose
from ctxrl.sections import AlgoConfig, TrainConfig

WORLD_MODEL_AND_SHARING = ("algo.world_model_coef > 0 scores the environment's tokens, which a shared-prefix tree "
                           "does not compute yet: set train.shared_prefix=off (or algo.world_model_coef=0)")


@dataclass(frozen=True)
class LearnerSettings:
    """What a learner is told: the run's ``[algo]`` and ``[train]`` sections as they are (not copied field by field:
    STYLE 15), and the few values derived from the rest of the run, computed once where the run is assembled
    (``ctxrl.run.build.learner_settings``). The learner reads ``micro_batch_tokens``, never
    ``train.max_tokens_per_microbatch``: the budget is the user's, or the one the memory plan chose."""

    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    temperature: float = 1.0
    """The sampler's temperature (1 for greedy sampling): log-probs are of ``logits / temperature``."""
    norm_length: float | None = None
    """The constant of ``seq-mean-token-sum-norm`` (Dr.GRPO): the most sampled tokens an episode can
    have. None falls back to the longest response in each mini-batch (not a constant)."""
    micro_batch_tokens: int = 0
    """Token budget of a micro-batch (0: ``train.micro_batch_size`` rows at a time)."""
    distill_top_k_coef: float = 0.0
    """Weight of the forward KL from a distillation teacher's top-K to the policy (``algo.distill.top_k``), on
    batches that carry the teacher's top-K (``Batch.teacher_ids``)."""
    vf_clip: float = 0.2
    """The critic's value clip (``[algo.gae].vf_clip``: a critic's settings are GAE's)."""
    loss_options: Any = None
    """The policy loss's own settings (``[algo.NAME]`` for ``algo.loss = NAME``; None: their defaults)."""
    offpolicy_options: Any = None
    """The off-policy correction's settings (``[algo.NAME]`` for ``algo.offpolicy = NAME``; None: their defaults)."""

    def __post_init__(self) -> None:
        a = self.algo
        get_policy_loss(a.loss)  # (an unknown name is an error listing the registered ones)
        if a.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs must be one of {', '.join(OLD_LOGPROBS)}, not {a.old_logprobs!r}")
        if self.train.flat_forward not in FLAT_MODES:
            raise ValueError(f"flat_forward must be one of {', '.join(FLAT_MODES)}, not {self.train.flat_forward!r}")
        if self.train.shared_prefix not in SHARING_MODES:
            raise ValueError(f"shared_prefix must be one of {', '.join(SHARING_MODES)}, not "
                             f"{self.train.shared_prefix!r}")
        if a.world_model_coef > 0 and self.train.shared_prefix != "off":
            raise ValueError(WORLD_MODEL_AND_SHARING)
        if a.tis_cap and a.old_logprobs != "recompute":
            raise ValueError("truncated importance sampling (tis_cap > 0) corrects recomputed old log-probs; "
                             "set old_logprobs='recompute'")
        if a.offpolicy:
            get_offpolicy_correction(a.offpolicy)  # (an unknown name is an error listing the registered ones)
            if a.old_logprobs != "recompute" or a.tis_cap:
                raise ValueError(f"the off-policy correction {a.offpolicy!r} corrects recomputed old log-probs "
                                 "(old_logprobs='recompute'), in place of tis_cap")

    @property
    def policy_loss(self):
        """The registered loss function ``algo.loss`` names (``ctxrl.algo.policy_losses``)."""
        return get_policy_loss(self.algo.loss)

    @property
    def loss_keywords(self) -> dict[str, Any]:
        """The policy loss's keywords from the config: PPO's clip range where it reads it, its own settings."""
        return loss_keywords(self.policy_loss, self.algo, self.loss_options)

    @property
    def figures(self) -> tuple[str, ...]:
        """The policy loss's figures, which the learner logs per sampled token."""
        return declared(self.policy_loss).figures

    @property
    def offpolicy_keywords(self) -> dict[str, Any]:
        """The off-policy correction's settings as its keywords (``algo.offpolicy`` must name one)."""
        return correction_keywords(self.algo.offpolicy, self.offpolicy_options)

    @property
    def kl_coef(self) -> float:
        """The KL-to-reference coefficient of the loss (0 when ``algo.kl_placement`` puts the KL in the reward)."""
        return self.algo.kl_coef if self.algo.kl_placement == "loss" else 0.0

    def forward(self, model, *, sharded: bool = False) -> Forward:
        """The policy's forward pass over ``model`` under these settings (``ctxrl.learner.forward.choose``).
        ``sharded`` (FSDP2): HF's padded pass with the full logits, the one path that enters the model through its
        root unit (the chunked head calls the backbone and the head apart)."""
        if sharded:
            return Forward(model, PADDED, temperature=self.temperature, chunk=0)
        return Forward(model, choose(model, self.train, "policy"), temperature=self.temperature,
                       chunk=self.train.logprob_chunk_tokens)

    def logprobs(self, model, micro: Batch, *, with_entropy: bool = False, extra_ids: torch.Tensor | None = None):
        """``forward(model).logprobs(micro, ...)``, the entropy with a gradient when the loss has an entropy bonus."""
        return self.forward(model).logprobs(micro, with_entropy=with_entropy,
                                            entropy_grad=self.algo.entropy_coef > 0, extra_ids=extra_ids)
