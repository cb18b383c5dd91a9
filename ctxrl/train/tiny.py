"""Building the tiny model: a stage that calls the library (``ctxrl.models.tiny`` for its shape and pieces,
``ctxrl.demos.pretraining`` for its text), run before anything loads it.

It registers the ``tiny`` model preparer (``prepare_tiny``), which ``ctxrl.models.prepare.prepare(name)``, what an
entry point calls with a model name, runs for a ``tiny`` name: it builds a model that is not cached yet (minutes
on a CPU); the loader then resolves it, as it does every other name (converting a GGUF file on first use, and
refusing an unbuilt tiny model with this fix). ``ensure_model(name)`` is the same path for a caller that has this
stage at hand.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from ctxrl.demos.pretraining import pretraining_batches, tokenizer_texts
from ctxrl.models.loader import adapter_base, parse_tiny, resolve, resolves_to_cache
from ctxrl.models.prepare import register_preparer
from ctxrl.models.tiny import Progress, TinySpec, init_model, is_built, make_tokenizer, save_atomically, tiny_path


def ensure_model(name: str, *, on_progress: Progress | None = None) -> str:
    """The directory ``name`` loads from, building the tiny model first if ``name`` is an unbuilt ``tiny`` spec.
    A directory of LoRA adapters loads as its base plus the adapters: a base named as ``tiny`` (or a named model,
    a GGUF file) is made ready the same way; a directory or hub name is the loader's to find."""
    base = adapter_base(name)
    if base and resolves_to_cache(base):
        ensure_model(base, on_progress=on_progress)
    spec = parse_tiny(name)
    if spec is not None:
        ensure_tiny(spec, on_progress=on_progress)
    return resolve(name, on_progress=on_progress)


@register_preparer("tiny")
def prepare_tiny(name: str, *, on_progress: Progress | None = None) -> None:
    """The ``tiny`` preparer of ``ctxrl.models.prepare``: build the tiny model ``name`` specifies if it is not cached
    yet (``ensure_tiny``, looked up when called)."""
    ensure_tiny(parse_tiny(name), on_progress=on_progress)


def tiny_tokenizer(spec: TinySpec):
    """The tokenizer ``build_tiny`` makes for ``spec``, made alone (seconds, where the model takes minutes), for the
    checks that need only a tokenizer before the model is built. Its training is deterministic, so it is the
    built model's tokenizer."""
    return make_tokenizer(spec, tokenizer_texts(spec))


def ensure_tiny(spec: TinySpec | None = None, *, on_progress: Progress | None = None) -> Path:
    """The cached tiny checkpoint of ``spec``, built now if it is not cached yet. Runs started at once on one
    machine (a sweep's first runs) take turns on a file lock: one builds, the others wait and reuse its build
    rather than each spending minutes on the same model."""
    spec = spec or TinySpec()
    path = tiny_path(spec)
    if is_built(spec):
        return path
    with build_lock(path, on_progress):
        if not is_built(spec):  # (built by the process that held the lock while this one waited)
            build_tiny(spec, path, on_progress=on_progress)
    return path


@contextmanager
def build_lock(path: Path, on_progress: Progress | None = None):
    """An exclusive ``fcntl`` lock on ``.NAME.lock`` beside ``path``, for as long as the block runs; a process that
    has to wait says so (``on_progress``). The kernel drops the lock when its holder exits, even killed."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_progress is not None:
                on_progress("tiny model: waiting for another process building it", 0, 0)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_tiny(spec: TinySpec, path: Path, *, on_progress: Progress | None = None) -> Path:
    """Build and save the tiny tokenizer + model at ``path`` (atomically); ``on_progress`` hears each stage."""
    report = on_progress or (lambda stage, done, total: None)
    report("tiny model: tokenizer", 0, 0)
    tokenizer = make_tokenizer(spec, tokenizer_texts(spec))
    model = init_model(spec, tokenizer)
    losses = _pretrain_model(model, tokenizer, spec, report) if spec.pretrain_steps else []
    save_atomically(path, spec, tokenizer, model, losses)
    return path



def _pretrain_model(model, tokenizer, spec: TinySpec, report: Progress) -> list[float]:
    """Pre-train ``model`` in place on fresh solved tasks; it ends on the CPU. Returns the losses."""
    import torch

    # On a GPU when there is one (a minute instead of several); saved from the CPU either way.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report("tiny model: pre-training data", 0, 0)
    batches = pretraining_batches(tokenizer, spec)
    losses = pretrain(model.to(device), tokenizer, batches, spec,
                      on_step=lambda step, total: report("tiny model: pre-training", step, total))
    model.to("cpu")
    return losses


def pretrain(model, tokenizer, batches: list[list[list[int]]], spec: TinySpec,
             on_step: Callable[[int, int], None] | None = None) -> list[float]:
    """Causal-LM loss on every token, one optimiser step per batch; returns the losses.

    Runs on the model's device. Linear warm-up then cosine decay to zero over the batches.
    """
    import math

    import torch

    from ctxrl.learner.logprobs import token_logprobs

    batches = [b for b in batches if b]
    if not batches:
        raise ValueError("pre-training needs at least one sequence")
    steps = len(batches)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.pretrain_lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * s / steps)))
    losses = []
    model.train()
    for batch in batches:
        width = max(len(x) for x in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, x in enumerate(batch):
            ids[row, : len(x)] = torch.tensor(x)
            mask[row, : len(x)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logprobs = token_logprobs(model, ids, mask)
        target_mask = mask[:, 1:].float()
        loss = -(logprobs * target_mask).sum() / target_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(len(losses), steps)
    model.eval()
    return losses
