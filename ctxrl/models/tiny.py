"""A tiny, real HF model for CPU work and tests: random-init Qwen2 + a locally trained BPE.

``build_tiny(spec)`` trains a byte-level BPE tokenizer with ``tokenizers`` on text from the
built-in environments, attaches the ChatML-with-tools template, initialises a small
``Qwen2ForCausalLM`` from a seed, pre-trains it briefly (a few hundred language-model steps on
plain-text transcripts of solved environment tasks, no chat format), and saves both with
``save_pretrained``. The pre-training stands in for what every real base model brings: the
ability to copy a number from its context. Without it a 1M-parameter model needs thousands of
supervised steps before induction ("copy") heads form, far beyond a CPU demo's budget. The result is an
ordinary HF checkpoint directory; ``ctxrl.models.loader`` loads it exactly like a Qwen or Llama
checkpoint, so the tiny model exercises the production code path.

Built models are cached under ``$CTXRL_CACHE`` (default ``~/.cache/ctxrl``) in a directory
named after a hash of the spec, written to a temporary directory and renamed into place so a
crash never leaves a half-written cache entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ctxrl.chat.template import CHATML_TOOLS_TEMPLATE, SPECIAL_TOKENS, TOOL_TOKENS

# Bump when the corpus, template or build recipe changes, so old caches are not reused.
TINY_RECIPE_VERSION = 6

QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model. Defaults train in minutes on 2 CPU cores."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    seed: int = 0
    pretrain_steps: int = 600
    """Language-model steps on plain-text environment transcripts (0 = leave the weights random)."""
    pretrain_batch_size: int = 64
    pretrain_lr: float = 3e-3

    def key(self) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "recipe": TINY_RECIPE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("CTXRL_CACHE", Path.home() / ".cache" / "ctxrl")).expanduser()


def tiny_path(spec: TinySpec | None = None, *, build: bool = True) -> Path:
    """Directory of the cached tiny checkpoint for ``spec``, building it on first use."""
    spec = spec or TinySpec()
    path = cache_root() / f"tiny-{spec.key()}"
    if build and not (path / "config.json").exists():
        build_tiny(spec, path)
    return path


def tokenizer_corpus(seed: int = 0) -> list[str]:
    """Text the tokenizer learns from: every built-in environment's prompts and dialogue."""
    from ctxrl.envs.registry import get_env_class, list_envs

    texts: list[str] = []
    for name in list_envs():
        env_cls = get_env_class(name)
        corpus = getattr(env_cls, "corpus", None)
        if corpus is not None:
            texts.extend(corpus(2000, seed))
    return texts


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Qwen2's pre-tokenizer: it splits digits one by one (numbers of any length stay copyable
    # token by token), and transformers' Qwen2 tokenizer class re-applies it on load anyway.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tiny(spec: TinySpec, path: Path) -> Path:
    """Build and save the tiny tokenizer + model at ``path`` (atomically)."""
    import torch
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from ctxrl.chat.toolcalls import format_tool_call

    corpus = tokenizer_corpus(spec.seed)
    # The template's own text, so that its fixed phrases become few tokens.
    texts = corpus + [CHATML_TOOLS_TEMPLATE, format_tool_call("calculator", {"expression": "1 + 2"})] * 50
    raw = _train_tokenizer(texts, spec.vocab_size - len(TOOL_TOKENS))
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE

    torch.manual_seed(spec.seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        use_sliding_window=False,
    )
    model = Qwen2ForCausalLM(config)
    if spec.pretrain_steps:
        pretrain(model, tokenizer, pretraining_sequences(tokenizer, corpus), spec)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "ctxrl_tiny.json").write_text(json.dumps(dataclasses.asdict(spec), indent=2))
        try:
            tmp.rename(path)
        except OSError:  # another process won the race; its copy is equally good
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def pretraining_sequences(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of the multi-line corpus texts (whole solved-task transcripts), each ending in pad.

    Plain text, no chat format: short sequences teach copying cheaply; the chat format and the
    system prompt with its tool list are left to the warm start.
    """
    return [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.pad_token_id] for t in texts if "\n" in t]


def pretrain(model, tokenizer, encoded: list[list[int]], spec: TinySpec) -> list[float]:
    """Causal-LM loss on every token of ``encoded`` (random batches, seeded); returns the losses."""
    import random

    import torch

    from ctxrl.train.learner import token_logprobs

    rng = random.Random(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.pretrain_lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, spec.pretrain_steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    losses = []
    model.train()
    for _ in range(spec.pretrain_steps):
        batch = rng.sample(encoded, min(spec.pretrain_batch_size, len(encoded)))
        width = max(len(x) for x in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, x in enumerate(batch):
            ids[row, : len(x)] = torch.tensor(x)
            mask[row, : len(x)] = 1
        logprobs = token_logprobs(model, ids, mask)
        target_mask = mask[:, 1:].float()
        loss = -(logprobs * target_mask).sum() / target_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    return losses
