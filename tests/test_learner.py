"""The learner: collate alignment, exact gradient accumulation, and skipping non-finite updates."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ctxrl.algo import AGG_MODES, policy_loss
from ctxrl.algo.losses import aggregate
from ctxrl.train.batch import collate
from ctxrl.train.learner import Learner, PPOSettings, token_logprobs
from ctxrl.types import Episode, Task, TrainSequence


def batch_of(episodes, advantages, **targets):
    """The collated rows of ``episodes`` with ``advantages`` (and per-row critic targets, lists by name)."""
    if not targets:
        return collate(episodes, 0, advantages=advantages)
    rows = [TrainSequence.of(e, a if isinstance(a, list) else [a * m for m in e.loss_mask],
                             **{k: v[i] for k, v in targets.items()})
            for i, (e, a) in enumerate(zip(episodes, advantages))]
    return collate(rows, 0)

LENGTHS = [12, 31, 7, 45, 20, 9, 26, 16]
PROMPTS = [5, 10, 3, 20, 20, 4, 11, 6]  # episode 4 is all prompt: no mask-1 token at all


def _episodes(model, vocab: int, seed: int = 0, noise: float = 0.3) -> tuple[list[Episode], list[float]]:
    g = torch.Generator().manual_seed(seed)
    episodes = []
    for i, (n, p) in enumerate(zip(LENGTHS, PROMPTS)):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        mask = [0] * p + [1] * (n - p)
        if n - p > 8:  # an observation island in the middle of the sampled tokens
            mask[p + 4:p + 7] = [0, 0, 0]
        with torch.no_grad():
            t = torch.tensor([ids])
            own = token_logprobs(model, t, torch.ones_like(t))[0].tolist()
        behaviour = [0.0] + [lp + noise * float(torch.randn((), generator=g)) for lp in own]
        behaviour = [b if m else 0.0 for b, m in zip(behaviour, mask)]
        episodes.append(Episode(task=Task(id=f"t{i}", prompt="p", answer="a"), input_ids=ids, loss_mask=mask,
                                behavior_logprobs=behaviour, turn_index=[0] * n))
    advantages = (torch.randn(len(episodes), generator=g) * 1.5).tolist()
    return episodes, advantages


@pytest.fixture(scope="module")
def data(model, tokenizer):
    return _episodes(model, len(tokenizer))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(policy, settings, episodes, advantages, ref=None):
    learner = Learner(policy, torch.optim.SGD(policy.parameters(), lr=0.0), settings, pad_token_id=0, reference=ref)
    policy.zero_grad(set_to_none=True)
    metrics = learner.mini_batch_loss(batch_of(episodes, advantages))
    return metrics, _grads(policy)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_gradient_accumulation_is_exact(model, data, agg):
    episodes, advantages = data
    policy = copy.deepcopy(model)
    policy.train()
    results = {}
    for micro in (8, 1, 3):
        settings = PPOSettings(agg=agg, micro_batch_size=micro, clip_low=0.2, clip_high=0.28)
        results[micro] = _run(policy, settings, episodes, advantages)
    loss8, grads8 = results[8][0]["loss"], results[8][1]
    assert math.isfinite(loss8) and loss8 != 0.0
    # the noisy behaviour log-probs make both clip branches active, so clipping is covered too
    assert results[8][0]["clip_frac_low"] > 0 and results[8][0]["clip_frac_high"] > 0
    assert len(grads8) == len(list(policy.parameters()))
    assert sum(float(g.abs().sum()) for g in grads8.values()) > 0
    for micro in (1, 3):
        metrics, grads = results[micro]
        assert metrics["loss"] == pytest.approx(loss8, abs=1e-5)
        assert grads.keys() == grads8.keys()
        for name in grads8:
            torch.testing.assert_close(grads[name], grads8[name], atol=1e-5, rtol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")
        for key in ("entropy", "logprob_mismatch", "clip_frac_low", "clip_frac_high", "approx_kl"):
            assert metrics[key] == pytest.approx(results[8][0][key], abs=1e-5), key


@pytest.mark.parametrize("agg", AGG_MODES)
def test_mini_batch_loss_equals_direct_loss(model, data, agg):
    """One micro-batch of everything equals the plain policy loss of the collated batch."""
    episodes, advantages = data
    policy = copy.deepcopy(model)
    metrics, _ = _run(policy, PPOSettings(agg=agg, micro_batch_size=8), episodes, advantages)
    batch = collate(episodes, 0, "cpu", advantages)
    with torch.no_grad():
        logprobs = token_logprobs(policy, batch.input_ids, batch.attention_mask)
    norm = max(sum(e.loss_mask) for e in episodes)
    direct, _ = policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask, agg=agg,
                            norm_length=norm)
    assert metrics["loss"] == pytest.approx(float(direct), abs=1e-5)


def test_gradient_accumulation_with_entropy_and_kl(model, data):
    episodes, advantages = data
    policy = copy.deepcopy(model)
    with torch.no_grad():  # make the policy differ from the reference so the KL term is non-zero
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = {}
    for micro in (8, 3):
        settings = PPOSettings(agg="seq-mean-token-mean", micro_batch_size=micro, entropy_coef=0.01, kl_coef=0.1,
                               temperature=0.7)
        out[micro] = _run(policy, settings, episodes, advantages, ref=model)
    assert out[8][0]["kl"] > 0
    assert out[3][0]["loss"] == pytest.approx(out[8][0]["loss"], abs=1e-5)
    assert out[3][0]["kl"] == pytest.approx(out[8][0]["kl"], abs=1e-6)
    for name, g in out[8][1].items():
        torch.testing.assert_close(out[3][1][name], g, atol=1e-5, rtol=0)


def _snapshot(policy, optimizer):
    params = {n: p.detach().clone() for n, p in policy.named_parameters()}
    state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for p, s in optimizer.state.items()}
    return params, state


def test_non_finite_loss_skips_update(model, data):
    episodes, advantages = data
    policy = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    learner = Learner(policy, optimizer, PPOSettings(micro_batch_size=3), pad_token_id=0)
    ok = learner.mini_batch_step(batch_of(episodes, advantages))  # a real step, so the optimiser has state
    assert ok["skipped"] == 0.0 and learner.skipped_updates == 0 and math.isfinite(ok["grad_norm"])
    assert any(not torch.equal(p, q) for p, q in zip(policy.parameters(), model.parameters()))
    params, state = _snapshot(policy, optimizer)
    assert state

    bad = list(advantages)
    bad[1] = float("nan")
    metrics = learner.mini_batch_step(batch_of(episodes, bad))
    assert metrics["skipped"] == 1.0
    assert learner.skipped_updates == 1
    assert not math.isfinite(metrics["loss"]) or not math.isfinite(metrics["grad_norm"])
    after_params, after_state = _snapshot(policy, optimizer)
    for name, p in params.items():
        assert torch.equal(after_params[name], p), name
    assert after_state.keys() == state.keys()
    for key, s in state.items():
        for k, v in s.items():
            assert torch.equal(after_state[key][k], v) if torch.is_tensor(v) else after_state[key][k] == v
    assert all(p.grad is None for p in policy.parameters())

    # an infinite behaviour log-prob on a sampled token is skipped as well
    broken = copy.deepcopy(episodes)
    i = broken[0].loss_mask.index(1)
    broken[0].behavior_logprobs[i] = float("-inf")
    metrics = learner.mini_batch_step(batch_of(broken, [abs(a) + 1 for a in advantages]))
    assert metrics["skipped"] == 1.0 and learner.skipped_updates == 2
    for name, p in policy.named_parameters():
        assert torch.equal(p.detach(), params[name]), name

    # and training goes on afterwards
    assert learner.mini_batch_step(batch_of(episodes, advantages))["skipped"] == 0.0


def test_update_runs_mini_batches(model, data):
    episodes, advantages = data
    policy = copy.deepcopy(model)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-3)
    learner = Learner(policy, optimizer, PPOSettings(mini_batches=2, ppo_epochs=2, micro_batch_size=4), pad_token_id=0)
    metrics = learner.update(batch_of(episodes, advantages))
    assert metrics["skipped"] == 0.0
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert any(not torch.equal(p, q) for p, q in zip(policy.parameters(), model.parameters()))


def _ep(ids, mask, lps):
    return Episode(task=Task(id="x", prompt="", answer=""), input_ids=ids, loss_mask=mask, behavior_logprobs=lps,
                   turn_index=[0] * len(ids))


def test_collate_alignment():
    a = _ep([5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.25])
    b = _ep([9, 10, 11, 12, 13, 14], [0, 1, 1, 0, 1, 1], [0.0, -1.0, -2.0, 0.0, -3.0, -4.0])
    batch = collate([a, b], pad_token_id=99, advantages=[2.0, -1.0])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 99, 99], [9, 10, 11, 12, 13, 14]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert torch.equal(batch.targets, batch.input_ids[:, 1:])
    assert batch.targets.tolist() == [[6, 7, 8, 99, 99], [10, 11, 12, 13, 14]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0], [1, 1, 0, 1, 1]]
    assert batch.old_logprobs.tolist() == [[0.0, -0.5, -0.25, 0.0, 0.0], [-1.0, -2.0, 0.0, -3.0, -4.0]]
    assert batch.advantages.tolist() == [[0.0, 2.0, 2.0, 0.0, 0.0], [-1.0, -1.0, 0.0, -1.0, -1.0]]
    assert batch.loss_mask.dtype == torch.float32
    # without advantages: zeros
    assert torch.equal(collate([a, b], 0).advantages, torch.zeros(2, 5))


def test_token_logprobs_alignment(model):
    ids = torch.tensor([[7, 8, 9, 10, 11]])
    lp, logits = token_logprobs(model, ids, torch.ones_like(ids), return_logits=True)
    assert lp.shape == (1, 4) and logits.shape[:2] == (1, 4)
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    expected = torch.stack([full[t, ids[0, t + 1]] for t in range(4)])
    torch.testing.assert_close(lp[0].detach(), expected, atol=1e-5, rtol=0)
    hot = token_logprobs(model, ids, torch.ones_like(ids), temperature=0.5)
    expected = torch.stack([torch.log_softmax(model(input_ids=ids).logits[0, t].float() / 0.5, -1)[ids[0, t + 1]]
                            for t in range(4)])
    torch.testing.assert_close(hot[0].detach(), expected.detach(), atol=1e-5, rtol=0)


def _token_advantages(episodes, seed: int = 5) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    return [[float(torch.randn((), generator=g)) if m else 0.0 for m in e.loss_mask] for e in episodes]


@pytest.mark.parametrize("loss,agg", [("gspo", "seq-mean-token-mean"), ("gspo", "token-mean"),
                                      ("ppo_clip", "seq-mean-token-sum")])
def test_gradient_accumulation_exact_for_gspo_dual_clip_and_token_advantages(model, data, loss, agg):
    episodes, _ = data
    advantages = _token_advantages(episodes)
    policy = copy.deepcopy(model)
    policy.train()
    out = {}
    for micro in (8, 3, 1):
        settings = PPOSettings(agg=agg, micro_batch_size=micro, loss=loss, clip_low=0.2, clip_high=0.28,
                               dual_clip=3.0 if loss == "ppo_clip" else None)
        out[micro] = _run(policy, settings, episodes, advantages)
    assert math.isfinite(out[8][0]["loss"]) and out[8][0]["loss"] != 0.0
    for micro in (3, 1):
        assert out[micro][0]["loss"] == pytest.approx(out[8][0]["loss"], abs=1e-5)
        for name, g in out[8][1].items():
            torch.testing.assert_close(out[micro][1][name], g, atol=1e-5, rtol=0)


def test_collate_token_level_advantages():
    a = _ep([5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.25])
    batch = collate([a], pad_token_id=0, advantages=[[9.0, 9.0, 0.5, -1.5]])
    assert batch.advantages.tolist() == [[0.0, 0.5, -1.5]]  # shifted; mask-0 positions zeroed
    with pytest.raises(ValueError, match="4 tokens but 3 advantages"):
        collate([a], 0, advantages=[[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match="2 advantages for 1 rows"):
        collate([a], 0, advantages=[1.0, 2.0])


def test_unknown_loss_name():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'"):
        PPOSettings(loss="ppo")


def test_recomputed_old_logprobs_make_the_ratio_one(model, data):
    """With recomputed old log-probs (and no update yet) every ratio is 1: PPO loss = -agg(A)."""
    episodes, advantages = data
    policy = copy.deepcopy(model)
    learner = Learner(policy, torch.optim.SGD(policy.parameters(), lr=0.0),
                      PPOSettings(micro_batch_size=3, old_logprobs="recompute"), pad_token_id=0)
    recomputed, diag = learner.recompute_old_logprobs(batch_of(episodes, advantages))
    metrics = learner.mini_batch_loss(recomputed)
    batch = collate(episodes, 0, "cpu", advantages)
    expected = -aggregate(batch.advantages, batch.loss_mask, "token-mean")
    assert metrics["loss"] == pytest.approx(float(expected), abs=1e-5)
    assert metrics["clip_frac_low"] == 0.0 and metrics["clip_frac_high"] == 0.0
    # the behaviour log-probs are the model's own plus N(0, 0.3) noise: the mismatch is that noise
    with torch.no_grad():
        own = token_logprobs(policy, batch.input_ids, batch.attention_mask)
    noise = ((own - batch.old_logprobs).abs() * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert diag["mismatch_abs_before_update"] == pytest.approx(float(noise), abs=1e-5)
    assert diag["mismatch_kl_before_update"] > 0


def test_truncated_importance_sampling_weights(model, data):
    episodes, advantages = data
    policy = copy.deepcopy(model)
    cap = 1.5
    out = {}
    for micro in (8, 3):
        learner = Learner(policy, torch.optim.SGD(policy.parameters(), lr=0.0),
                          PPOSettings(micro_batch_size=micro, old_logprobs="recompute", tis_cap=cap), pad_token_id=0)
        recomputed, _ = learner.recompute_old_logprobs(batch_of(episodes, advantages))
        policy.zero_grad(set_to_none=True)
        out[micro] = (learner.mini_batch_loss(recomputed), _grads(policy))
    batch = collate(episodes, 0, "cpu", advantages)
    with torch.no_grad():
        own = token_logprobs(policy, batch.input_ids, batch.attention_mask)
    raw = torch.exp(own - batch.old_logprobs) * batch.loss_mask
    w = raw.clamp(max=cap)
    # ratio 1 again, so the loss is -agg(w * A)
    expected = -aggregate(w * batch.advantages, batch.loss_mask, "token-mean")
    metrics = out[8][0]
    assert metrics["loss"] == pytest.approx(float(expected), abs=1e-5)
    n = float(batch.loss_mask.sum())
    assert metrics["tis_weight"] == pytest.approx(float(w.sum()) / n, abs=1e-5)
    assert 0 < metrics["tis_truncated"] == pytest.approx(float((raw > cap).sum()) / n, abs=1e-6)
    assert out[3][0]["loss"] == pytest.approx(metrics["loss"], abs=1e-5)
    for name, g in out[8][1].items():
        torch.testing.assert_close(out[3][1][name], g, atol=1e-5, rtol=0)


def test_update_with_recompute_reports_mismatch(model, data):
    episodes, advantages = data
    policy = copy.deepcopy(model)
    learner = Learner(policy, torch.optim.SGD(policy.parameters(), lr=1e-3),
                      PPOSettings(mini_batches=2, micro_batch_size=4, old_logprobs="recompute", tis_cap=2.0),
                      pad_token_id=0)
    metrics = learner.update(batch_of(episodes, advantages))
    assert metrics["mismatch_abs_before_update"] > 0 and metrics["skipped"] == 0.0
    with pytest.raises(ValueError, match="old_logprobs='recompute'"):
        PPOSettings(tis_cap=2.0)
    with pytest.raises(RuntimeError, match="recompute_old_logprobs"):
        learner.mini_batch_loss(batch_of(episodes, advantages))  # a batch without recomputed log-probs


def _critic_setup(model, micro: int):
    from ctxrl.train.critic import Critic

    policy = copy.deepcopy(model)
    critic = Critic(copy.deepcopy(model))
    with torch.no_grad():  # a non-zero head, so values and their gradients are not trivial
        critic.head.weight.copy_(torch.linspace(-0.05, 0.05, critic.head.weight.numel()).view_as(critic.head.weight))
    learner = Learner(policy, torch.optim.SGD(policy.parameters(), lr=0.0), PPOSettings(micro_batch_size=micro),
                      pad_token_id=0, critic=critic, critic_optimizer=torch.optim.SGD(critic.parameters(), lr=0.0))
    return learner, critic


def test_critic_values_align_and_accumulate_exactly(model, data):
    from ctxrl.train.critic import episode_values

    episodes, _ = data
    advantages = _token_advantages(episodes)
    returns = [[float(i % 3) for i in range(len(e.input_ids))] for e in episodes]
    grads = {}
    for micro in (8, 3):
        learner, critic = _critic_setup(model, micro)
        values = episode_values(critic, episodes, 0, micro_batch_size=micro)
        assert [len(v) for v in values] == [len(e.input_ids) for e in episodes] and all(v[0] == 0.0 for v in values)
        # old values slightly off, so the value clip is exercised
        old = [[x + 0.3 * ((i % 2) * 2 - 1) for i, x in enumerate(v)] for v in values]
        critic.zero_grad(set_to_none=True)
        metrics = learner.mini_batch_loss(batch_of(episodes, advantages, returns=returns, old_values=old))
        grads[micro] = (metrics, {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None})
    assert grads[8][0]["vf_loss"] > 0 and 0 < grads[8][0]["vf_clip_frac"] < 1
    assert grads[3][0]["vf_loss"] == pytest.approx(grads[8][0]["vf_loss"], abs=1e-5)
    for name, g in grads[8][1].items():
        torch.testing.assert_close(grads[3][1][name], g, atol=1e-5, rtol=0)


def test_critic_learns_the_returns(model, data):
    from ctxrl.train.critic import Critic, episode_values

    episodes, _ = data
    policy = copy.deepcopy(model)
    critic = Critic(copy.deepcopy(model))
    learner = Learner(policy, torch.optim.SGD(policy.parameters(), lr=0.0), PPOSettings(micro_batch_size=4),
                      pad_token_id=0, critic=critic, critic_optimizer=torch.optim.AdamW(critic.parameters(), lr=3e-3))
    returns = [[0.7] * len(e.input_ids) for e in episodes]
    advantages = [[0.0] * len(e.input_ids) for e in episodes]
    first = last = None
    for _ in range(15):
        values = episode_values(critic, episodes, 0)
        metrics = learner.update(batch_of(episodes, advantages, returns=returns, old_values=values))
        first = metrics["vf_loss"] if first is None else first
        last = metrics["vf_loss"]
    assert first == pytest.approx(0.5 * 0.7 ** 2, rel=1e-4)  # zero-initialised head: V = 0
    assert last < 0.2 * first
    with pytest.raises(ValueError, match="needs returns and old_values"):
        learner.update(batch_of(episodes, advantages))
    with pytest.raises(ValueError, match="critic_optimizer"):
        Learner(policy, torch.optim.SGD(policy.parameters(), lr=0.0), PPOSettings(), pad_token_id=0, critic=critic)


def test_critic_value_mask_limits_the_value_loss(model, data):
    from ctxrl.train.critic import Critic, episode_values

    episodes, _ = data
    policy = copy.deepcopy(model)
    critic = Critic(copy.deepcopy(model))
    learner = Learner(policy, torch.optim.SGD(policy.parameters(), lr=0.0), PPOSettings(micro_batch_size=3),
                      pad_token_id=0, critic=critic, critic_optimizer=torch.optim.SGD(critic.parameters(), lr=0.0))
    values = episode_values(critic, episodes, 0)  # all 0 (zero head)
    # one value position per episode (its first sampled token), with return 2.0 there and 9.0 elsewhere
    value_mask, returns = [], []
    for e in episodes:
        first = e.loss_mask.index(1) if 1 in e.loss_mask else None
        value_mask.append([int(i == first) for i in range(len(e.input_ids))])
        returns.append([2.0 if i == first else 9.0 for i in range(len(e.input_ids))])
    metrics = learner.update(batch_of(episodes, [[0.0] * len(e.input_ids) for e in episodes], returns=returns,
                                      old_values=values, value_mask=value_mask))
    # value loss = mean over the value positions only of 0.5 * (0 - 2)^2 = 2 (the 9s never count)
    assert metrics["vf_loss"] == pytest.approx(2.0, rel=1e-5)


def test_dr_grpo_normaliser_is_the_configured_constant(model, data):
    episodes, advantages = data
    policy = copy.deepcopy(model)
    metrics, _ = _run(policy, PPOSettings(agg="seq-mean-token-sum-norm", micro_batch_size=8, norm_length=200.0),
                      episodes, advantages)
    batch = collate(episodes, 0, "cpu", advantages)
    with torch.no_grad():
        logprobs = token_logprobs(policy, batch.input_ids, batch.attention_mask)
    direct, _ = policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask,
                            agg="seq-mean-token-sum-norm", norm_length=200.0)
    assert metrics["loss"] == pytest.approx(float(direct), abs=1e-6)
    # the same episodes split in two mini-batches use the same constant, not each half's longest response
    half, _ = _run(copy.deepcopy(model), PPOSettings(agg="seq-mean-token-sum-norm", norm_length=200.0),
                   episodes[:4], advantages[:4])
    direct_half, _ = policy_loss(logprobs[:4], batch.old_logprobs[:4], batch.advantages[:4], batch.loss_mask[:4],
                                 agg="seq-mean-token-sum-norm", norm_length=200.0)
    assert half["loss"] == pytest.approx(float(direct_half), abs=1e-6)
