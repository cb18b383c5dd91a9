"""The learner's flat forward pass (``train.flat_forward``, ``ctxrl.learner.flat``): sequences laid end to end,
no padding, through ctxrl's own decoder forward; equal to the HF forward pass in hidden states, log-probs,
entropies, gradients and whole learner updates (float64 on the CPU, where attention is one SDPA call per
sequence; on CUDA the variable-length flash kernel is checked by ``benchmarks/grpo_step.py``)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from ctxrl.errors import ConfigError
from ctxrl.learner import flat as flat_module
from ctxrl.learner.flat import FlatDecoder, training_decoder
from ctxrl.run.build import learner_settings
from ctxrl.train.batch import collate
from ctxrl.train.learner import Learner, PPOSettings
from ctxrl.train.packing import flatten


def _build(family: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=300, max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=1)
    if family == "qwen2":
        from ctxrl.models.shapes import random_model

        return random_model("qwen2-test", torch.float64, "cpu", seed=seed)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **common)).double()
    if family == "llama-mqa":
        config = transformers.LlamaConfig(num_key_value_heads=1, tie_word_embeddings=True, **common)
        return transformers.LlamaForCausalLM(config).double()
    if family == "qwen3":
        if not hasattr(transformers, "Qwen3Config"):
            pytest.skip("this transformers has no Qwen3")
        config = transformers.Qwen3Config(num_key_value_heads=2, head_dim=16, **common)
        return transformers.Qwen3ForCausalLM(config).double()
    raise ValueError(family)


def test_flatten_lays_rows_end_to_end_with_restarting_positions_by_hand():
    ids = torch.tensor([[10, 11, 12, 0], [20, 21, 0, 0], [30, 31, 32, 33]])
    flat = flatten(ids, torch.tensor([3, 2, 4]))
    assert flat.ids.tolist() == [10, 11, 12, 20, 21, 30, 31, 32, 33]
    assert flat.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert flat.cu_seqlens.tolist() == [0, 3, 5, 9] and flat.cu_seqlens.dtype == torch.int32
    assert flat.longest == 4 and flat.starts.tolist() == [0, 3, 5]
    wanted = torch.tensor([[False, True, False], [True, False, False], [False, True, True]])  # [B, T-1]
    at = flat.index(wanted)
    assert at.tolist() == [1, 3, 6, 7]  # the position predicting each wanted token...
    assert flat.ids[at + 1].tolist() == [12, 21, 32, 33]  # ...and the token: ids[row, col + 1]


@pytest.mark.parametrize("family", ["qwen2", "llama", "llama-mqa", "qwen3"])
def test_hidden_states_equal_the_hf_forward_pass_at_every_real_position(family):
    model = _build(family).eval()
    lengths = [7, 2, 12, 5]
    ids = torch.randint(3, model.config.vocab_size, (len(lengths), max(lengths)), generator=torch.Generator()
                        .manual_seed(1))
    attention = (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)).long()
    ids = ids * attention
    with torch.no_grad():
        want = model.model(input_ids=ids, attention_mask=attention).last_hidden_state[attention.bool()]
        flat = flatten(ids, torch.tensor(lengths))
        got = FlatDecoder(model).hidden_states(flat.ids, flat.positions, flat.cu_seqlens, flat.longest)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("family,checkpointing", [("qwen2", False), ("qwen2", True), ("llama", False),
                                                  ("qwen3", True)])
@pytest.mark.parametrize("chunk,entropy_coef", [(0, 0.01), (5, 0.01), (5, 0.0)])  # (0.0: the fused head)
def test_logprobs_entropy_and_gradients_equal_the_padded_hf_path(family, checkpointing, chunk, entropy_coef,
                                                                 scored_episodes):
    model = _build(family)
    lengths = [9, 4, 13, 6, 3, 13]
    batch = collate(scored_episodes(model.config.vocab_size, lengths), 0, advantages=[1.0, -1.0, 0.5, 2.0, -0.5, 1.0])
    results = []
    for mode in ("off", "on"):
        m = copy.deepcopy(model).train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        settings = PPOSettings(logprob_chunk_tokens=chunk, flat_forward=mode, entropy_coef=entropy_coef)
        assert (training_decoder(m, mode) is None) == (mode == "off")
        lp, ent = settings.logprobs(m, batch, with_entropy=True)
        loss = -(lp * batch.advantages * batch.loss_mask).sum() - entropy_coef * (ent * batch.loss_mask).sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        results.append((lp.detach(), ent.detach(), grads))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    mask = batch.loss_mask
    assert lp_b.shape == ent_b.shape == mask.shape
    torch.testing.assert_close(lp_a * mask, lp_b, atol=1e-10, rtol=1e-9)
    assert (lp_b[mask == 0] == 0).all() and (ent_b[mask == 0] == 0).all()
    torch.testing.assert_close(ent_a * mask, ent_b, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(g_a, g_b, atol=1e-9, rtol=1e-7)
    assert g_a.abs().sum() > 0


def test_a_learner_update_through_the_flat_forward_matches_the_hf_update(scored_episodes):
    model = _build("qwen2")
    batch = collate(scored_episodes(model.config.vocab_size, [12, 5, 8, 3, 10], seed=2), 0,
                    advantages=[1.0, -1.0, 0.5, -0.5, 0.25])
    out = []
    for mode in ("off", "on"):
        m = copy.deepcopy(model)
        settings = PPOSettings(flat_forward=mode, logprob_chunk_tokens=4, old_logprobs="recompute",
                               micro_batch_size=2, mini_batches=2)
        learner = Learner(m, torch.optim.SGD(m.parameters(), lr=0.1), settings, pad_token_id=0, seed=3)
        metrics = learner.update(batch)
        out.append((metrics, torch.cat([p.detach().flatten() for p in m.parameters()])))
    (m_a, w_a), (m_b, w_b) = out
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert not torch.equal(w_a, before)
    torch.testing.assert_close(w_a, w_b, atol=1e-10, rtol=1e-9)
    for key in ("loss", "entropy", "grad_norm", "approx_kl", "mismatch_abs_before_update"):
        assert m_a[key] == pytest.approx(m_b[key], rel=1e-7, abs=1e-12), key


def test_under_a_token_budget_the_flat_learner_packs_by_tokens_alone(scored_episodes, monkeypatch):
    """``train.micro_batch_size`` caps padded micro-batches' rows; through the flat pass the token budget alone
    bounds them, and the update is the same as one row at a time through HF's pass."""
    from ctxrl.learner import forward as forward_module  # (where the learner's micro-batches are cut)

    model = _build("qwen2")
    lengths = [12, 5, 8, 3, 10, 7]
    batch = collate(scored_episodes(model.config.vocab_size, lengths, seed=4), 0,
                    advantages=[1.0, -1.0, 0.5, -0.5, 0.25, 2.0])
    seen: dict[str, list[int]] = {}
    real = forward_module.micro_batches

    def counting(b, size, device, max_tokens=0, padded=True):
        for rows, micro in real(b, size, device, max_tokens, padded=padded):
            seen.setdefault(mode, []).append(len(rows))
            yield rows, micro

    monkeypatch.setattr(forward_module, "micro_batches", counting)
    out = []
    for mode, rows in (("off", 1), ("on", 1)):
        m = copy.deepcopy(model)
        settings = PPOSettings(flat_forward=mode, micro_batch_size=rows, max_tokens_per_microbatch=48)
        learner = Learner(m, torch.optim.SGD(m.parameters(), lr=0.1), settings, pad_token_id=0, seed=3)
        assert learner.rows_per_micro_batch(batch) == (1 if mode == "off" else len(lengths))
        learner.update(batch)
        out.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert seen["off"] == [1] * 6  # one row at a time, as asked
    assert seen["on"] == [6]  # their own tokens, not their padding: 12 + 10 + 8 + 7 + 5 + 3 = 45 <= 48
    torch.testing.assert_close(out[0], out[1], atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_the_one_graph_layer_is_the_modules_arithmetic(family):
    """``layer_math`` (what ``train.flat_forward = "compiled"`` hands to torch.compile) run eagerly gives the
    module path's hidden states and gradients: Qwen2's q/k/v biases, Llama's none, Qwen3's head norms."""
    from ctxrl.learner.flat import layer_math

    model = _build(family)
    lengths = torch.tensor([7, 12, 3])
    ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(5))
    flat = flatten(ids * (torch.arange(12) < lengths.unsqueeze(1)), lengths)
    results = []
    for one_graph in (False, True):
        m = copy.deepcopy(model)
        decoder = FlatDecoder(m)
        decoder.compiled_layers = layer_math if one_graph else None  # (eager: the same function, uncompiled)
        hidden = decoder.hidden_states(flat.ids, flat.positions, flat.cu_seqlens, flat.longest)
        (hidden ** 2).sum().backward()
        results.append((hidden.detach(), [p.grad for p in m.parameters()]))
    (h_a, g_a), (h_b, g_b) = results
    torch.testing.assert_close(h_a, h_b, atol=1e-10, rtol=1e-9)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-7)


