"""The teacher of on-policy distillation: loaded once, refused unless it tokenizes as the student does, and asked for
the log-probs of every token the student sampled.

``algo.advantage = "distill"`` names the teacher in ``[algo.distill]`` (``ctxrl.algo.estimators.distill``). The
trainer builds a ``Teacher`` beside the policy (``Teacher.load``) and, after each rollout, ``score`` runs the
teacher over the student's own token ids, exactly as the student's chat template rendered them: the teacher sees
the student's rendering, never a re-tokenized text, so each of its log-probs is of the very token the student
sampled. That is only meaningful when both map every id to the same token: ``tokenizer_difference`` finds the
first place they do not, and the run stops there, before either model's weights load.

With ``top_k = K > 0`` it also gives, at every sampled position, its ``K`` likeliest next tokens and their
probabilities (``topk``), for the dense forward-KL term of the loss (``ctxrl.algo.distill.topk_forward_kl``).

Where it runs: on the policy's device by default (the same GPU: its weights count in the run's memory plan), or
on its own (``[algo.distill] device = "cuda:1"``). It is frozen (``eval()``, no gradients) and nothing writes
to it; a resumed run loads it again from its name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ctxrl.algo.distill import kl_breakdown, token_roles
from ctxrl.algo.estimators.base import trained_sequences
from ctxrl.algo.estimators.distill import TeacherTopK
from ctxrl.errors import ConfigError
from ctxrl.learner.batch import collate, micro_batches, per_token_rows
from ctxrl.learner.forward import Forward, choose
from ctxrl.types import Episode

log = logging.getLogger(__name__)

CROSS_TOKENIZER = ("Distilling across tokenizers would need the two sequences aligned token by token (a "
                   "cross-tokenizer method such as ULD or GOLD), which ctxrl does not do: choose a teacher of the "
                   "student's family (the same tokenizer), or fine-tune the student's own checkpoint into the teacher")


def teacher_name(config) -> str:
    """The teacher an estimator that ``needs_teacher`` names in its settings (``[algo.distill] teacher``), or ""."""
    from ctxrl.algo.estimators import get_estimator

    if not get_estimator(config.algo.advantage).needs_teacher:
        return ""
    return config.settings_of("algo", config.algo.advantage).teacher


def tokenizer_difference(student, teacher) -> str | None:
    """Where two HF tokenizers map an id to different tokens (their sizes, or the first id that differs), or None
    when every id is the same token in both."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine == theirs:
        return None
    if len(mine) != len(theirs):
        return f"the student's tokenizer has {len(mine)} tokens, the teacher's {len(theirs)}"
    by_id = {i: t for t, i in theirs.items()}
    for token, i in sorted(mine.items(), key=lambda item: item[1]):
        if by_id.get(i) != token:
            return f"id {i} is {token!r} to the student and {by_id.get(i)!r} to the teacher"
    return "the two vocabularies assign the same ids to different tokens"  # (unreachable for two bijections)


def check_teacher(name: str, student_tokenizer, *, student: str) -> None:
    """``ConfigError`` unless teacher ``name``'s tokenizer maps every id as ``student_tokenizer`` does; a warning when
    their chat templates differ (the teacher then reads the student's layout, which it was not trained on)."""
    from transformers import AutoTokenizer

    from ctxrl.models.loader import resolve

    try:  # (not load_tokenizer: a teacher needs no chat template of its own, a base model's vocabulary is enough)
        theirs = AutoTokenizer.from_pretrained(resolve(name))
    except Exception as exc:  # noqa: BLE001 - the teacher's problem, said as such
        raise ConfigError(f"[algo.distill] teacher {name!r}: its tokenizer could not be loaded ({exc})") from exc
    difference = tokenizer_difference(student_tokenizer, theirs)
    if difference is not None:
        raise ConfigError(f"[algo.distill] teacher {name!r} and the student {student!r} do not share a tokenizer "
                          f"({difference}). On-policy distillation scores the student's sampled token ids with the "
                          f"teacher, so both must read every id as the same token. {CROSS_TOKENIZER}")
    if getattr(theirs, "chat_template", None) != getattr(student_tokenizer, "chat_template", None):
        log.warning("the teacher %r has another chat template than the student %r: it scores the student's tokens "
                    "as the student's template laid them out", name, student)


