"""On-policy distillation's maths: the teacher's per-token reverse KL as advantages, and its breakdown by turn and role.

On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD); Lu et al. 2025, Thinking Machines, "On-Policy Distillation"): the student samples,
a teacher scores every sampled token, and the per-token reverse KL is the learning signal, dense where an outcome
reward is one number per episode. What ctxrl computes, and what it leaves out:

- **the estimate.** At a sampled token ``x_t`` the single-sample estimate of ``KL(student || teacher)`` is
  ``k1_t = log pi_s(x_t) - log pi_t(x_t)`` (``reverse_kl``): its expectation under the student's own sampling is
  the reverse KL of that position. ``log pi_s`` is the behaviour log-prob the engine recorded (the distribution the
  token was drawn from, at the rollout temperature), ``log pi_t`` the teacher's at the same temperature, so a
  teacher identical to the student gives exactly 0;
- **the advantage.** ``A_t = -coef * k1_t`` (``distill_advantages``): discount 0, each token is credited with its
  own KL only (Thinking Machines' recipe), not with the KL of the tokens after it; the outcome term, when the
  estimator mixes one in, is added by the estimator (``ctxrl.algo.estimators.distill``);
- **the mask.** Both are 0 wherever the loss mask is 0: prompts, tool output, observations and template tokens
  are never scored, exactly as the loss never trains them.

The sampled-token term moves only the token the student drew: once the student is nearly certain of a token the
teacher dislikes (``pi_s(x) -> 1``), the gradient of ``log pi_s(x)`` vanishes with ``1 - pi_s(x)`` and the
teacher's preference for a token the student never samples is never seen. On SmolLM2-135M distilled from an
RL-trained teacher that is what happened: the student learned the teacher's tool call, then repeated it every turn
instead of answering (docs/experiments/distillation.md). ``topk_forward_kl`` is the dense remedy, GKD's
supervised term on the student's own prefixes (Agarwal et al. 2024, ``beta = 0``): at every sampled position, the
forward KL from the teacher's ``K`` likeliest next tokens to the student,
``sum_k q_k (log q_k - log pi_s(v_k))`` with ``q_k = pi_t(v_k)`` (not renormalised: the mass outside the top
``K`` is left out). Its gradient on the student's logits, ``(sum_k q_k) pi_s - q``, does not vanish when the
student is certain, and reaches tokens it never sampled. It is a loss term, beside the advantages
(``ctxrl.learner.learner``), not an advantage.

The breakdown (``kl_breakdown``) splits the mean KL per token by assistant turn and by the role of the generation
a token belongs to (``token_roles``): a ``tool_call`` turn, an ``answer`` turn, a ``summary`` (the ``summarize``
manager's), a ``reflection`` (the meta loop's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ctxrl.types import Segment, Turn

ROLES = ("tool_call", "answer", "summary", "reflection")
"""The roles of a generation ``token_roles`` tells apart."""
SIDE_ROLES = {"summary": "summary", "reflection": "reflection"}
"""A segment closed by (``Segment.ended_by``) -> the role of its last generation, the side request that closed it."""


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
               loss_mask: torch.Tensor) -> torch.Tensor:
    """``k1 = (log pi_s - log pi_t) * loss_mask``: the per-token estimate of KL(student || teacher).

    student_logprobs, teacher_logprobs, loss_mask: [N, T] (any one shape)  ->  [N, T], 0 where the mask is 0.
    """
    if not student_logprobs.shape == teacher_logprobs.shape == loss_mask.shape:
        raise ValueError(f"student {tuple(student_logprobs.shape)}, teacher {tuple(teacher_logprobs.shape)} and "
                         f"mask {tuple(loss_mask.shape)} log-probs must have one shape")
    mask = loss_mask.to(student_logprobs.dtype)
    return (student_logprobs - teacher_logprobs) * mask


def distill_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
                       coef: float = 1.0) -> torch.Tensor:
    """``A_t = -coef * k1_t``: a token the teacher finds likelier than the student did is pushed up.

    [N, T] each  ->  [N, T], 0 where the mask is 0.
    """
    return -coef * reverse_kl(student_logprobs, teacher_logprobs, loss_mask)


def topk_forward_kl(teacher_probs: torch.Tensor, student_logprobs: torch.Tensor,
                    loss_mask: torch.Tensor) -> torch.Tensor:
    """``sum_k q_k (log q_k - log pi_s(v_k))`` per position: the forward KL from the teacher's top ``K`` to the
    student, at the teacher's ``K`` tokens ``v_k``.

    teacher_probs ``q`` [N, T, K] (``q_k = 0`` contributes 0), student_logprobs ``log pi_s(v_k)`` [N, T, K],
    loss_mask [N, T]  ->  [N, T], 0 where the mask is 0. It is 0 exactly when the student matches the teacher on
    those ``K`` tokens and the teacher's mass is all in them; with mass outside them it is bounded below by
    ``sum_k q_k log sum_k q_k`` (a constant: the gradient is the true forward KL's restricted to the ``K`` tokens).
    """
    if teacher_probs.shape != student_logprobs.shape or teacher_probs.shape[:-1] != loss_mask.shape:
        raise ValueError(f"teacher probs {tuple(teacher_probs.shape)} and student log-probs "
                         f"{tuple(student_logprobs.shape)} must be [..., K] over the mask {tuple(loss_mask.shape)}")
    q = teacher_probs.to(student_logprobs.dtype)
    per_position = (torch.xlogy(q, q) - q * student_logprobs).sum(-1)
    return per_position * loss_mask.to(per_position.dtype)


def generation_spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of sampled tokens (mask 1): one generation each (a turn, a summary, ...)."""
    spans, start = [], None
    for i, m in enumerate(loss_mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(loss_mask)))
    return spans


def token_roles(sequence: Segment, turns: Sequence[Turn]) -> list[str | None]:
    """The role of each token of ``sequence`` (None where the mask is 0).

    A sequence closed by a side request (``ended_by`` ``summary`` or ``reflection``) ends with that request's
    answer: its last generation has that role. Every other generation is an action turn, found by its
    ``turn_index``: ``tool_call`` when the turn made a tool call (well-formed or not), else ``answer``.
    """
    by_index = {t.index: t for t in turns}
    roles: list[str | None] = [None] * len(sequence.input_ids)
    spans = generation_spans(sequence.loss_mask)
    for k, (start, end) in enumerate(spans):
        side = SIDE_ROLES.get(sequence.ended_by) if k == len(spans) - 1 else None
        if side is None:
            turn = by_index.get(sequence.turn_index[start])
            called = turn is not None and (turn.tool_calls > 0 or turn.malformed_calls > 0)
            side = "tool_call" if called else "answer"
        roles[start:end] = [side] * (end - start)
    return roles


def kl_breakdown(tokens: Iterable[tuple[float, int, str | None]]) -> dict[str, float]:
    """Mean KL per sampled token overall (``teacher_kl``), per assistant turn (``teacher_kl_turn_T``) and per role
    (``teacher_kl_ROLE``), from ``(k1, turn index, role)`` of each sampled token; ``teacher_kl_tokens`` counts them."""
    sums: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        total = sums.setdefault(key, [0.0, 0.0])
        total[0] += value
        total[1] += 1.0

    for kl, turn, role in tokens:
        add("teacher_kl", kl)
        if turn >= 0:
            add(f"teacher_kl_turn_{turn}", kl)
        if role is not None:
            add(f"teacher_kl_{role}", kl)
    out = {key: total / count for key, (total, count) in sorted(sums.items())}
    out["teacher_kl_tokens"] = sums.get("teacher_kl", [0.0, 0.0])[1]
    return out
