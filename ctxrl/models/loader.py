"""Load a policy and its tokenizer by HF hub name or local path, with errors that say what to do.

``"tiny"`` (or ``"tiny:hidden_size=192,num_layers=6"``) names the locally built tiny model; it
resolves to a cached checkpoint directory and then goes through the same ``from_pretrained``
calls as ``Qwen/Qwen2.5-0.5B-Instruct`` or ``/path/to/llama``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ctxrl.errors import CtxrlError
from ctxrl.models.tiny import TinySpec, tiny_path

DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class ModelLoadError(CtxrlError, RuntimeError):
    """A model or tokenizer could not be loaded; the message says why and how to fix it."""

    kind = "model error"


def parse_tiny(name: str) -> TinySpec | None:
    """``tiny`` or ``tiny:field=value,...`` -> a ``TinySpec``; anything else -> None."""
    if name != "tiny" and not name.startswith("tiny:"):
        return None
    fields = {f.name: f.default for f in dataclasses.fields(TinySpec)}
    kwargs = {}
    for part in filter(None, name.partition(":")[2].split(",")):
        key, _, value = part.partition("=")
        if key not in fields:
            raise ModelLoadError(f"unknown tiny-model field {key!r} in {name!r}; valid: {sorted(fields)}")
        try:
            kwargs[key] = type(fields[key])(value)
        except ValueError:
            raise ModelLoadError(f"tiny-model field {key!r} in {name!r} must be a "
                                 f"{type(fields[key]).__name__}, got {value!r}") from None
    try:
        return TinySpec(**kwargs)
    except ValueError as exc:
        raise ModelLoadError(f"bad tiny-model spec {name!r}: {exc}") from None


def resolve(name_or_path: str, *, on_progress=None) -> str:
    """Map ``tiny`` to its cached directory (building it the first time: ``on_progress(stage, done, total)``
    hears how far it is) and check that a local path holds weights."""
    spec = parse_tiny(name_or_path)
    if spec is not None:
        return str(tiny_path(spec, on_progress=on_progress))
    path = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith((".", "/", "~")) or path.exists()
    if looks_local:
        if not path.exists():
            raise ModelLoadError(f"model path {name_or_path!r} does not exist; pass a checkpoint "
                                 "directory, a hub name such as 'Qwen/Qwen2.5-0.5B-Instruct', or 'tiny'")
        if path.is_dir() and not any((path / f).exists() for f in WEIGHT_FILES):
            raise ModelLoadError(f"{name_or_path!r} has no model weights (looked for {', '.join(WEIGHT_FILES)}); "
                                 "save the model with save_pretrained() or point at the directory that has them")
        return str(path)
    return name_or_path


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``; a CUDA device without CUDA is a clear error."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"model.device={name!r} but CUDA is not available; use model.device=cpu")
    return name


def _quiet_transformers() -> None:
    """ctxrl draws its own progress bars; silence transformers' per-file ones."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def load_tokenizer(name_or_path: str, *, chat_template: str | None = None):
    """Load a tokenizer; it must have a chat template (or ``chat_template`` must give one)."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    resolved = resolve(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved)
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise ModelLoadError(f"could not load the tokenizer of {name_or_path!r}: {exc}") from exc
    if chat_template:
        tokenizer.chat_template = Path(chat_template).read_text() if Path(chat_template).exists() else chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"the tokenizer of {name_or_path!r} has no chat template; ctxrl renders "
                             "conversations with it. Use an instruct/chat checkpoint or set "
                             "model.chat_template to a Jinja file")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name_or_path: str, *, dtype: str = "float32", device: str = "cpu"):
    """Load a causal LM for training and generation on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    resolved = resolve(name_or_path)
    if dtype not in DTYPES:
        raise ModelLoadError(f"model.dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    torch_dtype = getattr(torch, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(resolved, dtype=torch_dtype)
    except TypeError:  # transformers < 4.56 calls it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(resolved, torch_dtype=torch_dtype)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"could not load model {name_or_path!r}: {exc}") from exc
    return model.to(device)