@pytest.mark.slow
def test_compiled_mode_compiles_each_layer_and_matches_the_eager_pass():
    """``train.flat_forward = "compiled"`` on the CPU (inductor's C++ backend): the same hidden states and
    gradients as ``on``, up to the float32 norm statistics both round through (minutes to compile here)."""
    model = _build("qwen2")
    lengths = torch.tensor([7, 12, 3])
    ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(6))
    flat = flatten(ids * (torch.arange(12) < lengths.unsqueeze(1)), lengths)
    results = []
    for mode in ("on", "compiled"):
        m = copy.deepcopy(model)
        decoder = training_decoder(m, mode)
        assert (decoder.compiled_layers is not None) == (mode == "compiled")
        hidden = decoder.hidden_states(flat.ids, flat.positions, flat.cu_seqlens, flat.longest)
        (hidden ** 2).sum().backward()
        results.append((hidden.detach(), torch.cat([p.grad.flatten() for p in m.parameters()])))
    (h_a, g_a), (h_b, g_b) = results
    torch.testing.assert_close(h_a, h_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_a, g_b, atol=1e-3, rtol=1e-5)


def test_auto_uses_the_hf_path_off_cuda_and_on_refuses_what_it_cannot_run():
    model = _build("qwen2").float()
    assert training_decoder(model, "auto") is None  # CPU: the HF forward pass
    assert training_decoder(model, "off") is None
    decoder = training_decoder(model, "on")
    assert isinstance(decoder, FlatDecoder) and training_decoder(model, "on") is decoder  # built once
    with pytest.raises(ValueError, match="flat_forward must be one of auto, on, compiled, graphed, off"):
        training_decoder(model, "yes")
    with pytest.raises(ValueError, match="flat_forward must be one of"):
        PPOSettings(flat_forward="fast")

    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(ConfigError, match="model type 'gpt2' is not one of the supported families.*flat_forward=auto"):
        training_decoder(gpt2, "on")
    with pytest.raises(ConfigError, match="flat_forward=compiled, but GPT2LMHeadModel cannot use it"):
        training_decoder(gpt2, "compiled")
    assert training_decoder(gpt2, "auto") is None
    dropout = _build("llama")
    dropout.config.attention_dropout = 0.1
    with pytest.raises(ConfigError, match="attention dropout"):
        training_decoder(dropout, "on")