@dataclass
class Teacher:
    """A frozen model scoring the student's sampled tokens (module docstring)."""

    module: Any
    name: str
    temperature: float = 1.0
    """The rollout temperature: the behaviour log-probs are of the tempered distribution, so the teacher's are too."""
    micro_batch_size: int = 32
    max_tokens: int = 0
    chunk: int = 1024
    top_k: int = 0
    """``K > 0``: ``score`` also gives the teacher's ``K`` likeliest tokens at every sampled position."""
    vocab: int = 0
    """The student's tokenizer size: top-K candidates are ids below it (0: every row of the teacher's head)."""

    @classmethod
    def load(cls, options, config, student_tokenizer, device: str) -> Teacher:
        """The teacher ``options`` (``DistillSettings``) names, checked against the student's tokenizer, on its device
        (``options.device``, else ``device``) in its dtype (``options.dtype``, else ``model.dtype``)."""
        from ctxrl.models.loader import load_model, resolve_device

        check_teacher(options.teacher, student_tokenizer, student=config.model.name)
        where = resolve_device(options.device) if options.device else device
        module = load_model(options.teacher, dtype=options.dtype or config.model.dtype, device=where).eval()
        for p in module.parameters():
            p.requires_grad_(False)
        rows = module.get_output_embeddings().weight.shape[0]
        if rows < len(student_tokenizer):
            raise ConfigError(f"[algo.distill] teacher {options.teacher!r} scores {rows} tokens, fewer than the "
                              f"{len(student_tokenizer)} of the student's tokenizer; {CROSS_TOKENIZER}")
        t = config.train
        return cls(module, options.teacher, temperature=config.rollout.temperature,
                   micro_batch_size=t.micro_batch_size, max_tokens=t.max_tokens_per_microbatch,
                   chunk=t.logprob_chunk_tokens, top_k=options.top_k, vocab=len(student_tokenizer))

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def forward(self) -> Forward:
        """The teacher's forward pass (``ctxrl.learner.forward.choose``: padded, as the policy's reference's)."""
        return Forward(self.module, choose(self.module, None, "teacher"), temperature=self.temperature,
                       chunk=self.chunk)

    @torch.no_grad()
    def logprobs(self, episodes: list[Episode], pad_token_id: int) -> list[list[list[float]]]:
        """Per episode, per trained sequence (``trained_sequences``), the teacher's log-prob of each token aligned
        with its ``input_ids`` (0 where the loss mask is 0: only sampled tokens are scored)."""
        sequences = [seq for e in episodes for seq in trained_sequences(e)]
        if not sequences:
            return [[] for _ in episodes]

        forward = self.forward

        def score(batch) -> torch.Tensor:
            return forward.logprobs(batch) * batch.loss_mask

        rows = iter(per_token_rows(collate(sequences, pad_token_id), self.device, self.micro_batch_size, score,
                                   self.max_tokens))
        return [[next(rows) for _ in trained_sequences(e)] for e in episodes]

    @torch.no_grad()
    def score_topk(self, episodes: list[Episode], pad_token_id: int
                   ) -> tuple[list[list[list[float]]], TeacherTopK, dict[str, float]]:
        """``score``'s log-probs and figures and, from the same forward pass, per episode and trained sequence, the
        teacher's ``top_k`` likeliest tokens and their probabilities for each token of its ``input_ids`` (the
        distribution the token was drawn against; ``K`` zeros where the loss mask is 0, and at index 0)."""
        sequences = [seq for e in episodes for seq in trained_sequences(e)]
        if not sequences:
            return [[] for _ in episodes], [[] for _ in episodes], kl_metrics(episodes, [[] for _ in episodes])
        batch = collate(sequences, pad_token_id)
        rows: list[tuple[list[float], list[list[int]], list[list[float]]] | None] = [None] * len(sequences)
        k, forward = max(self.top_k, 1), self.forward
        for index, micro in micro_batches(batch, self.micro_batch_size, self.device, self.max_tokens):
            logprobs, ids, probs = forward.topk(micro, k, vocab=self.vocab)
            logprobs, ids, probs = logprobs.float().cpu(), ids.cpu(), probs.cpu()
            for j, (row, n) in enumerate(zip(index, micro.lengths.tolist())):
                rows[row] = ([0.0] + logprobs[j, : int(n) - 1].tolist(), [[0] * k] + ids[j, : int(n) - 1].tolist(),
                             [[0.0] * k] + probs[j, : int(n) - 1].tolist())
        per_sequence = iter(rows)
        grouped = [[next(per_sequence) for _ in trained_sequences(e)] for e in episodes]
        teacher = [[lp for lp, _, _ in seqs] for seqs in grouped]
        topk = [[(ids, probs) for _, ids, probs in seqs] for seqs in grouped]
        return teacher, topk, kl_metrics(episodes, teacher)

    def score(self, episodes: list[Episode], pad_token_id: int) -> tuple[list[list[list[float]]], dict[str, float]]:
        """``logprobs`` and their figures: the mean teacher-student KL per sampled token, per turn and per role."""
        teacher = self.logprobs(episodes, pad_token_id)
        return teacher, kl_metrics(episodes, teacher)


def kl_metrics(episodes: list[Episode], teacher: list[list[list[float]]]) -> dict[str, float]:
    """``kl_breakdown`` of every sampled token: ``k1 = behaviour - teacher`` with its turn and role."""
    def tokens():
        for e, scores in zip(episodes, teacher):
            for seq, row in zip(trained_sequences(e), scores):
                roles = token_roles(seq, e.turns)
                for i, m in enumerate(seq.loss_mask):
                    if m:
                        yield seq.behavior_logprobs[i] - row[i], seq.turn_index[i], roles[i]

    return kl_breakdown(tokens())
