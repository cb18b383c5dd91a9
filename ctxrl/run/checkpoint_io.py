"""Atomic, pickle-free checkpoint files: the on-disk layer under ``ctxrl.run.checkpoint``.

A checkpoint is a directory ``checkpoints/step-NNNNNN`` holding

- ``model.safetensors`` + ``config.json`` and the tokenizer files (``save_pretrained``: the
  directory loads like any HF checkpoint, so ``ctxrl eval --checkpoint`` takes it): the weights
  the policy holds (in ``model.dtype``); or, for a LoRA run, ``adapter_model.safetensors`` +
  ``adapter_config.json`` (PEFT's format) and the tokenizer;
- ``optimizer.safetensors`` (every tensor of the optimiser state, the float32 master weights of a
  ``MasterAdamW`` among them) + ``optimizer.json`` (the rest: parameter groups, non-tensor state);
  the same pair for the critic's optimiser and ``critic.safetensors`` when the run has a critic;
  ``reference.safetensors`` when the KL reference is a frozen copy;
- ``rng.safetensors`` (torch CPU, CUDA and learner generator states) + ``rng.json`` (python and
  numpy states);
- ``state.json``: step, engine policy version, learner counters, curriculum state, the byte
  lengths of ``metrics.jsonl`` and ``samples.jsonl`` at save time, whether a critic, a reference
  model and LoRA adapters are in it, the loss scaler's state, the device and dtype;
- ``config.toml``: the resolved config;
- ``checksums.json``: the SHA-256 of every other file, written last. ``--resume`` checks them
  before it reads anything (``verify_checksums``), so a file overwritten or cut short is refused,
  named, with the previous checkpoint offered; a checkpoint written before checksums existed
  loads unverified, with a note. Any file that cannot be read is the same one-line error
  (``read_tensors``, ``damaged``), never a bare ``SafetensorError``.

Writing: into a temporary sibling directory, ``checksums.json`` last, every file fsynced, the directory renamed into
place, the parent fsynced; then the ``latest`` pointer (a one-line text file naming the
directory) is replaced atomically the same way; then all but the newest ``keep`` step
checkpoints are deleted. A crash at any point leaves ``latest`` naming a complete checkpoint.

Reading never unpickles: tensors come from safetensors, everything else from JSON or TOML.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ctxrl.errors import CheckpointError

LATEST = "latest"
STEP_PREFIX = "step-"
CHECKSUMS = "checksums.json"
REQUIRED = ("optimizer.safetensors", "optimizer.json", "rng.safetensors", "rng.json", "state.json", "config.toml")
WEIGHTS = ("model.safetensors", "adapter_model.safetensors")
"""A checkpoint holds one of these: the whole policy, or (LoRA) its adapters."""


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


# -- state <-> (tensors, json) ---------------------------------------------------------------------
def _split_state(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` as JSON, with every tensor moved into ``tensors`` under a path key and left as a reference."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().to("cpu").contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {"__dict__": [[_key(k), _split_state(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [_split_state(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"cannot checkpoint a value of type {type(obj).__name__} at {prefix!r}")


def _key(k: Any) -> Any:
    if isinstance(k, (int, str)):
        return k
    raise CheckpointError(f"cannot checkpoint a dict key of type {type(k).__name__}")


def _join_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict) and "__tensor__" in obj:
        try:
            return tensors[obj["__tensor__"]]
        except KeyError:
            raise CheckpointError(f"tensor {obj['__tensor__']!r} is missing from the checkpoint") from None
    if isinstance(obj, dict) and "__dict__" in obj:
        return {k: _join_state(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_join_state(v, tensors) for v in obj]
    return obj


def save_state(state: Any, directory: Path, name: str) -> None:
    """``state`` (nested dicts/lists of tensors and JSON values) as ``name.safetensors`` + ``name.json``."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split_state(state, name, tensors)
    save_file(tensors, str(directory / f"{name}.safetensors"))
    (directory / f"{name}.json").write_text(json.dumps(skeleton))


def load_state(directory: Path, name: str) -> Any:
    for suffix in (".safetensors", ".json"):
        if not (directory / f"{name}{suffix}").exists():
            raise CheckpointError(f"checkpoint {directory} has no {name}{suffix}; it cannot be resumed exactly "
                                  "(it was written by an older ctxrl or damaged): start a fresh run or resume "
                                  "from another checkpoint")
    try:
        skeleton = json.loads((directory / f"{name}.json").read_text())
    except (ValueError, OSError) as exc:
        raise damaged(directory, f"{name}.json", f"cannot be read ({exc})") from None
    return _join_state(skeleton, read_tensors(directory / f"{name}.safetensors"))


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's safetensors ``file``; one that cannot be read (cut short, a damaged header) is
    a ``CheckpointError`` naming it and offering the previous checkpoint."""
    from safetensors import SafetensorError

    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise damaged(file.parent, file.name, f"cannot be read ({exc})") from None


# -- checksums --------------------------------------------------------------------------------------
def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(directory: Path) -> None:
    """``checksums.json``: the SHA-256 of every file under ``directory`` (by its path relative to it)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    sums = {p.relative_to(directory).as_posix(): _sha256(p) for p in files}
    (directory / CHECKSUMS).write_text(json.dumps({"sha256": sums}, indent=1))