def test_a_mask_past_a_rows_end_is_refused_not_scored_on_the_next_sequence():
    from ctxrl.train.logprobs import flat_token_logprobs

    model = _build("qwen2")
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # row 0 has 3 tokens: its last prediction is column 1
    with pytest.raises(ValueError, match="past its row's last token"):
        flat_token_logprobs(FlatDecoder(model), ids, torch.tensor([3, 4]), mask=mask)


def test_a_sliding_window_shorter_than_the_sequences_sends_them_to_the_hf_pass():
    decoder = FlatDecoder(_build("llama"))
    assert decoder.window is None and decoder.fits(10_000)
    decoder.window = 8
    assert decoder.fits(8) and not decoder.fits(9)


def test_a_decoder_that_does_not_reproduce_the_model_is_refused(monkeypatch):
    monkeypatch.setattr(flat_module, "_disagreement", lambda model, decoder: 0.5)
    with pytest.raises(ConfigError, match="does not reproduce the model's own forward pass"):
        training_decoder(_build("llama"), "on")


def test_the_check_input_agrees_for_a_real_model_and_not_for_a_broken_decoder():
    model = _build("qwen2").float()
    decoder = FlatDecoder(model)
    assert flat_module._disagreement(model, decoder) < 1e-5
    decoder.scaling *= 3.0  # a wrong attention scale: a different model
    assert flat_module._disagreement(model, decoder) > 1e-2


def test_the_config_field_reaches_the_learner_and_is_validated():
    from ctxrl.config import Config, validate

    config = Config()
    assert config.train.flat_forward == "auto"
    config = replace(config, train=replace(config.train, flat_forward="on"))  # (sections are frozen)
    assert learner_settings(config).train.flat_forward == "on"
    with pytest.raises(ConfigError, match="train.flat_forward must be one of auto, on, compiled, graphed, off"):
        validate(replace(config, train=replace(config.train, flat_forward="sometimes")))
