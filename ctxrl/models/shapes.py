"""Random-init models with the shapes of real checkpoints, for benchmarks on machines without the weights.

Speed and memory depend on a model's shape, not its weights, so a ``Qwen2ForCausalLM`` built
from the Qwen2.5 configurations below measures what the real checkpoint would, and nothing is
downloaded. ``random_model("qwen2.5-7b", dtype, device)`` builds one directly on ``device``;
``save_random_checkpoint`` writes one to a directory with a word-level tokenizer and a ChatML template, so
that ``ctxrl train`` runs on it as on any local checkpoint (``benchmarks/train_step.py``).
"""

from __future__ import annotations

_QWEN25 = dict(max_position_embeddings=32768, rope_theta=1_000_000.0, use_sliding_window=False, pad_token_id=0,
               eos_token_id=1, bos_token_id=None)

SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, **_QWEN25),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, **_QWEN25),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, **_QWEN25),
    # a few-MB model of the same family, for smoke runs on a CPU
    "qwen2-test": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True, **_QWEN25),
}

_QWEN3_MOE = dict(max_position_embeddings=40960, rope_theta=1_000_000.0, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], router_aux_loss_coef=0.001, tie_word_embeddings=False, pad_token_id=0,
                  eos_token_id=1, bos_token_id=None)

MOE_SHAPES: dict[str, dict] = {
    # Qwen3-30B-A3B: 128 experts, 8 of them per token (about 3B parameters active of 30B)
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, vocab_size=151936, **_QWEN3_MOE),
    # a micro model of the same architecture, for CPU tests: 4 experts, 2 per token
    "qwen3-moe-test": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                           num_experts_per_tok=2, vocab_size=4096, **_QWEN3_MOE),
}
"""Mixture-of-experts shapes (``Qwen3MoeForCausalLM``); ``random_model`` builds them as it does ``SHAPES``."""


def random_model(shape: str, dtype, device: str = "cpu", *, seed: int = 0):
    """A random-init ``Qwen2ForCausalLM`` of ``SHAPES[shape]`` (or ``Qwen3MoeForCausalLM`` of
    ``MOE_SHAPES[shape]``), built in ``dtype`` on ``device``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if shape not in SHAPES and shape not in MOE_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join([*SHAPES, *MOE_SHAPES])}")
    torch.manual_seed(seed)
    if shape in MOE_SHAPES:
        config, model_class = Qwen3MoeConfig(**MOE_SHAPES[shape]), Qwen3MoeForCausalLM
    else:
        config, model_class = Qwen2Config(**SHAPES[shape]), Qwen2ForCausalLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype: a 7B model never exists in float32
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    return model



PAD, EOS, UNK = 0, 1, 2
"""The shapes' pad and eos ids (``_QWEN25``), and the word tokenizer's unknown word."""
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
BENCH_WORDS = tuple(a + b for a in _SYLLABLES[:32] for b in _SYLLABLES[:32])
"""The words a random checkpoint's tokenizer holds as single tokens (``save_random_checkpoint``): prompts built
from them have one token a word, so their length in tokens is known without the tokenizer."""


def word_tokenizer(vocab: int):
    """A word-level tokenizer whose token ``t<i>`` is id ``i`` (0 pad, 1 eos, 2 unknown): ids -> text -> ids
    exactly, so a random model's samples round-trip (TRL's side of ``benchmarks/grpo_step.py``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<eos>": EOS, "<unk>": UNK, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left")


def save_random_checkpoint(shape: str, directory, *, dtype: str = "bfloat16", seed: int = 0):
    """Write a random-init model of ``SHAPES[shape]`` (in ``dtype``) to ``directory`` with the tiny model's kind of
    tokenizer (a byte-level BPE in Qwen2's layout, ChatML with tools, ``<|im_end|>`` its eos) trained on
    ``BENCH_WORDS``, once: a directory that already holds both is kept. Returns its path. The model's vocabulary
    is the shape's; the tokenizer's is smaller, and what a random policy samples past it decodes to nothing."""
    from pathlib import Path

    import torch

    from ctxrl.models.tiny import TinySpec, make_tokenizer

    path = Path(directory)
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    model = random_model(shape, getattr(torch, dtype), "cpu", seed=seed)
    words = " ".join(BENCH_WORDS)
    tokenizer = make_tokenizer(TinySpec(arch="qwen2", vocab_size=2048), [words] * 4)
    for config in (model.config, model.generation_config):
        config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path
