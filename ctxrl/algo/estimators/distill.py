"""``distill``: on-policy distillation, the teacher's per-token reverse KL as advantages, optionally beside an outcome.

``algo.advantage = "distill"`` with its table ``[algo.distill]``::

    [algo.distill]
    teacher = "runs/teacher/checkpoints/final"   # any model.name sharing the student's tokenizer
    coef = 1.0                                   # weight of the teacher's term
    outcome = 0.0                                # weight of the outcome advantage (0: distillation alone)
    outcome_estimator = "grpo"
    top_k = 0                                    # > 0: also the dense top-K forward KL in the loss
    top_k_coef = 1.0                             # its weight

The advantage of sampled token ``t`` of a sequence is ``-coef * (log pi_s(x_t) - log pi_t(x_t)) + outcome * A``
where ``A`` is the episode's advantage under ``outcome_estimator`` (``grpo``, ``dr_grpo``, ``rloo``: one number per
episode from its shaped reward, group statistics included) and the log-probs are the behaviour's and the teacher's
at the rollout temperature (``ctxrl.algo.distill``). Every sequence of an episode (each segment a context manager
closed: summaries included) gets its own per-token teacher term, so this estimator works with every context
manager; a segment's process bonus (``segment_bonus``) is added as ``broadcast`` adds it.

With ``top_k = K > 0`` the teacher also gives its ``K`` likeliest next tokens and their probabilities at every
sampled position (``teacher_topk``); they ride on the rows (``TrainSequence.teacher_ids`` / ``teacher_probs``) to
the learner, whose loss adds ``top_k_coef`` times the forward KL from them to the student
(``ctxrl.algo.distill.topk_forward_kl``), aggregated as the policy loss is. The sampled-token term alone cannot move
a student that is certain of a wrong token; this one can (``ctxrl.algo.distill``).

What the trainer does for it (``needs_teacher``): it loads the teacher once (``ctxrl.learner.teacher``: refused
unless teacher and student tokenize alike), scores every trained sequence's sampled tokens after each rollout
and passes ``teacher_logprobs``. Pure distillation needs no groups (``rollout.group_size = 1`` works); an outcome
term from a group estimator needs ``rollout.group_size >= 2`` (``check_config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctxrl.algo.distill import distill_advantages
from ctxrl.algo.estimators.base import (
    Estimator,
    SegmentBonus,
    get_estimator,
    register_estimator,
    trained_sequences,
)
from ctxrl.algo.estimators.outcome import OutcomeEstimator
from ctxrl.algo.estimators.tensors import group_ids
from ctxrl.errors import ConfigError
from ctxrl.settings import NON_NEGATIVE, in_range
from ctxrl.types import Episode, TrainSequence

TeacherLogprobs = list[list[list[float]]]
"""Per episode, per trained sequence, one teacher log-prob per token (0 where the loss mask is 0)."""
TeacherTopK = list[list[tuple[list[list[int]], list[list[float]]]]]
"""Per episode, per trained sequence, the teacher's top-K token ids and probabilities per token (``K`` zeros where the
loss mask is 0), aligned with ``input_ids`` as the log-probs are."""
MAX_TOP_K = 256
"""The most tokens ``top_k`` keeps a position: each costs 12 bytes a sampled token on the host and the card."""


@dataclass(frozen=True)
class DistillSettings:
    teacher: str = ""
    """The teacher: any ``model.name`` (an HF checkpoint directory such as an RL run's ``checkpoints/final``, a hub
    name, a ``.gguf`` file, a named real model, ``tiny:...``). It must tokenize exactly as the student does."""
    coef: float = field(default=1.0, metadata=NON_NEGATIVE)
    """Weight of the teacher's term: the advantage of a sampled token is ``-coef * (log pi_s - log pi_t)``."""
    outcome: float = field(default=0.0, metadata=NON_NEGATIVE)
    """Weight of the outcome advantage added to every sampled token (0: distillation alone)."""
    outcome_estimator: str = "grpo"
    """The estimator of the outcome term: one advantage per episode from its reward (``grpo``, ``dr_grpo``,
    ``rloo``, or a registered ``OutcomeEstimator``)."""
    device: str = ""
    """Where the teacher runs: empty for the policy's device (the same GPU), or ``cpu``, ``cuda:1``."""
    dtype: str = ""
    """The teacher's dtype: empty for ``model.dtype``, or ``float32``, ``bfloat16``, ``float16``."""

    top_k: int = field(default=0, metadata=in_range(0, MAX_TOP_K))
    """0: the sampled-token term alone. ``K > 0``: the loss also pulls the student toward the teacher's ``K``
    likeliest next tokens at every sampled position (forward KL; dense where the sampled-token term is blind)."""
    top_k_coef: float = field(default=1.0, metadata=NON_NEGATIVE)
    """Weight of the top-``K`` forward KL in the loss (with ``top_k > 0``)."""

    def __post_init__(self) -> None:
        if self.coef == 0 and self.outcome == 0 and not (self.top_k and self.top_k_coef):
            raise ValueError("coef and outcome are both 0 and there is no top-K term, so nothing would be learned; "
                             "set coef > 0 (the teacher's sampled-token term), outcome > 0, or top_k > 0")


