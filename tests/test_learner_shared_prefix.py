"""Shared-prefix training in the learner (``train.shared_prefix``): ``Learner.update`` with a GRPO group's rows run
as one packed tree gives the loss, figures and updated weights of the same update without sharing; the figures say
which rows shared; what cannot share falls back or is refused with the fix."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from test_shared_prefix import _with_float64_norms

from ctxrl.errors import ConfigError
from ctxrl.learner.batch import collate
from ctxrl.learner.forward import PADDED, choose
from ctxrl.learner.learner import Learner
from ctxrl.learner.settings import LearnerSettings
from ctxrl.learner.shared_prefix import build_tree
from ctxrl.sections import AlgoConfig, TrainConfig
from ctxrl.types import TrainSequence

PROMPT = 40
COMPLETIONS = (3, 8, 5, 8, 1, 6)


def _rows(vocab: int, seed: int = 0) -> list[TrainSequence]:
    """A GRPO group (one prompt, six completions: two of them identical, one of a single token, advantages of mean
    0) and one row of another task that shares nothing with it."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (PROMPT,), generator=g).tolist()
    completions = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in COMPLETIONS]
    completions[3] = list(completions[1])
    advantages = torch.randn(len(completions), generator=g)
    advantages = (advantages - advantages.mean()).tolist()
    other = [2, *torch.randint(3, vocab, (20,), generator=g).tolist()]
    rows = []
    for ids, prompt_tokens, advantage in [*((prompt + c, PROMPT, a) for c, a in zip(completions, advantages)),
                                          (other, 12, 0.7)]:
        mask = [0] * prompt_tokens + [1] * (len(ids) - prompt_tokens)
        behaviour = [-float(torch.rand((), generator=g)) * m for m in mask]
        rows.append(TrainSequence(input_ids=ids, loss_mask=mask, behavior_logprobs=behaviour,
                                  advantages=[advantage * m for m in mask]))
    return rows


def _trial(vocab: int, seed: int = 1) -> list[TrainSequence]:
    """A meta-RL trial of 3 attempts: attempt k's row holds attempts 1..k, only its own attempt sampled, so a token
    one row trains on is read, untrained, by the later rows through it (the tree must not give it to them)."""
    g = torch.Generator().manual_seed(seed)
    so_far = torch.randint(3, vocab, (PROMPT,), generator=g).tolist()
    rows = []
    for n, advantage in zip((5, 4, 6), (1.0, -0.5, 0.25)):
        context = len(so_far)
        so_far = so_far + torch.randint(3, vocab, (n,), generator=g).tolist()
        mask = [0] * context + [1] * n
        behaviour = [-float(torch.rand((), generator=g)) * m for m in mask]
        rows.append(TrainSequence(input_ids=list(so_far), loss_mask=mask, behavior_logprobs=behaviour,
                                  advantages=[advantage * m for m in mask]))
        so_far = so_far + torch.randint(3, vocab, (2,), generator=g).tolist()  # the feedback
    return rows


def _update(model, rows, sharing: str, *, micro_batch_size: int = 8, budget: int = 0, chunk: int = 1024):
    """One ``Learner.update`` (recomputed old log-probs, an entropy bonus, one mini-batch) of a float64 copy of
    ``model`` under plain SGD, so the updated weights are the gradient's own: its figures and weights."""
    policy = _with_float64_norms(copy.deepcopy(model).double())
    settings = LearnerSettings(algo=AlgoConfig(old_logprobs="recompute", entropy_coef=0.01),
                               train=TrainConfig(mini_batches=1, micro_batch_size=micro_batch_size,
                                                 shared_prefix=sharing, logprob_chunk_tokens=chunk),
                               micro_batch_tokens=budget)
    learner = Learner(policy, torch.optim.SGD(policy.parameters(), lr=0.5), settings, pad_token_id=0)
    metrics = learner.update(collate(rows, 0))
    return metrics, {name: p.detach().clone() for name, p in policy.named_parameters()}


@pytest.fixture(scope="module")
def unshared(model):
    rows = _rows(model.config.vocab_size)
    return rows, _update(model, rows, "off")


