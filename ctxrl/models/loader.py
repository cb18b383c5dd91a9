"""Load a policy and its tokenizer by HF hub name or local path, with errors that say what to do.

``"tiny"`` (or ``"tiny:hidden_size=192,num_layers=6"``) names the locally built tiny model (built by
``ctxrl.train.tiny``), a named
real model (``smollm2-135m-instruct``, ``ctxrl.models.named``) the GGUF file a Python package ships,
and ``path/to/model.gguf`` a GGUF file (``ctxrl.models.gguf``). Each resolves to a cached checkpoint
directory and then goes through the same ``from_pretrained`` calls as ``Qwen/Qwen2.5-0.5B-Instruct``
or ``/path/to/llama``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ctxrl.errors import CtxrlError
from ctxrl.models.cache import file_sha256
from ctxrl.models.gguf import convert as convert_gguf
from ctxrl.models.gguf import is_gguf, require_gguf_support
from ctxrl.models.hf_logging import quiet_transformers
from ctxrl.models.named import NAMED_MODELS, check_named_file, chunk_files, named_file, named_model
from ctxrl.models.tiny import TinySpec, is_built, tiny_path

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
    """Map ``tiny``, a named model or a ``.gguf`` file to its cached directory (converting a GGUF file the first
    time: ``on_progress(stage, done, total)`` hears how far it is) and check that a local path holds weights.

    A tiny model is built by a stage above the library (``ctxrl.models.prepare.prepare``, which every command runs
    first); one that is not built yet is refused here with that fix."""
    spec = parse_tiny(name_or_path)
    if spec is not None:
        if not is_built(spec):
            raise ModelLoadError(f"the tiny model {name_or_path!r} is not built yet: build it with "
                                 f"ctxrl.models.prepare.prepare({name_or_path!r}) (ctxrl train, demo, eval and "
                                 "serve build it first), or run `ctxrl demo` once")
        return str(tiny_path(spec))
    named = named_model(name_or_path)
    if named is not None:
        path = named_file(named)
        sha = file_sha256(path)
        if sha != named.sha256 and named.parts:  # a damaged copy in the cache: join the chunks again
            path.unlink()
            path = named_file(named)
            sha = file_sha256(path)
        check_named_file(named, sha, path)
        return str(convert_gguf(path, sha256=sha, on_progress=on_progress, chat_template=named.chat_template or None,
                                end_tokens=named.end_tokens))
    if is_gguf(name_or_path):  # (a missing file is convert's error)
        return str(convert_gguf(name_or_path, on_progress=on_progress))
    path = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith((".", "/", "~")) or path.exists()
    if looks_local:
        if not path.exists():
            raise ModelLoadError(f"model path {name_or_path!r} does not exist; pass a checkpoint directory, a .gguf "
                                 "file, a hub name such as 'Qwen/Qwen2.5-0.5B-Instruct', 'tiny', or a named model "
                                 f"({', '.join(NAMED_MODELS)})")
        if path.is_dir() and not any((path / f).exists() for f in (*WEIGHT_FILES, "adapter_config.json")):
            raise ModelLoadError(f"{name_or_path!r} has no model weights (looked for {', '.join(WEIGHT_FILES)}); "
                                 "save the model with save_pretrained() or point at the directory that has them")
        return str(path)
    return name_or_path


def resolves_to_cache(name: str) -> bool:
    """Whether ``name`` is one ctxrl resolves to a directory of its own cache (``tiny``, a named real model, a
    ``.gguf`` file) rather than a hub name or a checkpoint directory of the user's."""
    return parse_tiny(name) is not None or named_model(name) is not None or is_gguf(name)


def check_available(name_or_path: str) -> None:
    """What ``resolve`` would refuse, found without building, converting or loading anything: a named model
    whose package is missing, a GGUF file that does not exist or cannot be read here, a local path without
    weights (``ctxrl config`` and the checks that run before a model loads)."""
    if parse_tiny(name_or_path) is not None:
        return
    named = named_model(name_or_path)
    if named is not None:
        if named.parts:
            chunk_files(named)  # (the chunks are joined only when the model is resolved)
        else:
            named_file(named)
        require_gguf_support()
        return
    if is_gguf(name_or_path):
        if not Path(name_or_path).expanduser().is_file():
            raise ModelLoadError(f"GGUF file {name_or_path!r} does not exist")
        require_gguf_support()
        return
    if resolve(name_or_path) == name_or_path and not Path(name_or_path).expanduser().exists():
        if looks_like_path(name_or_path):
            raise ModelLoadError(missing_path_message(name_or_path))
        check_hub_model(name_or_path)


