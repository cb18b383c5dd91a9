"""Random-init models with the shapes of real checkpoints, for benchmarks on machines without the weights.

Speed and memory depend on a model's shape, not its weights, so a ``Qwen2ForCausalLM`` built
from the Qwen2.5 configurations below measures what the real checkpoint would, and nothing is
downloaded. ``random_model("qwen2.5-7b", dtype, device)`` builds one directly on ``device``.
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


def random_model(shape: str, dtype, device: str = "cpu", *, seed: int = 0):
    """A random-init ``Qwen2ForCausalLM`` of ``SHAPES[shape]``, built in ``dtype`` on ``device``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    torch.manual_seed(seed)
    config = Qwen2Config(**SHAPES[shape])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype: a 7B model never exists in float32
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model