@pytest.mark.parametrize("micro_batch_size, budget, chunk", [(8, 0, 1024), (2, 200, 1024), (8, 0, 0)])
def test_update_with_shared_prefix_equals_the_update_without(model, unshared, micro_batch_size, budget, chunk):
    """Float64 with float64 norms (``tests/test_shared_prefix.py`` says why HF's float32 norm would round the
    prefix's summed gradient differently): the tree and the padded rows compute the same sums in a different order
    and shape, so they agree to float64 rounding; 1e-10 is about a million times that, and a thousand times below
    what one token's gradient wrongly shared (a sibling seen, a log-prob read at the wrong position) would move."""
    rows, (expected, weights) = unshared
    metrics, shared_weights = _update(model, rows, "auto", micro_batch_size=micro_batch_size, budget=budget,
                                      chunk=chunk)
    if chunk == 0:  # the model's full logits: compared with the unshared update through them
        expected, weights = _update(model, rows, "off", chunk=0)
    group = build_tree([r.input_ids for r in rows[:len(COMPLETIONS)]])
    assert metrics["learner_shared_prefix_rows"] == len(COMPLETIONS)  # the group shared; the other row did not
    assert metrics["learner_shared_prefix_saved_tokens"] == group.saved_tokens > (len(COMPLETIONS) - 1) * PROMPT
    assert expected["learner_shared_prefix_rows"] == expected["learner_shared_prefix_saved_tokens"] == 0
    for key in ("loss", "entropy", "logprob_mismatch", "mismatch_abs_before_update", "mismatch_kl_before_update",
                "clip_frac_low", "clip_frac_high", "grad_norm"):
        assert metrics[key] == pytest.approx(expected[key], abs=1e-10, rel=0), key
    assert metrics["grad_norm"] > 0
    moved = 0.0
    for name, value in weights.items():
        torch.testing.assert_close(shared_weights[name], value, rtol=0, atol=1e-10, msg=name)
        moved = max(moved, float((value - model.state_dict()[name].double()).abs().max()))
    assert moved > 1e-3  # the update moved the weights: equal weights are not both untouched


def test_a_trial_shares_its_earlier_attempts_and_trains_each_in_its_own_row(model):
    rows = _trial(model.config.vocab_size)
    (expected, weights), (metrics, shared_weights) = (_update(model, rows, mode) for mode in ("off", "auto"))
    assert metrics["learner_shared_prefix_rows"] == 3
    assert metrics["learner_shared_prefix_saved_tokens"] == sum(len(r.input_ids) for r in rows[:2])  # a chain
    for key in ("loss", "entropy", "mismatch_abs_before_update", "grad_norm"):
        assert metrics[key] == pytest.approx(expected[key], abs=1e-10, rel=0), key
    for name, value in weights.items():
        torch.testing.assert_close(shared_weights[name], value, rtol=0, atol=1e-10, msg=name)


def test_tree_logprobs_are_the_padded_ones_and_zero_where_a_rows_loss_mask_is(model):
    """A trial's earlier attempt is wanted by its own row only: the later rows read its node, and get 0 there."""
    policy = copy.deepcopy(model).double()
    forward = LearnerSettings(train=TrainConfig(shared_prefix="auto")).forward(policy)
    batch = collate(_trial(model.config.vocab_size), 0)
    [(rows, micro)] = list(forward.micro_batches(batch, 8, "cpu"))
    assert rows == [0, 1, 2] and micro.tree is not None
    with torch.no_grad():
        tree, entropy = forward.logprobs(micro, with_entropy=True)
        padded, padded_entropy = LearnerSettings().forward(policy).logprobs(batch, with_entropy=True)
    assert bool((tree[micro.loss_mask == 0] == 0).all()) and bool((entropy[micro.loss_mask == 0] == 0).all())
    torch.testing.assert_close(tree, padded, rtol=0, atol=1e-10)
    torch.testing.assert_close(entropy, padded_entropy, rtol=0, atol=1e-10)


def test_a_tree_that_does_not_fit_a_micro_batch_runs_as_its_rows(model, unshared):
    """Without a token budget a tree holds at most ``micro_batch_size`` rows; a larger one runs unshared (the
    figure says so) with the same numbers."""
    rows, (expected, weights) = unshared
    metrics, shared_weights = _update(model, rows, "auto", micro_batch_size=4)
    assert metrics["learner_shared_prefix_rows"] == 0
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-10, rel=0)
    for name, value in weights.items():
        torch.testing.assert_close(shared_weights[name], value, rtol=0, atol=1e-10, msg=name)


