"""Distillation's dense term (``algo.distill.top_k``): the top-K forward KL by hand, why the sampled-token term alone
cannot move a certain student, the teacher's top-K against its full logits, the student's log-probs of the
teacher's tokens (and their gradients) on every learner pass, the rows' alignment through collate, and one step."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from ctxrl.algo.distill import topk_forward_kl
from ctxrl.algo.estimators import get_estimator
from ctxrl.algo.estimators.distill import DistillSettings
from ctxrl.config import ConfigError, load_config
from ctxrl.run.build import learner_settings
from ctxrl.train.batch import collate
from ctxrl.train.learner import Learner, PPOSettings
from ctxrl.train.logprobs import token_topk

TINY = "tiny:pretrain_steps=0"


# -- the maths -------------------------------------------------------------------------------------------------
def test_topk_forward_kl_by_hand():
    q = torch.tensor([[[0.5, 0.3], [0.9, 0.1], [0.2, 0.2]]])
    student = torch.log(torch.tensor([[[0.25, 0.5], [0.9, 0.1], [0.01, 0.01]]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    got = topk_forward_kl(q, student, mask)
    # 0.5 ln(0.5/0.25) + 0.3 ln(0.3/0.5); the student equal to the teacher: 0; masked: 0 whatever the numbers
    assert got[0, 0].item() == pytest.approx(0.5 * math.log(2) + 0.3 * math.log(0.6), abs=1e-6)
    assert got[0, 1].item() == pytest.approx(0.0, abs=1e-7) and got[0, 2].item() == 0.0
    # a zero probability (a padded slot) contributes nothing, even against a very unlikely student token
    zero = topk_forward_kl(torch.tensor([[[0.5, 0.0]]]), torch.tensor([[[math.log(0.5), -80.0]]]),
                           torch.tensor([[1.0]]))
    assert zero.item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="must be"):
        topk_forward_kl(q, student[..., :1], mask)


def test_a_certain_student_is_moved_by_the_topk_term_and_not_by_the_sampled_token_term():
    """The student puts 0.9999 on token 0, the teacher 0.1 (and 0.9 on token 1). The sampled-token term's gradient
    on the logits is ``A (onehot - p)``: it vanishes with ``1 - p``. The top-K term's is ``(sum q) p - q``."""
    logits = torch.tensor([10.0, 0.8, 0.0], requires_grad=True)
    teacher = torch.tensor([0.1, 0.9, 0.0])
    logp = torch.log_softmax(logits, -1)
    advantage = -(logp[0].detach() - math.log(0.1))  # k1 of the sampled token 0, as distill_advantages gives it
    (-(advantage * logp[0])).backward()
    sampled = logits.grad.clone()
    logits.grad = None
    logp = torch.log_softmax(logits, -1)
    kl = topk_forward_kl(teacher[None, None, :2], logp[None, None, :2], torch.ones(1, 1))
    kl.sum().backward()
    dense = logits.grad.clone()
    p = torch.softmax(logits.detach(), -1)
    torch.testing.assert_close(dense, teacher.sum() * p - teacher)  # (sum q) p - q, by hand
    assert sampled.abs().max() < 1e-3 < 0.8 < dense.abs().max()
    assert dense[1] < 0  # descending the loss raises token 1, which the student never sampled


# -- the settings ----------------------------------------------------------------------------------------------
def test_top_k_settings_are_checked():
    DistillSettings(teacher="t", coef=0.0, top_k=8)  # the dense term alone is a valid distillation
    with pytest.raises(ValueError, match="no top-K term"):
        DistillSettings(teacher="t", coef=0.0, top_k=0)
    with pytest.raises(ConfigError, match="top_k"):
        load_config(None, ["algo.advantage=distill", "algo.distill.teacher=tiny", "algo.distill.top_k=100000"])
    config = load_config(None, ["algo.advantage=distill", "algo.distill.teacher=tiny", "algo.distill.top_k=4",
                                "algo.distill.top_k_coef=0.5"])
    assert learner_settings(config).distill_top_k_coef == 0.5
    assert learner_settings(load_config(None, [])).distill_top_k_coef == 0.0


