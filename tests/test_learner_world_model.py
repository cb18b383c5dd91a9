"""ECHO's world-model loss in the learner (``algo.world_model_coef``): the environment's tokens as the recorder
wrote them, their cross-entropy added to the policy loss, and nothing changed at 0."""

from __future__ import annotations

import copy

import pytest
import torch

from ctxrl.engine.base import Completion
from ctxrl.errors import ConfigError
from ctxrl.learner.batch import collate
from ctxrl.learner.learner import Learner
from ctxrl.learner.logprobs import token_logprobs
from ctxrl.learner.settings import LearnerSettings
from ctxrl.rollout.recorder import Recorder
from ctxrl.sections import AlgoConfig, TrainConfig
from ctxrl.types import Episode, Message, Task, TrainSequence, environment_mask


def _episode(renderer):
    """A prompt, a sampled tool call, the tool's reply, a sampled answer, the user's feedback: through the
    ``Recorder`` as the agent loop writes them. Returns it and the [start, stop) spans the environment wrote."""
    e = Episode(task=Task(id="t", prompt="p", answer="a"))
    rec = Recorder(e, renderer)
    rec.prompt([Message(role="user", content="What is 6 times 7?")])
    end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    spans = []
    for turn, (reply, said) in enumerate([([40, 41, 42], Message(role="tool", content="42")),
                                          ([43, 44], Message(role="user", content="Right."))]):
        rec.assistant(Completion([*reply, end], [-0.5] * (len(reply) + 1), "stop"),
                      Message(role="assistant", content="..."), turn)
        ids = rec.observation_ids([said])
        spans.append((len(rec), len(rec) + len(ids)))
        rec.observe([said], ids, turn)
    return e, spans


def test_the_mask_marks_exactly_what_the_environment_wrote(renderer):
    e, spans = _episode(renderer)
    expected = [0] * len(e.input_ids)
    for start, stop in spans:
        expected[start:stop] = [1] * (stop - start)
    assert environment_mask(e) == expected and sum(expected) > 4
    assert not any(m and s for m, s in zip(e.loss_mask, expected))  # never a sampled token
    assert expected[: e.turn_index.count(-1)] == [0] * e.turn_index.count(-1)  # never the prompt
    text = renderer.tokenizer.decode([i for i, m in zip(e.input_ids, expected) if m])
    assert "42" in text and "Right." in text and "6 times 7" not in text
    assert TrainSequence.of(e, [0.0] * len(e.input_ids)).env_mask == expected


def _rows(vocab: int) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for n, advantage in zip((14, 22, 12, 17), (1.0, -0.5, 0.3, -0.8)):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        # prompt, sampled, environment, sampled
        loss_mask = [0] * 4 + [1] * 3 + [0] * 4 + [1] * (n - 11)
        env_mask = [0] * 7 + [1] * 4 + [0] * (n - 11)
        behaviour = [-float(torch.rand((), generator=g)) * m for m in loss_mask]
        rows.append(TrainSequence(input_ids=ids, loss_mask=loss_mask, behavior_logprobs=behaviour,
                                  advantages=[advantage * m for m in loss_mask], env_mask=env_mask))
    return rows


def _loss(model, rows, coef: float, micro_batch_size: int = 4):
    policy = copy.deepcopy(model)
    settings = LearnerSettings(algo=AlgoConfig(world_model_coef=coef, entropy_coef=0.01),
                               train=TrainConfig(micro_batch_size=micro_batch_size))
    learner = Learner(policy, torch.optim.SGD(policy.parameters(), lr=0.0), settings, pad_token_id=0)
    policy.zero_grad(set_to_none=True)
    metrics = learner.mini_batch_loss(collate(rows, 0))
    return metrics, {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


def test_the_loss_is_the_policy_loss_plus_coef_times_the_environment_cross_entropy(model):
    rows = _rows(model.config.vocab_size)
    batch = collate(rows, 0)
    with torch.no_grad():
        logprobs = token_logprobs(model, batch.input_ids, batch.attention_mask)  # every position, full logits
    env = batch.env_mask.bool()
    cross_entropy = float(-logprobs[env].mean())  # the mean over the mini-batch's environment tokens
    policy_only, policy_grads = _loss(model, rows, 0.0)
    coef = 0.5
    for micro in (4, 1):  # exact over micro-batches: one denominator, the mini-batch's environment tokens
        metrics, grads = _loss(model, rows, coef, micro_batch_size=micro)
        assert metrics["loss"] == pytest.approx(policy_only["loss"] + coef * cross_entropy, abs=1e-5)
        assert metrics["world_model_nll"] == pytest.approx(cross_entropy, abs=1e-5)
        for key in ("entropy", "logprob_mismatch", "clip_frac_low", "clip_frac_high"):  # the policy's own
            assert metrics[key] == pytest.approx(policy_only[key], abs=1e-6), key
        assert max(float((grads[n] - policy_grads[n]).abs().max()) for n in grads) > 1e-4  # it trains something
    assert "world_model_nll" not in policy_only


def test_at_zero_the_environment_mask_changes_nothing(model):
    rows = _rows(model.config.vocab_size)
    bare = [TrainSequence(input_ids=r.input_ids, loss_mask=r.loss_mask, behavior_logprobs=r.behavior_logprobs,
                          advantages=r.advantages) for r in rows]
    (with_mask, grads), (without, bare_grads) = _loss(model, rows, 0.0), _loss(model, bare, 0.0)
    assert with_mask == without
    for name, g in grads.items():
        assert torch.equal(g, bare_grads[name]), name


def test_config_validation_of_world_model_coef():
    from ctxrl.config import load_config

    assert load_config(overrides=["algo.world_model_coef=0.05"]).algo.world_model_coef == 0.05
    with pytest.raises(ConfigError, match="world_model_coef"):
        load_config(overrides=["algo.world_model_coef=-0.1"])
    with pytest.raises(ConfigError, match="set train.shared_prefix=off"):
        load_config(overrides=["algo.world_model_coef=0.05", "train.shared_prefix=auto"])
    with pytest.raises(ValueError, match="set train.shared_prefix=off"):
        LearnerSettings(algo=AlgoConfig(world_model_coef=0.05), train=TrainConfig(shared_prefix="auto"))