def test_choose_gives_the_tree_layout_to_the_policy_only(model):
    train = TrainConfig(shared_prefix="auto")
    layout = choose(model, train, "policy")
    assert layout.tree is not None and layout.decoder is None
    assert layout.tree.matmul_params == sum(p.numel() for p in model.parameters())
    assert choose(model, train, "reference") == PADDED
    assert choose(model, TrainConfig(), "policy").tree is None


@pytest.mark.parametrize("flat", ["on", "compiled", "graphed"])
def test_a_forced_flat_pass_is_refused_with_the_fix(model, flat):
    with pytest.raises(ValueError, match="set train.flat_forward=auto"):
        choose(model, TrainConfig(shared_prefix="auto", flat_forward=flat), "policy")


def test_an_attention_without_4d_masks_is_refused_with_the_fix():
    module = torch.nn.Linear(2, 2)
    module.config = types.SimpleNamespace(_attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="'flash_attention_2': load it with sdpa, or set train.shared_prefix=off"):
        choose(module, TrainConfig(shared_prefix="auto"), "policy")
    module.config = types.SimpleNamespace(_attn_implementation="sdpa")  # no sizes to weigh a tree's FLOPs by
    with pytest.raises(ValueError, match="set train.shared_prefix=off"):
        choose(module, TrainConfig(shared_prefix="auto"), "policy")


def test_config_validation_of_shared_prefix():
    from ctxrl.config import load_config

    assert load_config(overrides=["train.shared_prefix=auto"]).train.shared_prefix == "auto"
    with pytest.raises(ConfigError, match="train.shared_prefix must be one of off, auto; got 'on'"):
        load_config(overrides=["train.shared_prefix=on"])
    with pytest.raises(ConfigError, match="flat_forward=graphed forces ctxrl's flat pass.*shared_prefix=off"):
        load_config(overrides=["train.shared_prefix=auto", "train.flat_forward=graphed"])
    with pytest.raises(ValueError, match="shared_prefix must be one of off, auto"):
        LearnerSettings(train=TrainConfig(shared_prefix="yes"))


def _two_groups(vocab: int) -> list[TrainSequence]:
    """Two GRPO groups of 4 (their own prompts), rows interleaved as a step's might be after a shuffle."""
    g = torch.Generator().manual_seed(5)
    rows = []
    prompts = [torch.randint(3, vocab, (PROMPT,), generator=g).tolist() for _ in range(2)]
    for k in range(8):
        ids = prompts[k % 2] + torch.randint(3, vocab, (6,), generator=g).tolist()
        mask = [0] * PROMPT + [1] * 6
        rows.append(TrainSequence(input_ids=ids, loss_mask=mask, behavior_logprobs=[-0.5 * m for m in mask],
                                  advantages=[(1.0 if k % 4 < 2 else -1.0) * m for m in mask]))
    return rows


def test_prefix_order_keeps_each_group_in_one_mini_batch_so_it_is_shared_whole(model):
    """``train.mini_batch_order = "prefix"``: two groups of 4 over two mini-batches, each mini-batch one whole group
    (every row once an epoch), all 8 rows shared; the shuffled order splits the groups and shares fewer."""
    rows = _two_groups(model.config.vocab_size)
    shared = {}
    for order in ("shuffled", "prefix"):
        policy = copy.deepcopy(model)
        settings = LearnerSettings(algo=AlgoConfig(old_logprobs="recompute"),
                                   train=TrainConfig(mini_batches=2, micro_batch_size=8, shared_prefix="auto",
                                                     mini_batch_order=order))
        learner = Learner(policy, torch.optim.SGD(policy.parameters(), lr=0.0), settings, pad_token_id=0)
        batch = collate(rows, 0)
        parts = learner.mini_batch_rows(batch)
        assert sorted(r for part in parts for r in part) == list(range(8))
        if order == "prefix":
            assert sorted(sorted(part) for part in parts) == [[0, 2, 4, 6], [1, 3, 5, 7]]
        shared[order] = learner.update(batch)["learner_shared_prefix_rows"]
    assert shared["prefix"] == 8 and shared["shuffled"] < 8


def test_an_unknown_mini_batch_order_is_an_error_naming_the_choices():
    from ctxrl.config import load_config

    with pytest.raises(ConfigError, match="train.mini_batch_order must be one of shuffled, prefix"):
        load_config(None, ["train.mini_batch_order=sorted"])