@register_estimator
class Distill(Estimator):
    """The teacher's per-token reverse KL, plus an optional weighted outcome advantage (module docstring)."""

    name = "distill"
    needs_groups = False
    needs_teacher = True
    handles_segments = True
    Settings = DistillSettings

    @classmethod
    def check_config(cls, options: DistillSettings, config) -> None:
        where = f"algo.{cls.name}"
        if not options.teacher.strip():
            raise ConfigError(f"algo.advantage={cls.name} needs a teacher: set {where}.teacher to a model.name that "
                              "shares the student's tokenizer (a run's checkpoints/final, a .gguf file, ...)")
        outcome = get_estimator(options.outcome_estimator)  # (an unknown name: the registry's error, with the list)
        if not issubclass(outcome, OutcomeEstimator):
            raise ConfigError(f"{where}.outcome_estimator must be an outcome estimator (one advantage per episode: "
                              f"grpo, dr_grpo, rloo), not {options.outcome_estimator!r}")
        r = config.rollout
        if options.outcome and outcome.needs_groups and r.group_size < 2 and config.train.steps > 0:
            raise ConfigError(f"{where}.outcome > 0 with outcome_estimator={options.outcome_estimator} needs "
                              "rollout.group_size >= 2 (group statistics); distillation alone (outcome = 0) does not")
        if r.top_p < 1.0 or r.top_k > 0:
            raise ConfigError(f"{cls.name} compares the distribution the student sampled from with the teacher's "
                              f"whole one, but rollout.top_p={r.top_p:g} / top_k={r.top_k} truncate the student's "
                              "(its behaviour log-probs are renormalised over what was kept), which biases the KL; "
                              "set rollout.top_p=1 and rollout.top_k=0")

    def outcome_advantages(self, episodes: list[Episode]) -> list[float]:
        """The outcome term's advantage of each episode (before its weight), or zeros when the weight is 0."""
        if not self.options.outcome:
            return [0.0] * len(episodes)
        outcome = get_estimator(self.options.outcome_estimator)(self.settings)
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
        return outcome.advantages(rewards, torch.zeros_like(rewards), group_ids(episodes)).tolist()

    def estimate(self, episodes: list[Episode], *, token_rewards: list[list[float]] | None = None,
                 values: list[list[float]] | None = None, segment_bonus: SegmentBonus | None = None,
                 teacher_logprobs: TeacherLogprobs | None = None,
                 teacher_topk: TeacherTopK | None = None) -> list[list[TrainSequence]]:
        if not episodes:
            return []
        if teacher_logprobs is None:
            raise ValueError("the distill estimator needs teacher_logprobs (per episode, per trained sequence); "
                             "the trainer passes them because it declares needs_teacher")
        if token_rewards is not None:
            raise ValueError("the distill estimator takes no token rewards (algo.kl_placement=reward is refused "
                             "with it); put the KL to the reference in the loss")
        if len(teacher_logprobs) != len(episodes):
            raise ValueError(f"{len(teacher_logprobs)} teacher log-prob lists for {len(episodes)} episodes")
        if self.options.top_k and teacher_topk is None:
            raise ValueError(f"algo.distill.top_k={self.options.top_k} needs teacher_topk (per episode, per trained "
                             "sequence); the trainer passes them when top_k > 0")
        if teacher_topk is not None and len(teacher_topk) != len(episodes):
            raise ValueError(f"{len(teacher_topk)} teacher top-K lists for {len(episodes)} episodes")
        outcome = self.outcome_advantages(episodes)
        topk = teacher_topk if teacher_topk is not None else [None] * len(episodes)
        return [self.episode_rows(e, a, teacher, segment_bonus, top)
                for e, a, teacher, top in zip(episodes, outcome, teacher_logprobs, topk)]

    def episode_rows(self, episode: Episode, outcome: float, teacher: list[list[float]],
                     segment_bonus: SegmentBonus | None,
                     topk: list[tuple[list[list[int]], list[list[float]]]] | None = None) -> list[TrainSequence]:
        """One row per trained sequence: the teacher's term per token, the weighted outcome (and bonus) on each,
        and the teacher's top-K per token when it was asked for."""
        sequences = trained_sequences(episode)
        if len(teacher) != len(sequences) or (topk is not None and len(topk) != len(sequences)):
            raise ValueError(f"episode of task {episode.task.id} trains {len(sequences)} sequences but has "
                             f"{len(teacher)} teacher log-prob lists"
                             + ("" if topk is None else f" and {len(topk)} top-K lists"))
        rows = []
        for k, (seq, scores) in enumerate(zip(sequences, teacher)):
            if len(scores) != len(seq.input_ids):
                raise ValueError(f"a sequence of {len(seq.input_ids)} tokens got {len(scores)} teacher log-probs")
            mask = torch.tensor(seq.loss_mask, dtype=torch.float64)
            dense = distill_advantages(torch.tensor(seq.behavior_logprobs, dtype=torch.float64),
                                       torch.tensor(scores, dtype=torch.float64), mask, coef=self.options.coef)
            bonus = segment_bonus(seq) if segment_bonus is not None and episode.segments else 0.0
            advantages = dense + (self.options.outcome * outcome + bonus) * mask
            extra = {}
            if topk is not None:
                ids, probs = topk[k]
                if not len(ids) == len(probs) == len(seq.input_ids):
                    raise ValueError(f"a sequence of {len(seq.input_ids)} tokens got {len(ids)} teacher top-K id "
                                     f"lists and {len(probs)} probability lists")
                extra = {"teacher_ids": ids, "teacher_probs": probs}
            rows.append(TrainSequence.of(seq, advantages.tolist(), group_id=episode.group_id,
                                         policy_version=episode.policy_version, **extra))
        return rows
