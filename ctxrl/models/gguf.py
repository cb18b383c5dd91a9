"""GGUF files as ordinary checkpoints: converted once to a cached safetensors directory.

``model.name = "path/to/model.gguf"`` (or a named model that ships as GGUF, ``ctxrl.models.named``)
resolves to ``$CTXRL_CACHE/gguf/<sha256 prefix>/``: a float32 safetensors checkpoint with its config,
generation config and tokenizer. Every later load reads that directory through the same
``from_pretrained`` calls as a hub checkpoint, so the engine, learner, LoRA, ``merge`` and ``serve`` see
no difference. The key is the file's content hash: a file that changes converts again; two paths to
the same bytes share one entry. Conversion writes into a temporary directory and renames it into
place, so an interrupted conversion never leaves a half-written entry.

What the conversion does, and why:

- **Weights.** transformers reads the GGUF (any architecture it supports) and dequantises every
  tensor; the cache keeps them in float32, which holds a Q4/Q8 block's ``scale * q + min`` exactly,
  so the cache is the GGUF's own values. ``model.dtype`` casts them at load time like any
  checkpoint (bf16 rounds them; that is said once, at conversion). transformers refuses to save a
  model it loaded from GGUF, so the tensors are moved into a model built from the same config
  without its ``quantization_config`` and saved from there.
- **Special tokens.** Some transformers releases convert a GGUF's tokenizer with the wrong
  special tokens (5.17 gives SmolLM2's tokenizer ``eos_token = "<|im_start|>"``; 5.24 gets
  ``<|im_end|>``). An end-of-turn token that is really a start-of-turn token breaks everything
  downstream in confusing ways (the prefix check reports history rewriting). So the tokenizer's
  bos / eos / unk / pad ids are checked against the GGUF's own metadata
  (``tokenizer.ggml.*_token_id``) and corrected where they differ; each correction is printed and
  kept in ``ctxrl_gguf.json`` beside the checkpoint.
- **Vocabulary.** transformers 5.17 turns Gemma 3's SentencePiece BPE vocabulary into a Unigram model that
  splits every word into characters; such a tokenizer is rebuilt as the BPE model the vocabulary implies
  (``ctxrl.models.gguf_vocab``), and the rebuild is listed with the fixes.

What it does not do: keep the weights quantised (ctxrl trains them), or read GGUF files
transformers cannot read (its list of architectures is the limit; the error says so).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctxrl.errors import CtxrlError
from ctxrl.models.cache import cache_root, file_sha256
from ctxrl.models.gguf_vocab import repair as repair_vocabulary

MANIFEST = "ctxrl_gguf.json"
# Bump when the conversion changes what it writes, so that old entries are converted again.
CONVERSION_VERSION = 2  # 2: SentencePiece vocabularies converted to a degenerate Unigram model are rebuilt
SPECIAL_TOKEN_KEYS = {  # tokenizer attribute -> the GGUF metadata key that says its id
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
Progress = Callable[[str, int, int], None]


class GGUFError(CtxrlError, RuntimeError):
    """A GGUF file could not be converted; the message says why and what to do."""

    kind = "model error"


def is_gguf(name: str) -> bool:
    """Whether ``model.name`` names a GGUF file (by its suffix)."""
    return name.lower().endswith(".gguf")


def require_gguf_support() -> None:
    """A clear error when the packages transformers reads GGUF with are missing."""
    import importlib.util

    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise GGUFError(f"reading GGUF files needs the {' and '.join(missing)} package(s), which are not installed: "
                        "pip install -e '.[gguf]'")


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The GGUF's scalar and string metadata (token lists and merges left out) and its tensor types."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith(("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                           "tokenizer.ggml.scores")):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - a field this gguf release cannot decode is not needed
            continue
    meta["_tensor_types"] = dict(Counter(t.tensor_type.name for t in reader.tensors))
    return meta


def fix_special_tokens(tokenizer, metadata: dict[str, Any]) -> list[str]:
    """Set the tokenizer's bos / eos / unk / pad to the tokens the GGUF metadata names; say what changed.

    Returns one sentence per correction (empty when the tokenizer already agrees). An id outside the
    vocabulary is left alone: the metadata is then the one in doubt.
    """
    fixes = []
    vocab = len(tokenizer)
    for attr, key in SPECIAL_TOKEN_KEYS.items():
        want = metadata.get(key)
        if not isinstance(want, int) or not 0 <= want < vocab:
            continue
        have = getattr(tokenizer, f"{attr}_id", None)
        if have == want:
            continue
        token = tokenizer.convert_ids_to_tokens(want)
        old = getattr(tokenizer, attr, None)
        setattr(tokenizer, attr, token)
        fixes.append(f"{attr} {old!r} (id {have}) -> {token!r} (id {want}), as the GGUF's {key} says")
    return fixes


def convert(path: str | Path, *, sha256: str | None = None, on_progress: Progress | None = None,
            chat_template: str | None = None, end_tokens: tuple[str, ...] = ()) -> Path:
    """The cached checkpoint directory of the GGUF file ``path``, converting it the first time (``sha256``: the
    file's hash, when the caller has it already). ``chat_template``: the template to save where the file has
    none; ``end_tokens``: tokens that also end the model's turn (added to its generation config's eos ids). Either
    makes a cache entry of its own."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist")
    sha = sha256 or file_sha256(path)
    target = cache_root() / "gguf" / (sha[:16] + _supplied_key(chat_template, end_tokens))
    if _complete(target):
        return target
    require_gguf_support()
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        info = _convert_into(path, tmp, sha, on_progress, chat_template=chat_template, end_tokens=end_tokens)
        # Several runs started together may convert the same file at once: the first rename wins, the others
        # find a complete entry and drop their own copy. A damaged entry (no manifest) is replaced.
        if not _complete(target):
            shutil.rmtree(target, ignore_errors=True)
            try:
                os.replace(tmp, target)
            except OSError:
                if not _complete(target):
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if info["fixes"]:
        print(f"ctxrl: corrected the tokenizer of {path.name}: " + "; ".join(info["fixes"]), file=sys.stderr)
    return target


