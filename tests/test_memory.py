"""The memory plan (ctxrl/train/memory.py): its numbers derived by hand, its choices, its errors, the config field.

The shapes are SmolLM2-135M's (Llama: 30 layers, hidden 576, MLP 1536, 9 query / 3 KV heads of 64, vocabulary
49152, tied embeddings) and Qwen2.5-0.5B's (``ctxrl.models.shapes``); their parameter counts are checked against
the real HF modules built on the ``meta`` device, which is how the trainer counts them. No CUDA is needed: the
plan is pure arithmetic, and on the CPU the trainer makes none.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ctxrl.config import load_config
from ctxrl.errors import ConfigError
from ctxrl.run.build import learner_settings
from ctxrl.train.memory import (
    CUDA_CONTEXT_BYTES,
    DEFAULT_LEARNER_TOKENS,
    GIB,
    HEADROOM,
    RUNTIME_BYTES,
    ModelShape,
    RunSizes,
    activation_bytes_per_token,
    allocator_cap,
    check_free,
    kv_pool_bytes,
    lora_parameters,
    optimizer_bytes,
    plan_memory,
    smallest_fraction,
    weights_bytes,
)

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
N_135M = 49152 * 576 + 30 * (576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536 + 2 * 576) + 576
"""Embeddings (tied: counted once); per layer q, k, v, o, gate / up / down and two norms; the final norm."""
N_05B = 151936 * 896 + 24 * (896 * 896 + 896 + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896) + 896
"""Qwen2's q, k and v have biases."""
CARD = 80 * GIB
H100_80GB = int(79.19 * GIB)
"""What torch reports as an H100 80GB HBM3's total capacity (``torch.cuda.mem_get_info``, its OOM messages)."""


def meta_parameters(config_cls, model_cls, **shape) -> tuple[object, int]:
    config = config_cls(**shape)
    with torch.device("meta"):
        model = model_cls(config)
    return config, sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def smollm2() -> ModelShape:
    from transformers import LlamaConfig, LlamaForCausalLM

    config, n = meta_parameters(LlamaConfig, LlamaForCausalLM, **SMOLLM2_135M)
    return ModelShape.from_hf_config(config, n)


@pytest.fixture(scope="module")
def qwen05() -> ModelShape:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ctxrl.models.shapes import SHAPES

    config, n = meta_parameters(Qwen2Config, Qwen2ForCausalLM, **SHAPES["qwen2.5-0.5b"])
    return ModelShape.from_hf_config(config, n)


def default_run(shape: ModelShape, dtype_bytes: int = 4, **kw) -> RunSizes:
    """The defaults of ``[rollout]`` and ``[train]``: 100 slots (max_batch_size 128, at most eval.tasks = 100
    requests in flight) of 512 + 17 positions, micro_batch_size 32, 1024-position head chunks."""
    sizes = dict(shape=shape, dtype_bytes=dtype_bytes, max_total_tokens=512, micro_batch_size=32, kv_slots=100,
                 kv_tokens_per_slot=529, float32_masters=dtype_bytes == 2, device_bytes=CARD)
    return RunSizes(**{**sizes, **kw})


# -- the shapes ------------------------------------------------------------------------------------------
def test_shapes_and_parameter_counts_are_the_real_models(smollm2, qwen05):
    assert N_135M == 134_515_008 and N_05B == 494_032_768
    assert smollm2 == ModelShape(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64,
                                 vocab=49152, parameters=N_135M)
    assert (qwen05.layers, qwen05.heads, qwen05.kv_heads, qwen05.head_dim, qwen05.parameters) == (24, 14, 2, 64, N_05B)


def test_a_config_without_the_sizes_says_which():
    from transformers import PretrainedConfig

    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_hf_config(PretrainedConfig(), 1)


# -- the parts --------------------------------------------------------------------------------------------
def test_kv_pool_of_the_135m_shape_by_hand(smollm2):
    # 128 slots x 512 positions x (keys and values) x 30 layers x 3 KV heads x 64 x 2 bytes (bf16)
    assert kv_pool_bytes(smollm2, 128, 512, 2) == 128 * 512 * 2 * 30 * 3 * 64 * 2 == 1_509_949_440


