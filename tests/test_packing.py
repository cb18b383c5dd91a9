"""Packed sequences (``train.pack_sequences``): the same log-probs, entropies and gradients as padded rows."""

from __future__ import annotations

import copy

import pytest
import torch

from ctxrl.train.batch import collate
from ctxrl.train.learner import PPOSettings
from ctxrl.train.packing import bins, pack


def test_bins_fill_rows_first_fit_by_decreasing_length_never_past_the_longest():
    lengths = [7, 3, 5, 2, 2, 7, 1]
    rows = bins(lengths)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= max(lengths) for row in rows)
    assert rows == [[0], [5], [2, 3], [1, 4, 6]]  # 7 | 7 | 5+2 | 3+2+1
    assert bins([]) == [] and bins([4]) == [[0]]


def test_pack_layout_positions_and_mask_by_hand():
    ids = torch.tensor([[10, 11, 12, 0], [20, 21, 0, 0], [30, 31, 32, 33]])
    packed = pack(ids, torch.tensor([3, 2, 4]), pad_id=0, dtype=torch.float32)
    assert packed.input_ids.tolist() == [[30, 31, 32, 33], [10, 11, 12, 0], [20, 21, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    allowed = (packed.attention_mask[:, 0] == 0).int().tolist()
    assert allowed[1] == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]  # the padding tail is apart
    assert allowed[2] == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    values = torch.arange(12, dtype=torch.float32).view(3, 4)[:, :3]  # a padded [B, T-1] tensor
    back = packed.unpack(packed.to_packed(values))
    assert back.tolist() == [[0.0, 1.0, 0.0], [4.0, 0.0, 0.0], [8.0, 9.0, 10.0]]  # only real predictions survive


@pytest.mark.parametrize("chunk", [0, 4])
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_ones(model, chunk, scored_episodes):
    lengths = [9, 4, 13, 6, 3, 13]
    batch = collate(scored_episodes(model.config.vocab_size, lengths), 0, advantages=[1.0, -1.0, 0.5, 2.0, -0.5, 1.0])
    results = []
    for packed in (False, True):
        m = copy.deepcopy(model).double().train()
        settings = PPOSettings(logprob_chunk_tokens=chunk, pack_sequences=packed, entropy_coef=0.01)
        lp, ent = settings.logprobs(m, batch, with_entropy=True)
        loss = -(lp * batch.advantages * batch.loss_mask).sum() - 0.01 * (ent * batch.loss_mask).sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        results.append((lp.detach(), ent.detach(), grads))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    assert lp_a.shape == lp_b.shape == batch.loss_mask.shape
    assert torch.allclose(lp_a * batch.loss_mask, lp_b, atol=1e-10)
    assert torch.allclose(ent_a * batch.loss_mask, ent_b * batch.loss_mask, atol=1e-10)
    assert torch.allclose(g_a, g_b, atol=1e-9) and g_a.abs().sum() > 0


def test_a_learner_update_with_packing_matches_the_padded_update(model, scored_episodes):
    from ctxrl.train.learner import Learner

    batch = collate(scored_episodes(model.config.vocab_size, [12, 5, 8, 3]), 0, advantages=[1.0, -1.0, 0.5, -0.5])
    out = []
    for packed in (False, True):
        m = copy.deepcopy(model).double()
        learner = Learner(m, torch.optim.SGD(m.parameters(), lr=0.1), PPOSettings(pack_sequences=packed,
                                                                                 logprob_chunk_tokens=4),
                          pad_token_id=0)
        metrics = learner.update(batch)
        out.append((metrics, torch.cat([p.detach().flatten() for p in m.parameters()])))
    (m_a, w_a), (m_b, w_b) = out
    assert torch.allclose(w_a, w_b, atol=1e-10) and not torch.equal(w_a, torch.cat(
        [p.detach().flatten() for p in model.double().parameters()]))
    model.float()
    for key in ("loss", "entropy", "grad_norm", "approx_kl"):
        assert m_a[key] == pytest.approx(m_b[key], rel=1e-8, abs=1e-12), key
