"""Sharded, atomic checkpoints of an FSDP2 model and its optimiser with ``torch.distributed.checkpoint`` (DCP).

``save_sharded(path, model, optimizer, step=...)``: every rank writes its own shards into ``path`` + ``.tmp``
(DCP: one file per rank plus a ``.metadata`` index that records each tensor's global shape and which piece
every file holds), then, after all ranks have written, rank 0 renames the directory to ``path``. A crash mid-save
leaves the previous checkpoint at ``path`` untouched and a ``.tmp`` that the next save replaces; ``path`` is
never half-written.

``load_sharded(path, model, optimizer)`` reads it back into a model of **any** world size: DCP reads the pieces
each rank's shards need from the index (resharding), so 2 ranks' checkpoint loads on 1, 4 or 8 ranks, or into a
plain unsharded model in a process without a process group (``tests/test_sharded.py`` checks 2 -> 1). The
weights and the optimiser's state (AdamW's moments and step counts) come back exactly, so a resumed run takes
the same steps as one that never stopped.

What it does not do: keep several checkpoints or prune old ones; save the data loader's or the RNG's state
(the learner's checkpoint owns those); convert to safetensors (``full_state_layers`` gathers the full weights).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

META = "ctxrl_sharded.json"
"""The checkpoint's own small record (step, world size that wrote it), written by rank 0 beside DCP's files."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def save_sharded(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 step: int = 0) -> Path:
    """Write the model's (and the optimiser's) shards to ``path`` atomically; every rank calls it. Returns
    ``path``. An existing checkpoint at ``path`` is replaced only once the new one is complete."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)  # what a crashed save left
    _barrier()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(_state(model, optimizer), checkpoint_id=str(tmp), no_dist=not _distributed())
    if _rank() == 0:
        world = dist.get_world_size() if _distributed() else 1
        (tmp / META).write_text(json.dumps({"step": int(step), "world_size": world,
                                            "optimizer": optimizer is not None}))
    _barrier()  # every rank's files are in tmp before it becomes the checkpoint
    if _rank() == 0:
        old = path.with_name(path.name + ".old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    return path


def checkpoint_info(path: str | Path) -> dict:
    """The checkpoint's record: ``step``, ``world_size`` (of the ranks that wrote it), ``optimizer``."""
    path = Path(path)
    meta = path / META
    if not meta.is_file():
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint (no {META}); a directory ending in "
                                ".tmp is a save that did not finish")
    return json.loads(meta.read_text())


def load_sharded(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load ``path`` into ``model`` (sharded at any world size, or plain) and ``optimizer``; every rank calls it.
    Returns the checkpoint's record (``checkpoint_info``)."""
    info = checkpoint_info(path)
    if optimizer is not None and not info["optimizer"]:
        raise ValueError(f"{path} holds no optimiser state (it was saved without one); load the weights only "
                         "(optimizer=None) and start the optimiser afresh")
    state = _state(model, optimizer)
    with warnings.catch_warnings():  # DCP warns that it "assumes" a one-process load: that is what no_dist asks
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return info
