"""A tiny, real HF model for CPU work and tests: a random-init Llama or Qwen2 + a locally trained BPE.

This module holds its shape (``TinySpec``), where its cache lives and the pieces it is made of; building it is
a stage above the library (``ctxrl.train.tiny``), since its text comes from the environments' demonstrations.
``build_tiny(spec)`` there trains a byte-level BPE tokenizer with ``tokenizers`` on text from the
built-in environments, attaches the ChatML-with-tools template, initialises a small
``LlamaForCausalLM`` (``arch="llama"``, the default) or ``Qwen2ForCausalLM`` (``arch="qwen2"``)
from a seed, pre-trains it briefly (a few hundred language-model steps on freshly drawn solved
environment tasks, as plain-text transcripts and as whole chat episodes), and saves both with
``save_pretrained``. The pre-training stands in for what every real base model brings: the
ability to copy a number from its context. Without it a 1M-parameter model needs thousands of
supervised steps before induction ("copy") heads form, far beyond a CPU demo's budget. The
result is an ordinary HF checkpoint directory; ``ctxrl.models.loader`` loads it exactly like a
Qwen or Llama checkpoint, so the tiny model exercises the production code path.

Why Llama by default: the two architectures pre-tokenize numbers differently, and
transformers enforces each one's rule on load (for ``model_type == "qwen2"`` it rebuilds the
tokenizer as ``Qwen2Tokenizer``, which splits every digit). A Llama-3-style tokenizer
(``tokenizer_class`` ``PreTrainedTokenizerFast``, byte-level BPE, digits grouped in runs of up
to three) makes every number below 1000 one token, so copying a number is copying one token.
At the same 600 pre-training steps that took held-out transcription ("What is 37 plus 58?" ->
``37 + 58``) from 0.65 (Qwen2, one digit per token) to 0.92 (see
``benchmarks/tiny_skills.py``).

Built models are cached under ``$CTXRL_CACHE`` (default ``~/.cache/ctxrl``) in a directory
named after a hash of the spec, written to a temporary directory and renamed into place so a
crash never leaves a half-written cache entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ctxrl.chat.template import CHATML_TOOLS_TEMPLATE, SPECIAL_TOKENS, TOOL_TOKENS
from ctxrl.models.cache import cache_root

# Bump when the corpus, template or build recipe changes, so old caches are not reused.
TINY_RECIPE_VERSION = 9
# The environments whose text the tokenizer learns and the model pre-trains on by default. A fixed
# list, so the tiny model does not change when an environment (or a third-party package's) is
# added; other sets are chosen per spec (``TinySpec.envs``).
PRETRAIN_ENVS = ("calculator",)
# Bump when pre-training on other environments changes (their key only: the default model's stays).
# 3: fact_hunt's code leads its page; 4: search_join's solutions write names after a space
OTHER_ENVS_RECIPE_VERSION = 4

# Qwen2's pre-tokenizer splits digits one by one; Llama 3's groups them in runs of up to three.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PRETOKENIZE_REGEX = QWEN2_PRETOKENIZE_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model. Defaults train in minutes on 2 CPU cores."""

    arch: str = "llama"
    """``llama`` (Llama-3-style tokenizer: numbers below 1000 are one token) or ``qwen2`` (one digit per token)."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    vocab_size: int = 2048
    max_position_embeddings: int = 2048
    seed: int = 0
    pretrain_steps: int = 600
    """Language-model steps on fresh solved-task transcripts, plain and chat batches alternating
    (0 = random weights)."""
    pretrain_batch_size: int = 64
    """Sequences per plain-text pre-training batch."""
    pretrain_chat_batch_size: int = 64
    """Episodes per chat pre-training batch (0 = ``pretrain_batch_size``); chat episodes are ~3x longer."""
    pretrain_lr: float = 3e-3
    envs: str = "+".join(PRETRAIN_ENVS)
    """Environments (joined by ``+``) whose solved tasks the model pre-trains on, e.g. ``calculator+search_qa``."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"tiny arch must be one of {', '.join(ARCHITECTURES)}, not {self.arch!r}")

    def env_names(self) -> tuple[str, ...]:
        return tuple(e for e in self.envs.split("+") if e)

    def key(self) -> str:
        fields = dataclasses.asdict(self)
        if fields["envs"] == "+".join(PRETRAIN_ENVS):
            del fields["envs"]  # the default set keeps the key (and the caches) it had before the field
        else:
            fields["envs_recipe"] = OTHER_ENVS_RECIPE_VERSION
        blob = json.dumps({**fields, "recipe": TINY_RECIPE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


Progress = Callable[[str, int, int], None]
"""``on_progress(stage, done, total)``: a build's progress (``total`` 0 when it cannot be known)."""


def tiny_path(spec: TinySpec | None = None) -> Path:
    """Directory of the cached tiny checkpoint for ``spec`` (built or not: ``is_built``; ``ctxrl.train.tiny``
    builds it)."""
    spec = spec or TinySpec()
    return cache_root() / f"tiny-{spec.key()}"


def tokenizer_twin(spec: TinySpec) -> TinySpec:
    """The cheapest spec with ``spec``'s tokenizer, to measure token counts without pre-training a
    large model: the tokenizer depends only on ``arch``, ``vocab_size``, ``seed``, ``envs`` and
    ``max_position_embeddings``, so the default shape with no pre-training steps builds it in seconds."""
    defaults = TinySpec()
    return dataclasses.replace(spec, hidden_size=defaults.hidden_size, num_layers=defaults.num_layers,
                               num_heads=defaults.num_heads, num_kv_heads=defaults.num_kv_heads,
                               intermediate_size=defaults.intermediate_size, pretrain_steps=0)


def is_built(spec: TinySpec) -> bool:
    """Whether the cache already holds ``spec``'s checkpoint."""
    return (cache_root() / f"tiny-{spec.key()}" / "config.json").exists()




def _train_tokenizer(texts: list[str], vocab_size: int, arch: str = "llama"):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    regex = LLAMA3_PRETOKENIZE_REGEX if arch == "llama" else QWEN2_PRETOKENIZE_REGEX
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
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



def make_tokenizer(spec: TinySpec, texts: list[str]):
    """A BPE trained on ``texts`` with the tool tokens added and the ChatML-with-tools template, as an HF
    tokenizer."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    raw = _train_tokenizer(texts, spec.vocab_size - len(TOOL_TOKENS), spec.arch)
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
    return tokenizer


def init_model(spec: TinySpec, tokenizer):
    """A ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` of ``spec``'s shape, initialised from ``spec.seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(spec.seed)
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if spec.arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    extra = {"use_sliding_window": False} if spec.arch == "qwen2" else {}
    config = config_cls(
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
        **extra,
    )
    return model_cls(config)



def save_atomically(path: Path, spec: TinySpec, tokenizer, model, losses: list[float]) -> None:
    """Tokenizer, model and ``ctxrl_tiny.json`` written to a temporary directory, then renamed to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        tokenizer.save_pretrained(tmp)
        if spec.arch == "llama":  # as in Llama 3 checkpoints: keep tokenizer.json's own pre-tokenizer
            _set_tokenizer_class(tmp, "PreTrainedTokenizerFast")
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "ctxrl_tiny.json").write_text(json.dumps({**dataclasses.asdict(spec), **pretraining_record(losses)},
                                                        indent=2))
        try:
            tmp.rename(path)
        except OSError:  # another process won the race; its copy is equally good
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def pretraining_record(losses: list[float], window: int = 10) -> dict:
    """How pre-training went, saved beside the spec in ``ctxrl_tiny.json``: the mean loss of the first and
    the last ``window`` steps. Builds of one spec differ (GPU pre-training is not reproducible), and a
    build whose loss barely fell is one to rebuild rather than to train on (docs/experiments/context.md)."""
    if not losses:
        return {}
    head, tail = losses[:window], losses[-window:]
    return {"pretraining_loss": {"steps": len(losses), "first": sum(head) / len(head), "last": sum(tail) / len(tail)}}


def _set_tokenizer_class(path: Path, name: str) -> None:
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = name
    config_path.write_text(json.dumps(config, indent=2))