def verify_checksums(path: Path) -> bool:
    """Check every file of the checkpoint ``path`` against its ``checksums.json``: True when all match, False when
    the checkpoint has none (written by an older ctxrl); a ``CheckpointError`` naming the first that differs."""
    listing = path / CHECKSUMS
    if not listing.exists():
        return False
    try:
        expected = json.loads(listing.read_text())["sha256"]
        if not isinstance(expected, dict):
            raise TypeError("not a table of files")
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise damaged(path, CHECKSUMS, f"cannot be read ({exc})") from None
    for name, digest in sorted(expected.items()):
        file = path / name
        if not file.is_file():
            raise damaged(path, name, "is missing")
        if _sha256(file) != digest:
            raise damaged(path, name, f"does not match the checksum it was written with ({file.stat().st_size} "
                                      "bytes now: overwritten or cut short since)")
    return True


def damaged(path: Path, name: str, what: str) -> CheckpointError:
    """The error for the checkpoint ``path`` whose file ``name`` is ``what``: never loaded, the previous one offered."""
    return CheckpointError(f"checkpoint {path} is damaged: {name} {what}; it was not loaded."
                           + previous_hint(path))


def previous_hint(path: Path) -> str:
    """How to go on from the newest step checkpoint before ``path`` (its files are checked when it is resumed)."""
    root = path.parent
    older = sorted(p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir() and p.name < path.name)
    if not older:
        return (" No earlier checkpoint is kept (train.keep_checkpoints), so the run cannot go on from one: start a "
                "fresh run directory.")
    return (f" The previous checkpoint is {older[-1]}: resume from it with `echo {older[-1].name} > {root / LATEST}` "
            "and --resume (the steps after it are redone).")


def rng_state(generators: dict[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Python, numpy, torch (CPU and every CUDA device) and named generators' states."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
    }
    for name, gen in (generators or {}).items():
        state[f"gen:{name}"] = gen.get_state()
    return state


def set_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator] | None = None) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, gen in (generators or {}).items():
        if f"gen:{name}" not in state:
            raise CheckpointError(f"the checkpoint has no state for the {name} random generator")
        gen.set_state(state[f"gen:{name}"])


# -- atomic directory writes -----------------------------------------------------------------------
def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old or the new content, never a mix."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def commit_checkpoint(root: Path, name: str, write, *, keep: int = 0) -> Path:
    """Run ``write(tmpdir)`` and add its ``checksums.json``, then move the directory to ``root/name`` and point
    ``latest`` at it.

    ``keep`` > 0 deletes all but the newest ``keep`` ``step-*`` checkpoints afterwards (never the
    one ``latest`` names). Nothing half-written is ever visible under ``name`` or via ``latest``.
    """
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; a checkpoint is read by others (eval jobs)
    final = root / name
    displaced = None
    try:
        write(tmp)
        write_checksums(tmp)
        _fsync_tree(tmp)
        if final.exists():  # the same step from an abandoned attempt: move it aside, never delete it first
            displaced = Path(tempfile.mkdtemp(prefix=f".{name}-old-", dir=root))
            os.rename(final, displaced / name)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException as exc:
        if displaced is not None and not final.exists():
            os.rename(displaced / name, final)  # put the old one back
        shutil.rmtree(tmp, ignore_errors=True)
        code = os_errno(exc)
        if code is not None and getattr(exc, "filename", None) is None:  # a full disk: name what was being written
            raise OSError(code, os.strerror(code), str(final)) from exc
        raise
    write_atomic_text(root / LATEST, name + "\n")
    if displaced is not None:
        shutil.rmtree(displaced, ignore_errors=True)
    if keep > 0:
        steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX))
        for old in steps[:-keep]:
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    return final


def os_errno(exc: BaseException) -> int | None:
    """The operating system's error number behind ``exc``: an ``OSError``'s, or one safetensors' Rust writer reports
    in its message (``I/O error: No space left on device (os error 28)``); None for anything else."""
    if isinstance(exc, OSError):
        return exc.errno
    found = re.search(r"\(os error (\d+)\)", str(exc)) if type(exc).__name__ == "SafetensorError" else None
    return int(found.group(1)) if found else None


def latest_checkpoint(root: Path) -> Path:
    """The checkpoint ``root/latest`` names, checked complete; a clear error otherwise."""
    pointer = root / LATEST
    if not pointer.exists():
        raise CheckpointError(f"no checkpoint to resume from: {pointer} does not exist (the run wrote none; set "
                              "train.checkpoint_every > 0 so that it does, or start without --resume)")
    name = pointer.read_text().strip()
    path = root / name
    if not name or "/" in name or not path.is_dir():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a checkpoint directory in {root}")
    missing = [f for f in REQUIRED if not (path / f).exists()]
    if not any((path / f).exists() for f in WEIGHTS):
        missing.append(" or ".join(WEIGHTS))
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: {', '.join(missing)} missing; it cannot be resumed "
                              "exactly." + previous_hint(path))
    return path


def clean_partial(root: Path) -> list[Path]:
    """Remove temporary directories left by a crash during a save; returns what was removed."""
    removed = []
    if root.exists():
        for p in root.iterdir():
            if p.name.startswith("."):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                removed.append(p)
    return removed