def test_activations_per_token_by_hand(smollm2, qwen05):
    # per layer: 4 H + 3 q + 3 kv + 4 I = 2304 + 1728 + 576 + 6144 elements
    assert smollm2.layer_activations() == 10_752
    assert activation_bytes_per_token(default_run(smollm2, 2)) == (30 * 10_752 + 3 * 576) * 2 == 648_576
    # checkpointing: every layer's input, one layer recomputed
    checkpointed = default_run(smollm2, 2, gradient_checkpointing=True)
    assert activation_bytes_per_token(checkpointed) == (30 * 576 + 10_752 + 3 * 576) * 2 == 59_520
    # a KL reference in the loss: one more layer while the policy's activations are held
    assert activation_bytes_per_token(default_run(smollm2, 2, reference=True)) == 648_576 + 10_752 * 2
    # full logits (no chunks): the head's cost per token, logits and gradient in bf16 and two float32 copies
    assert activation_bytes_per_token(default_run(smollm2, 2, logprob_chunk_tokens=0)) == 648_576 + 49152 * 12
    # float32: no flash kernel, so attention keeps each head's scores over the longest row (9 x 512 per layer)
    assert activation_bytes_per_token(default_run(smollm2, 4)) == (30 * (10_752 + 9 * 512) + 3 * 576) * 4 == 1_850_112
    # Qwen2.5-0.5B: 4 x 896 + 3 x 896 + 3 x 128 + 4 x 4864 = 26112 per layer; 1.26 MB per token in bf16
    assert activation_bytes_per_token(default_run(qwen05, 2)) == (24 * 26_112 + 3 * 896) * 2 == 1_258_752


def test_weights_and_optimiser_by_hand(smollm2, qwen05):
    n = N_135M
    bf16 = default_run(smollm2, 2)
    assert weights_bytes(bf16) == 2 * n * 2  # the policy and the engine's copy
    assert optimizer_bytes(bf16) == 16 * n  # float32 master, float32 gradient, two float32 moments
    fp32 = default_run(smollm2, 4)
    assert (weights_bytes(fp32), optimizer_bytes(fp32)) == (2 * n * 4, 12 * n)  # gradient and two moments
    assert weights_bytes(default_run(smollm2, 2, reference=True)) == 3 * n * 2
    assert weights_bytes(default_run(smollm2, 2, kv_slots=0)) == n * 2  # no engine in this process
    critic = default_run(smollm2, 2, critic=True)
    assert (weights_bytes(critic), optimizer_bytes(critic)) == (3 * n * 2, 2 * 16 * n)
    # Qwen2.5-0.5B in bf16 with masters: 20 bytes a parameter before any activation (9.2 GiB)
    assert weights_bytes(default_run(qwen05, 2)) + optimizer_bytes(default_run(qwen05, 2)) == 20 * N_05B
    # a distillation teacher (or a local judge) of the same size on the card, in bf16: its weights, no optimiser
    beside = default_run(smollm2, 2, frozen_bytes=2 * n)
    assert (weights_bytes(beside), optimizer_bytes(beside)) == (3 * n * 2, 16 * n)


def test_the_frozen_models_that_share_the_card():
    from ctxrl.algo.estimators import get_estimator
    from ctxrl.config import load_config
    from ctxrl.train.trainer import frozen_beside

    def beside(*overrides):
        config = load_config(None, list(overrides))
        estimator = get_estimator(config.algo.advantage)(options=config.settings_of("algo", config.algo.advantage))
        return frozen_beside(config, estimator, "cuda", None)

    distill = ("algo.advantage=distill", "algo.distill.teacher=runs/t/final", "model.dtype=bfloat16")
    assert beside(*distill) == (("runs/t/final", "bfloat16"),)
    assert beside(*distill, "algo.distill.dtype=float32") == (("runs/t/final", "float32"),)
    assert beside(*distill, "algo.distill.device=cuda:1") == ()  # a card of its own
    assert beside("reward.judge.target=smollm2-135m-instruct") == (("smollm2-135m-instruct", "float32"),)
    assert beside("reward.judge.target=http://127.0.0.1:8001/v1") == ()  # an endpoint: another process