def test_the_estimator_puts_the_teachers_topk_on_its_rows_and_refuses_without_it():
    from tests.test_distill import TEACHER, tool_then_answer

    e = tool_then_answer()
    n = len(e.input_ids)
    ids = [[i % 7, (i + 1) % 7] for i in range(n)]
    probs = [[0.6, 0.3] if m else [0.0, 0.0] for m in e.loss_mask]
    estimator = get_estimator("distill")(options=DistillSettings(teacher="t", top_k=2))
    [[row]] = estimator.estimate([e], teacher_logprobs=[[TEACHER]], teacher_topk=[[(ids, probs)]])
    assert row.teacher_ids == ids and row.teacher_probs == probs
    with pytest.raises(ValueError, match="needs teacher_topk"):
        estimator.estimate([e], teacher_logprobs=[[TEACHER]])
    with pytest.raises(ValueError, match="teacher top-K id lists"):
        estimator.estimate([e], teacher_logprobs=[[TEACHER]], teacher_topk=[[(ids[:-1], probs)]])


def test_collate_shifts_the_topk_like_the_logprobs_and_select_keeps_it(scored_episodes):
    from ctxrl.types import TrainSequence

    rows = []
    for k, e in enumerate(scored_episodes(50, [5, 3])):
        ids = [[10 * k + i, 10 * k + i + 1] for i in range(len(e.input_ids))]
        probs = [[0.5, 0.25] if m else [0.0, 0.0] for m in e.loss_mask]
        rows.append(TrainSequence.of(e, [1.0] * len(e.input_ids), teacher_ids=ids, teacher_probs=probs))
    batch = collate(rows, 0)
    assert batch.teacher_ids.shape == (2, 4, 2) and batch.teacher_probs.shape == (2, 4, 2)
    # position t predicts token t+1: its top-K is the list stored at index t+1, as behaviour log-probs are
    assert batch.teacher_ids[0, 0].tolist() == [1, 2] and batch.teacher_ids[1, 1].tolist() == [12, 13]
    assert batch.teacher_ids[1, 2:].abs().sum() == 0  # padding past the shorter row
    assert ((batch.teacher_probs.sum(-1) > 0).float() == batch.loss_mask).all()
    picked = batch.select([1])
    assert picked.teacher_ids.shape == (1, 2, 2) and picked.teacher_ids[0].tolist() == [[11, 12], [12, 13]]
    with pytest.raises(ValueError, match="some rows have a teacher's top-K"):
        collate([rows[0], TrainSequence.of(scored_episodes(50, [4])[0], [0.0] * 4)], 0)


# -- the teacher's top-K and the student's log-probs of it, on the real models ---------------------------------
def test_token_topk_matches_the_full_logits(model):
    ids = torch.tensor([[5, 9, 14, 3, 7, 8], [4, 6, 11, 0, 0, 0]])
    attention = (ids > 0).long()
    attention[1, :3] = 1
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits[:, :-1] / 0.7, -1)
    for chunk in (0, 3):
        got_lp, got_ids, got_probs = token_topk(model, ids, attention, mask=mask, k=4, temperature=0.7, chunk=chunk)
        want_lp, want_ids = logprobs.topk(4, dim=-1)
        wanted = mask.bool()
        assert torch.equal(got_ids[wanted], want_ids[wanted])
        torch.testing.assert_close(got_probs[wanted], want_lp[wanted].exp(), atol=1e-5, rtol=1e-5)
        assert got_ids[~wanted].abs().sum() == 0 and got_probs[~wanted].abs().sum() == 0
        # the same pass gives the next token's own log-prob, as token_logprobs does
        torch.testing.assert_close(got_lp[wanted], logprobs.gather(-1, ids[:, 1:, None])[..., 0][wanted])
        assert got_lp[~wanted].abs().sum() == 0
    _, capped, _ = token_topk(model, ids, attention, mask=mask, k=4, chunk=3, vocab=10)
    assert capped.max() < 10  # a head padded past the student's tokenizer offers no id beyond it