def _supplied_key(chat_template: str | None, end_tokens: tuple[str, ...]) -> str:
    """The cache entry's suffix: none for a plain conversion, else "-" and 8 hex digits of what ctxrl supplies
    (a changed template converts anew)."""
    if not chat_template and not end_tokens:
        return ""
    return "-" + hashlib.sha256("\0".join([chat_template or "", *end_tokens]).encode()).hexdigest()[:8]


def _complete(target: Path) -> bool:
    """Whether ``target`` is a finished conversion of the current version."""
    try:
        return json.loads((target / MANIFEST).read_text()).get("conversion") == CONVERSION_VERSION
    except (OSError, ValueError):
        return False


def _say(on_progress: Progress | None, stage: str, done: int, total: int, line: str) -> None:
    if on_progress is not None:
        on_progress(stage, done, total)
    elif done == 0:
        print(f"ctxrl: {line}", file=sys.stderr, flush=True)


def _convert_into(path: Path, out: Path, sha: str, on_progress: Progress | None, *, chat_template: str | None = None,
                  end_tokens: tuple[str, ...] = ()) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ctxrl.models.hf_logging import quiet_transformers

    quiet_transformers()
    stage = f"converting {path.name} (GGUF, dequantised to float32, once)"
    try:
        metadata = gguf_metadata(path)
    except Exception as exc:  # noqa: BLE001 - the reader's own errors are terse ("GGUF magic invalid")
        raise GGUFError(f"{str(path)!r} is not a GGUF file the gguf package can read ({exc}); pass a .gguf model "
                        "file, or a checkpoint directory") from exc
    _say(on_progress, stage, 0, 3, f"{stage} into {out.with_name(sha[:16])}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        _say(on_progress, stage, 1, 3, "")
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - re-raised with what to do
        arch = metadata.get("general.architecture", "?")
        raise GGUFError(f"transformers {transformers.__version__} could not read {str(path)!r} (architecture "
                        f"{arch!r}): {exc}. transformers reads GGUF files of the architectures it lists in "
                        "GGUF_SUPPORTED_ARCHITECTURES; convert other files to a safetensors checkpoint first") from exc
    _say(on_progress, stage, 2, 3, "")
    tokenizer, rebuilt = repair_vocabulary(tokenizer, path, metadata)
    fixes, supplied, end_ids = _complete_tokenizer(tokenizer, metadata, path, chat_template, end_tokens)
    fixes = rebuilt + fixes
    model = _savable(loaded, tokenizer, end_ids)
    out.mkdir(parents=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    info = {
        "conversion": CONVERSION_VERSION,
        "source": str(path.resolve()),
        "sha256": sha,
        "bytes": path.stat().st_size,
        "transformers": transformers.__version__,
        "dtype": "float32",
        "architecture": metadata.get("general.architecture"),
        "name": metadata.get("general.name"),
        "tensor_types": metadata["_tensor_types"],
        "fixes": fixes,
        "chat_template": "supplied by ctxrl" if supplied else ("from the file" if tokenizer.chat_template else None),
        "end_tokens": dict(zip(end_tokens, end_ids)),
    }
    (out / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
    _say(on_progress, stage, 3, 3, "")
    return info


def _complete_tokenizer(tokenizer, metadata: dict[str, Any], path: Path, chat_template: str | None,
                        end_tokens: tuple[str, ...]) -> tuple[list[str], bool, list[int]]:
    """Special tokens fixed from the metadata, the file's template (or ``chat_template`` where it has none), and the
    ids of ``end_tokens``: (the fixes made, whether the template is ctxrl's, those ids)."""
    fixes = fix_special_tokens(tokenizer, metadata)
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    supplied = bool(chat_template) and not getattr(tokenizer, "chat_template", None)
    if supplied:
        tokenizer.chat_template = chat_template
    return fixes, supplied, [_token_id(tokenizer, token, path) for token in end_tokens]


def _savable(loaded, tokenizer, end_ids: list[int]):
    """transformers will not save a model it loaded from GGUF: the same model rebuilt from its config without the
    quantization record, the (already dequantised) tensors moved in, its generation config ending at the tokenizer's
    eos and ``end_ids``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.generation_config = copy.deepcopy(loaded.generation_config)
    if tokenizer.eos_token_id is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.config.eos_token_id = tokenizer.eos_token_id
    if end_ids:  # generation stops on any of them (ctxrl.models.loader.generation_end_ids)
        first = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        model.generation_config.eos_token_id = list(dict.fromkeys([*first, *end_ids]))
    if tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _token_id(tokenizer, token: str, path: Path) -> int:
    """The id of ``token``, which must be one token of the file's vocabulary."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise GGUFError(f"{token!r} is not one token of {path.name}'s vocabulary (it encodes to {ids}), so it cannot "
                        "end the model's turns")
    return ids[0]