def test_lora_adapters_and_what_they_save(smollm2):
    # rank 16 on q, k, v, o, gate, up, down: 16 x ((576+576) + 2 (576+192) + (576+576) + 2 (576+1536) + (1536+576))
    adapters = 30 * 16 * 10_176
    assert lora_parameters(smollm2, 16) == adapters == 4_884_480
    assert lora_parameters(smollm2, 16, "q_proj, v_proj") == 30 * 16 * ((576 + 576) + (576 + 192))
    lora = default_run(smollm2, 2, lora_rank=16, reference=True)
    # base + adapters, the engine's adapters (it shares the base), no reference copy (the base is the reference)
    assert weights_bytes(lora) == (N_135M + adapters) * 2 + adapters * 2
    assert optimizer_bytes(lora) == 16 * adapters


# -- the plan ------------------------------------------------------------------------------------------------
def test_default_plan_lets_six_135m_runs_share_an_80gb_card(smollm2):
    # experiments/batch.py at six a card sets CTXRL_GPU_SHARE=1/6: a quarter of a sixth of 80 GiB (3.3 GiB) is less
    # than 4 GiB, so the activations get 4 GiB. float32 (model.dtype's default): 2304 tokens (4 GiB / 1_850_112
    # bytes a token, in multiples of 256); bf16 through HF's pass: 6400 (4 GiB / 648_576)
    tokens = {4: 4 * GIB // 1_850_112 // 256 * 256, 2: 4 * GIB // 648_576 // 256 * 256}
    assert tokens == {4: 2304, 2: 6400}
    for dtype_bytes in (4, 2):
        plan = plan_memory(default_run(smollm2, dtype_bytes, card_share=1 / 6))
        assert not plan.capped and plan.learner_tokens == tokens[dtype_bytes]
        assert (plan.kv_slots, plan.kv_tokens_per_slot, plan.prefill_tokens) == (100, 529, 16384)
        per_run = plan.planned_bytes + CUDA_CONTEXT_BYTES
        assert 6 * per_run <= H100_80GB, f"{per_run / GIB:.2f} GiB per run"
    fp32 = plan_memory(default_run(smollm2, 4, card_share=1 / 6))
    parts = (2 * N_135M * 4 + 12 * N_135M + RUNTIME_BYTES  # weights, optimiser, workspaces
             + 100 * 529 * 2 * 30 * 3 * 64 * 4 + 100 * 49152 * 4 * 4  # KV pool, the decode step's logits
             + 2304 * 1_850_112 + 1024 * 49152 * (2 * 4 + 8))  # activations, one head chunk
    assert fp32.planned_bytes == fp32.budget_bytes == math.ceil(parts / (1 - HEADROOM))
    assert 10.5 * GIB < fp32.planned_bytes < 11 * GIB  # (six such runs measured 9.4 GiB reserved each on an H200)


def test_alone_on_a_card_the_flat_learner_gets_a_quarter_of_it_up_to_32k_tokens(qwen05):
    # Qwen2.5-0.5B in bf16 through the flat pass: the lean MLP keeps 2 I, so a layer keeps 4 x 896 + 3 x 896 +
    # 3 x 128 + 2 x 4864 = 16384 values a token: (24 x 16384 + 3 x 896) x 2 = 791_808 bytes
    run = default_run(qwen05, 2, flat=True, max_total_tokens=1024)
    assert activation_bytes_per_token(run) == (24 * 16_384 + 3 * 896) * 2 == 791_808
    # a quarter of 80 GiB: 21_474_836_480 / 791_808 = 27_121 tokens, 26_880 in multiples of 256; no row cap (32 rows
    # of 1024 would hold 32_768 anyway) and under DEFAULT_LEARNER_TOKENS
    assert plan_memory(run).learner_tokens == 20 * GIB // 791_808 // 256 * 256 == 26_880
    # 8 rows of 1024 would cap a padded micro-batch at 8192 tokens; the flat one is bounded by tokens alone
    assert plan_memory(dataclasses.replace(run, micro_batch_size=8)).learner_tokens == 26_880
    assert plan_memory(dataclasses.replace(run, micro_batch_size=8, flat=False)).learner_tokens == 8192
    # a 141 GiB card: a quarter holds 46k tokens, more than the speed needs: DEFAULT_LEARNER_TOKENS
    assert plan_memory(dataclasses.replace(run, device_bytes=141 * GIB)).learner_tokens == DEFAULT_LEARNER_TOKENS
    # HF's pass keeps 4 I: 1_258_752 bytes a token, 17_060 tokens in a quarter of the card, 16_896 in 256s
    assert plan_memory(dataclasses.replace(run, flat=False, micro_batch_size=64)).learner_tokens == 16_896


def test_automatic_kv_slots_take_every_request_in_flight_within_a_quarter_of_the_card(qwen05):
    # a slot of 529 positions: keys and values 2 x 24 x 128 x 2 = 12_288 bytes a position, and its decode logits
    per_slot = 529 * 12_288 + 151_936 * 16
    assert per_slot == 8_931_328
    run = default_run(qwen05, 2, kv_slots=512, auto_slots=True)  # 64 tasks x 8 samples in flight
    assert plan_memory(run).kv_slots == 512  # a quarter of 80 GiB holds 2404 such slots
    assert plan_memory(dataclasses.replace(run, card_share=1 / 8)).kv_slots == int(0.25 * CARD / 8) // per_slot == 300
    assert plan_memory(dataclasses.replace(run, card_share=1e-4)).kv_slots == 8  # never below MIN_KV_SLOTS
    assert plan_memory(dataclasses.replace(run, kv_slots=5000)).kv_slots == 1024  # at most MAX_AUTO_SLOTS
    assert plan_memory(dataclasses.replace(run, auto_slots=False, kv_slots=5000)).kv_slots == 5000  # as asked


def test_default_learner_tokens_never_exceed_what_a_micro_batch_holds(smollm2):
    # 4 rows of 512 tokens at most: 2048; a row longer than the default is a micro-batch of its own
    assert plan_memory(default_run(smollm2, micro_batch_size=4)).learner_tokens == 2048
    assert plan_memory(default_run(smollm2, max_total_tokens=8192)).learner_tokens == 8192


def test_default_learner_tokens_keep_activations_within_the_budget(qwen05):
    # Qwen2.5-0.5B in bf16 through HF's pass (1_258_752 bytes a token) with no card (a CPU): 4 GiB hold 3412
    # tokens, 3328 in multiples of 256; 32 rows of 1024 would hold more
    assert plan_memory(default_run(qwen05, 2, max_total_tokens=1024, device_bytes=0)).learner_tokens == 3328


def test_a_capped_plan_fills_its_budget_in_order(smollm2):
    run = default_run(smollm2, 2, gpu_memory_fraction=0.1)
    plan = plan_memory(run)
    budget = 8 * GIB - GIB  # a tenth of 80 GiB, less the CUDA context
    usable = int(budget * 0.8)  # 6_012_954_214: a capped plan keeps 20% free
    fixed = 2 * N_135M * 2 + 16 * N_135M + 256 * 2**20  # weights, optimiser, workspaces: 2_958_735_616
    per_slot = 529 * 23_040 + 49152 * 16  # a slot's keys and values (2 x 30 x 192 x 2 bytes), its decode logits
    first_batch = 512 * 648_576 + 1024 * 49152 * 12  # one row of 512 tokens and one head chunk: 936_050_688
    room = usable - fixed - first_batch - 100 * per_slot  # every slot fits: 820_708_710 left
    tokens = (512 + room // 648_576) // 64 * 64  # (512 + 1265) rounded down to 64
    assert (plan.budget_bytes, plan.kv_slots, plan.learner_tokens) == (budget, 100, tokens) == (budget, 100, 1728)
    assert plan.capped and plan.headroom_bytes == budget - usable
    assert plan.planned_bytes <= plan.budget_bytes
    # a smaller share: the KV pool shrinks before the learner goes below one row
    tight = plan_memory(dataclasses.replace(run, gpu_memory_fraction=0.08))
    assert 8 <= tight.kv_slots < 100 and tight.learner_tokens == 512
    # a larger one: the learner grows to the most a micro-batch can hold (32 rows of 512)
    assert plan_memory(dataclasses.replace(run, gpu_memory_fraction=0.5)).learner_tokens == 32 * 512


def test_the_fraction_cap_in_bytes():
    assert allocator_cap(0.25, CARD) == 20 * GIB - CUDA_CONTEXT_BYTES
    assert allocator_cap(1.0, CARD) == CARD - CUDA_CONTEXT_BYTES


def test_an_explicit_micro_batch_is_kept_and_one_that_cannot_fit_is_an_error(smollm2):
    assert plan_memory(default_run(smollm2, max_tokens_per_microbatch=2000)).learner_tokens == 2000
    capped = default_run(smollm2, 2, gpu_memory_fraction=0.1, max_tokens_per_microbatch=2000)
    assert plan_memory(capped).learner_tokens == 2000
    with pytest.raises(ConfigError, match=r"a micro-batch of 16384 tokens \(train.max_tokens_per_microbatch=16384\)"):
        plan_memory(dataclasses.replace(capped, max_tokens_per_microbatch=16384))


def test_a_run_that_cannot_fit_names_the_figures_and_the_settings(smollm2):
    run = default_run(smollm2, 4, gpu_memory_fraction=0.05)
    with pytest.raises(ConfigError) as error:
        plan_memory(run)
    message = str(error.value)
    for setting in ("model.gpu_memory_fraction", "rollout.max_batch_size", "rollout.max_total_tokens",
                    "train.max_tokens_per_microbatch", "lora.rank", "train.gradient_checkpointing"):
        assert setting in message, setting
    assert f"model.gpu_memory_fraction >= {smallest_fraction(run):.2f} would fit it" in message
    assert "the smallest KV pool (8 slots of 529 tokens)" in message
    assert plan_memory(dataclasses.replace(run, gpu_memory_fraction=smallest_fraction(run))).kv_slots >= 8


def test_a_plan_larger_than_the_free_memory_is_an_error(smollm2):
    plan = plan_memory(default_run(smollm2))
    check_free(plan, plan.budget_bytes)
    with pytest.raises(ConfigError, match="GiB free now"):
        check_free(plan, plan.budget_bytes - 1)


# -- the config --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "1.5", "-0.1", "inf"])
def test_gpu_memory_fraction_outside_0_to_1_is_a_config_error(value):
    with pytest.raises(ConfigError, match=r"model.gpu_memory_fraction must be in \[0, 1\]"):
        load_config(None, [f"model.gpu_memory_fraction={value}"])


def test_gpu_memory_fraction_defaults_to_no_cap_and_may_change_on_resume():
    from ctxrl.train.checkpoint import config_differences

    config = load_config(None, [])
    assert config.model.gpu_memory_fraction == 0.0
    assert config_differences(config, load_config(None, ["model.gpu_memory_fraction=0.2"])) == []


def test_run_sizes_from_a_config(smollm2):
    config = load_config(None, ["model.dtype=bfloat16", "algo.kl_coef=0.01", "sft.enabled=false",
                                "rollout.max_batch_size=128"])
    run = RunSizes.from_config(config, smollm2, device_bytes=CARD, kv_tokens_per_slot=529, engine=True, critic=False)
    # 128 slots asked for, but at most max(8 tasks x 8 samples, 100 evaluation tasks) requests are in flight
    assert (run.kv_slots, run.dtype_bytes, run.float32_masters, run.reference) == (100, 2, True, True)
    follower = RunSizes.from_config(config, smollm2, device_bytes=CARD, kv_tokens_per_slot=529, engine=False,
                                    critic=False)
    assert (follower.kv_slots, follower.kv_tokens_per_slot) == (0, 0)
    assert plan_memory(follower).prefill_tokens == 0
    # rollout.max_batch_size = 0 (the default): the plan sizes the pool from every request in flight
    auto = RunSizes.from_config(load_config(None, ["sft.enabled=false"]), smollm2, device_bytes=CARD,
                                kv_tokens_per_slot=529, engine=True, critic=False, flat=True, card_share=0.5)
    assert (auto.kv_slots, auto.auto_slots, auto.flat, auto.card_share) == (100, True, True, 0.5)


def test_the_learner_gets_the_planned_tokens_unless_the_user_set_some(smollm2):
    config = load_config(None, [])
    plan = plan_memory(default_run(smollm2))
    # a quarter of the 80 GiB card for float32 activations of 1_850_112 bytes a token: 11_520 tokens (the learner's
    # budget is the plan's value, Run.micro_batch_tokens; the user's config is not changed)
    assert plan.learner_tokens == 20 * GIB // 1_850_112 // 256 * 256 == 11_520
    assert config.train.max_tokens_per_microbatch == 0
    assert learner_settings(config, plan.learner_tokens).micro_batch_tokens == 11_520
    kept = plan_memory(default_run(smollm2, max_tokens_per_microbatch=2000))
    assert kept.learner_tokens == 2000


def test_no_plan_on_the_cpu():
    from ctxrl.train.sizing import memory_plan

    assert memory_plan(load_config(None, []), "cpu", engine=True, critic=False) is None


def test_the_engine_holds_the_kv_pool_the_plan_counts(model):
    """The fast engine (on the CPU here) with the plan's slots and prefill chunk: its cache is the plan's bytes."""
    from ctxrl.engine.capacity import slot_capacity
    from ctxrl.engine.factory import make_engine

    engine = make_engine(model, kind="fast", pad_token_id=0, max_batch_size=3, seed=0, max_total_tokens=64,
                         prefill_tokens=100)
    shape = ModelShape.from_hf_config(model.config, sum(p.numel() for p in model.parameters()))
    assert engine.prefill_tokens == 100 and engine.capacity == slot_capacity(64) == 64 + 17
    assert engine.cache.nbytes == kv_pool_bytes(shape, 3, slot_capacity(64), 4)


def test_a_capped_run_turns_on_expandable_segments_unless_the_user_configured_the_allocator(monkeypatch):
    """Under a cap fragmentation counts against the run (issue 31's OOMs: 12% of the cap reserved but unallocated),
    so the trainer asks torch for expandable segments; a user's own PYTORCH_CUDA_ALLOC_CONF is left alone."""
    import torch

    from ctxrl.train.sizing import expandable_segments

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert expandable_segments() and calls == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert not expandable_segments() and calls == ["expandable_segments:True"]


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "nan", "half"])
def test_a_card_share_outside_0_to_1_is_a_config_error_naming_the_variable(monkeypatch, value):
    from ctxrl.train.sizing import card_share

    monkeypatch.setenv("CTXRL_GPU_SHARE", value)
    with pytest.raises(ConfigError, match=r"CTXRL_GPU_SHARE=.*must be a share of the card in \(0, 1\]"):
        card_share()