@pytest.mark.parametrize("mode,chunk", [("off", 0), ("off", 5), ("on", 5), ("packed", 5)])
def test_the_students_logprobs_of_the_teachers_tokens_and_their_gradients_on_every_pass(mode, chunk,
                                                                                       scored_episodes):
    from ctxrl.models.shapes import random_model

    model = random_model("qwen2-test", torch.float64, "cpu", seed=0)
    lengths = [9, 4, 13, 6]
    batch = collate(scored_episodes(model.config.vocab_size, lengths), 0, advantages=[1.0, -1.0, 0.5, 2.0])
    extra = torch.randint(0, model.config.vocab_size, (*batch.loss_mask.shape, 3),
                          generator=torch.Generator().manual_seed(5))
    weights = torch.rand(extra.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    results = []
    for how in ("reference", mode):
        m = copy.deepcopy(model).train()
        settings = PPOSettings(logprob_chunk_tokens=0 if how == "reference" else chunk,
                               flat_forward="on" if how == "on" else "off", pack_sequences=how == "packed")
        lp, ent, student = settings.logprobs(m, batch, with_entropy=True, extra_ids=extra)
        loss = -(lp * batch.advantages * batch.loss_mask).sum() - (student * weights).sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        results.append((lp.detach(), student.detach(), grads))
    (lp_a, st_a, g_a), (lp_b, st_b, g_b) = results
    mask = batch.loss_mask
    with torch.no_grad():  # by hand: the full forward pass's log-softmax at the extra ids
        full = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
                                 .logits[:, :-1], -1)
        by_hand = full.gather(-1, extra) * mask.unsqueeze(-1)
    torch.testing.assert_close(st_a, by_hand, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(st_b, by_hand, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(lp_a * mask, lp_b * mask, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(g_a, g_b, atol=1e-9, rtol=1e-7)
    assert g_a.abs().sum() > 0


def test_the_learners_loss_adds_the_weighted_topk_term_and_reports_it(scored_episodes):
    from ctxrl.models.shapes import random_model
    from ctxrl.types import TrainSequence

    model = random_model("qwen2-test", torch.float64, "cpu", seed=0)
    episodes = scored_episodes(model.config.vocab_size, [9, 6, 12])
    g = torch.Generator().manual_seed(7)
    rows = []
    for e in episodes:
        n = len(e.input_ids)
        ids = torch.randint(0, model.config.vocab_size, (n, 4), generator=g).tolist()
        probs = [(torch.rand(4, generator=g) / 4).tolist() if m else [0.0] * 4 for m in e.loss_mask]
        rows.append(TrainSequence.of(e, [0.0] * n, teacher_ids=ids, teacher_probs=probs))
    batch = collate(rows, 0)
    figures = []
    for coef in (0.0, 2.0):
        m = copy.deepcopy(model)
        learner = Learner(m, torch.optim.SGD(m.parameters(), lr=0.0), PPOSettings(
            distill_top_k_coef=coef, logprob_chunk_tokens=4, micro_batch_size=2), pad_token_id=0)
        figures.append(learner.update(batch))
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
                                 .logits[:, :-1].double(), -1)
        kl = topk_forward_kl(batch.teacher_probs.double(), full.gather(-1, batch.teacher_ids), batch.loss_mask)
        per_token = float(kl.sum() / batch.loss_mask.sum())
    assert "distill_topk_kl" not in figures[0]
    assert figures[1]["distill_topk_kl"] == pytest.approx(per_token, rel=1e-6)
    # the advantages are all 0: the policy loss is 0 and the loss is the weighted term alone
    assert figures[0]["loss"] == pytest.approx(0.0, abs=1e-12)
    assert figures[1]["loss"] == pytest.approx(2.0 * per_token, rel=1e-6)


def test_the_topk_term_moves_a_student_toward_its_teacher(scored_episodes):
    """A few updates on the dense term alone (zero advantages) lower the forward KL to a fixed teacher."""
    from ctxrl.models.shapes import random_model
    from ctxrl.types import TrainSequence

    student = random_model("qwen2-test", torch.float32, "cpu", seed=0)
    teacher = random_model("qwen2-test", torch.float32, "cpu", seed=1).eval()
    episodes = scored_episodes(student.config.vocab_size, [10, 8, 12, 9])
    batch = collate(episodes, 0)
    _, ids, probs = token_topk(teacher, batch.input_ids, batch.attention_mask, mask=batch.loss_mask, k=8,
                               chunk=16)
    rows = []
    for j, e in enumerate(episodes):
        n = len(e.input_ids)
        rows.append(TrainSequence.of(e, [0.0] * n, teacher_ids=[[0] * 8] + ids[j, : n - 1].tolist(),
                                     teacher_probs=[[0.0] * 8] + probs[j, : n - 1].tolist()))
    learner = Learner(student, torch.optim.Adam(student.parameters(), lr=1e-2),
                      PPOSettings(distill_top_k_coef=1.0, logprob_chunk_tokens=16), pad_token_id=0)
    first = learner.update(collate(rows, 0))["distill_topk_kl"]
    for _ in range(15):
        last = learner.update(collate(rows, 0))["distill_topk_kl"]
    assert last < 0.5 * first, (first, last)


def test_one_teacher_pass_gives_the_logprobs_score_gives_and_the_topk(model, renderer):
    """``Teacher.score_topk``: the log-probs and figures of ``score``, and the top K, from one forward pass."""
    import asyncio
    import copy

    from ctxrl.engine.hf import HFEngine
    from ctxrl.envs.calculator import CalculatorEnv
    from ctxrl.rollout.agent import run_episodes
    from ctxrl.rollout.spec import RolloutLimits
    from ctxrl.train.teacher import Teacher

    engine = HFEngine(model, pad_token_id=renderer.tokenizer.pad_token_id)
    limits = RolloutLimits(max_turns=2, max_new_tokens=10, max_total_tokens=400, temperature=0.7)
    episodes = asyncio.run(run_episodes(CalculatorEnv, CalculatorEnv.sample_tasks("train", 2, seed=3), engine,
                                        renderer, limits, group_size=2, seed=4))
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    teacher = Teacher(other, "test", temperature=0.7, micro_batch_size=3, chunk=4, top_k=5)
    pad = renderer.tokenizer.pad_token_id
    want, want_figures = teacher.score(episodes, pad)
    got, topk, figures = teacher.score_topk(episodes, pad)
    for a, b in zip(got, want):
        for row_a, row_b in zip(a, b):
            assert row_a == pytest.approx(row_b, abs=1e-5)
    assert figures == pytest.approx(want_figures, abs=1e-5)
    for e, [(ids, probs)] in zip(episodes, topk):
        assert len(ids) == len(probs) == len(e.input_ids) and all(len(i) == 5 for i in ids)
        assert all((sum(p) > 0) == bool(m) for p, m in zip(probs, e.loss_mask))


# -- one training step -----------------------------------------------------------------------------------------
def test_a_topk_distillation_step_from_the_students_own_checkpoint_has_no_signal(tmp_path, tiny_path):
    from ctxrl.train.trainer import train

    config = load_config(None, [f"model.name={TINY}", "algo.advantage=distill", f"algo.distill.teacher={TINY}",
                                "algo.distill.coef=0", "algo.distill.top_k=4", "sft.enabled=false",
                                "train.steps=1", "train.mini_batches=1", "rollout.tasks_per_step=2",
                                "rollout.group_size=2", "rollout.max_new_tokens=8", "eval.tasks=2",
                                "run.progress=false", "run.samples_per_step=0", "train.eval_every=0"])
    train(config, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    [rl] = [r for r in rows if r.get("phase") == "rl"]
    # teacher == student before the update (one mini-batch: the figure is of the weights that sampled): on the
    # teacher's top 4 the student's log-probs are its own, so the KL is 0
    assert rl["distill_topk_kl"] == pytest.approx(0.0, abs=1e-5) and rl["teacher_kl_tokens"] > 0
    assert rl["no_signal"] == 0.0 and rl["skipped"] == 0.0  # the dense term alone is a signal: the step was taken