def looks_like_path(name: str) -> bool:
    """Whether ``name`` can only mean a local path: absolute, ``./`` or ``~``, more than one ``/`` (a hub name is
    ``org/model``), or under a directory that exists here (``runs/calc``)."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name:
        return True
    return "/" in name and Path(name.partition("/")[0]).is_dir()


def missing_path_message(name: str) -> str:
    """A local path that does not exist, with the checkpoints found near it (a typo is usually one of them)."""
    found = nearby_checkpoints(Path(name).expanduser())
    listing = (" Checkpoints near it: " + ", ".join(map(str, found[:8])) + (" ..." if len(found) > 8 else "")
               if found else " No checkpoint directory is near it.")
    return f"{name} does not exist (no file or directory there).{listing}"


def nearby_checkpoints(path: Path, depth: int = 3) -> list[Path]:
    """Checkpoint directories (a ``config.json`` or ``adapter_config.json`` in them) within ``depth`` levels of
    the nearest existing folder above ``path``, nearest first (``runs/calc/checkpoints/fnal``: ``final`` and
    ``step-000040`` of ``runs/calc/checkpoints``)."""
    base = path.parent
    while not base.is_dir() and base != base.parent:
        base = base.parent
    if base.resolve() in (Path("/"), Path.home()):  # (not a search of the whole disk for a mistyped absolute path)
        return []
    levels = [[base]] + [sorted(base.glob("/".join(["*"] * level))) for level in range(1, depth + 1)]
    return [candidate for level in levels for candidate in level
            if (candidate / "config.json").is_file() or (candidate / "adapter_config.json").is_file()]


def check_hub_model(name: str) -> None:
    """A hub name that is neither in the local HF cache nor on the hub is an error in well under a second.

    ``from_pretrained`` retries an unreachable hub with backoff (about a minute) before it fails; one
    ``model_info`` call does not retry, so a typo or a machine without network is told at once."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    others = f"a checkpoint directory, a .gguf file, 'tiny' or a named model ({', '.join(NAMED_MODELS)})"
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return  # downloaded before: from_pretrained finds it (HF_HUB_OFFLINE=1 skips the hub altogether)
    except HFValidationError as exc:
        raise ModelLoadError(f"model {name!r} is not a local path (nothing is there) nor a hub name ({exc}); pass "
                             f"{others}") from None
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"model {name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                             f"download it first (hf download {name}) or pass {others}")
    try:
        HfApi().model_info(name, timeout=10)
    except GatedRepoError:
        return  # it exists; loading it says what access it needs
    except RepositoryNotFoundError:
        raise ModelLoadError(f"no model {name!r} on the Hugging Face hub (nor in the local cache, nor a local path); "
                             f"check the name, log in for a private model (hf auth login), or pass {others}") from None
    except Exception as exc:  # noqa: BLE001 - a network error, whatever the HTTP library calls it
        raise ModelLoadError(f"model {name!r} is not in the local Hugging Face cache and the hub cannot be reached "
                             f"({exc}); download it where there is network (hf download {name}) or pass "
                             f"{others}") from None


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``; a CUDA device without CUDA is a clear error."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"model.device={name!r} but CUDA is not available; use model.device=cpu")
    return name


def load_tokenizer(name_or_path: str, *, chat_template: str | None = None):
    """Load a tokenizer; it must have a chat template (or ``chat_template`` must give one)."""
    from transformers import AutoTokenizer

    quiet_transformers()
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


def generation_end_ids(name_or_path: str) -> list[int]:
    """Every ``eos_token_id`` of the model's ``generation_config.json`` (one id or a list); [] when it has none.

    Chat models often list several (Llama 3.1: ``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``; Qwen2.5:
    ``<|im_end|>``, ``<|endoftext|>``): generation must stop on any of them, not only the tokenizer's eos.
    """
    from transformers import GenerationConfig

    quiet_transformers()
    try:
        config = GenerationConfig.from_pretrained(resolve(name_or_path))
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's eos is the only end
        return []
    ids = config.eos_token_id
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


def load_model(name_or_path: str, *, dtype: str = "float32", device: str = "cpu"):
    """Load a causal LM for training and generation on ``device``.

    A directory of LoRA adapters (``adapter_config.json``, what a LoRA run saves) loads as its base
    with the adapters merged in: a plain model to evaluate or serve.
    """
    import torch
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    resolved = resolve(name_or_path)
    if dtype not in DTYPES:
        raise ModelLoadError(f"model.dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if (Path(resolved) / "adapter_config.json").exists():
        return load_adapters(resolved, dtype=dtype, device=device)
    torch_dtype = getattr(torch, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(resolved, dtype=torch_dtype)
    except TypeError:  # transformers < 4.56 calls it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(resolved, torch_dtype=torch_dtype)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"could not load model {name_or_path!r}: {exc}") from exc
    return model.to(device)


def adapter_base(path: str | Path) -> str | None:
    """The base a directory of LoRA adapters names (``adapter_config.json``'s ``base_model_name_or_path``: a name
    as the run's config named it, or, in checkpoints from before that, a directory); None for any other path."""
    import json

    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("base_model_name_or_path") or ""


def load_adapters(adapter_dir: str, *, base: str | None = None, dtype: str = "float32", device: str = "cpu"):
    """The base model an adapter directory names (``base``: this one instead), with its LoRA adapters merged in.
    A ``tiny`` base must be built first (``ctxrl.models.prepare.prepare`` of the adapter directory does it)."""
    from peft import PeftModel

    base_name = base or adapter_base(adapter_dir)
    if not base_name:
        raise ModelLoadError(f"{adapter_dir}/adapter_config.json names no base_model_name_or_path; name the model the "
                             "adapters were trained on: ctxrl merge ADAPTERS OUT --base NAME_OR_PATH")
    try:
        model = load_model(base_name, dtype=dtype, device=device)
    except ModelLoadError as exc:
        raise ModelLoadError(f"the LoRA adapters in {adapter_dir} were trained on {base_name!r}, which could not be "
                             f"loaded: {exc}. If the base is elsewhere, name it: ctxrl merge ADAPTERS OUT --base "
                             "NAME_OR_PATH") from exc
    try:
        return PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise ModelLoadError(f"could not apply the LoRA adapters in {adapter_dir} to {base_name!r}: {exc}") from exc