def test_the_card_share_is_read_from_the_environment(monkeypatch):
    from ctxrl.train.sizing import card_share

    monkeypatch.delenv("CTXRL_GPU_SHARE", raising=False)
    assert card_share() == 1.0
    monkeypatch.setenv("CTXRL_GPU_SHARE", "0.25")
    assert card_share() == 0.25


def test_the_plan_expects_the_flat_pass_only_where_it_can_run():
    from transformers import LlamaConfig, PretrainedConfig

    from ctxrl.train.sizing import expects_flat

    llama = LlamaConfig()
    assert expects_flat(load_config(None, ["model.dtype=bfloat16"]), llama)
    assert not expects_flat(load_config(None, []), llama)  # float32: HF's pass
    assert not expects_flat(load_config(None, ["model.dtype=bfloat16", "train.flat_forward=off"]), llama)
    assert not expects_flat(load_config(None, ["model.dtype=bfloat16", "lora.rank=8"]), llama)
    assert not expects_flat(load_config(None, ["model.dtype=bfloat16"]), PretrainedConfig())


def test_through_cuda_graphed_layers_the_learner_defaults_to_5k_tokens_and_counts_the_graphs_gradients(qwen05):
    from ctxrl.train.memory import GRAPHED_LEARNER_TOKENS, graph_bytes, optimizer_bytes

    run = default_run(qwen05, 2, flat=True, max_total_tokens=1024, device_bytes=141 * GIB)
    graphed = dataclasses.replace(run, graphed=True)
    assert plan_memory(run).learner_tokens == DEFAULT_LEARNER_TOKENS
    assert plan_memory(graphed).learner_tokens == GRAPHED_LEARNER_TOKENS == 5120
    # the graphs' own gradient of each layer's weights, in bf16: 24 x (896 x (896 + 2 x 128 + 896) + 3 x 896 x 4864
    # + 2 x 896) x 2 bytes
    per_layer = 896 * (896 + 2 * 128 + 896) + 3 * 896 * 4864 + 2 * 896
    assert graph_bytes(graphed) == 24 * per_layer * 2 and graph_bytes(run) == 0
    assert optimizer_bytes(graphed) - optimizer_bytes(run) == graph_bytes(graphed)
    # a user's budget is kept; a small card still bounds the default by the activation budget
    assert plan_memory(dataclasses.replace(graphed, max_tokens_per_microbatch=32768)).learner_tokens == 32768
    # each layer's graph also keeps a static input, output and output gradient: 3 x 24 x 896 x 2 bytes a token more
    assert activation_bytes_per_token(graphed) == 791_808 + 3 * 24 * 896 * 2 == 920_832
    small = dataclasses.replace(graphed, device_bytes=16 * GIB)  # 4 GiB of activations: 4,608 tokens
    assert plan_memory(small).learner_tokens == 4 * GIB // 920_832 // 256 * 256 == 4_608
    # under a cap the learner's tokens grow in a graph bucket's steps, so the padding the plan did not count is none
    from ctxrl.learner.layer_graphs import TOKEN_STEP
    from ctxrl.train.memory import GRAPH_TOKEN_STEP

    assert GRAPH_TOKEN_STEP == TOKEN_STEP
    capped = plan_memory(dataclasses.replace(graphed, gpu_memory_fraction=0.2, kv_slots=64))
    assert capped.learner_tokens % TOKEN_STEP == 0 and capped.learner_tokens > 8192


def test_the_plan_expects_graphed_layers_for_narrow_models_under_auto_and_for_graphed_without_checkpointing():
    from transformers import Qwen2Config

    from ctxrl.train.sizing import expects_graphs

    narrow, wide = Qwen2Config(hidden_size=896), Qwen2Config(hidden_size=1536)
    assert expects_graphs(load_config(None, []), narrow)  # auto, Qwen2.5-0.5B's width
    assert not expects_graphs(load_config(None, []), wide)  # auto, 1.5B's: eager, larger micro-batches
    assert not expects_graphs(load_config(None, []))  # (no width known: eager)
    assert expects_graphs(load_config(None, ["train.flat_forward=graphed"]), wide)
    assert not expects_graphs(load_config(None, ["train.flat_forward=on"]), narrow)
    assert not expects_graphs(load_config(None, ["train.gradient_checkpointing=true"]), narrow)
    config = load_config(None, ["model.dtype=bfloat16", "train.gradient_checkpointing=true"])
    from ctxrl.train.memory import ModelShape, RunSizes

    shape = ModelShape(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10, parameters=500)
    sizes = RunSizes.from_config(config, shape, device_bytes=GIB, kv_tokens_per_slot=16, engine=True, critic=False,
                                 flat=True, graphed=True)
    assert not sizes.graphed  # (checkpointing recomputes the layers: no graphs)
