"""Resumable training checkpoints: what one holds, writing it, and continuing a run from it exactly.

``save(run, step)`` writes ``checkpoints/step-NNNNNN`` atomically (``ctxrl.run.checkpoint_io``):
the policy's weights (``model.safetensors`` in ``model.dtype`` with its config and tokenizer, so the
directory loads like any HF checkpoint; a LoRA run's adapters in PEFT's format instead), the
optimiser (with the float32 master weights, under mixed precision), the loss scaler, the critic
and its optimiser, the reference model (a LoRA run's reference is its base: nothing to save),
every random generator, the learner's counters, the curriculum, the estimator's state (``rae``'s baselines),
the engine's policy version and the byte lengths of the logs.
``resume(run)`` restores all of it from ``checkpoints/latest``: every piece is required, and a
configuration change that would alter a step is an error naming it. The logs are rewound to the
checkpoint (lines written after it move to ``*.orphaned.jsonl``), so after the resumed run every
step appears exactly once.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from ctxrl.config import Config, load_config, resumable_keys, resumable_summary, to_toml
from ctxrl.errors import CheckpointError
from ctxrl.learner.precision import trainable_grads
from ctxrl.report.writer import LogRewindError
from ctxrl.run.checkpoint_io import (
    STEP_PREFIX,
    clean_partial,
    commit_checkpoint,
    damaged,
    latest_checkpoint,
    load_state,
    read_tensors,
    rng_state,
    save_state,
    set_rng_state,
    step_name,
    verify_checksums,
)
from ctxrl.run.engine_sync import sync_engine
from ctxrl.settings import resumable

FORMAT = 1


class Checkpointed(Protocol):
    """What a checkpoint saves and restores of a run (``ctxrl.run.parts.Run`` is one): the policy and its learner
    (optimiser, critic, reference, RNG), the rollout worker's policy version, the curriculum, the logs' offsets, and
    the counters; ``ctxrl.run.engine_sync.sync_engine`` hands restored weights to the engine."""

    config: Config
    device: str
    model: Any
    tokenizer: Any
    policy: Any
    learner: Any
    worker: Any
    curriculum: Any
    estimator: Any
    own: Any
    writer: Any
    consecutive_skips: int


def config_differences(saved: Config, current: Config) -> list[str]:
    """``key: saved -> current`` for every setting that differs and matters to a resumed step (the others are
    marked resumable where they are declared: ``RESUMABLE``). A component's table is compared as its settings read
    it, defaults filled on both sides, so a table written out at its defaults equals none at all (an older run's
    ``config.toml`` writes every field); a side that sets no table for it shows ``None``."""
    may_change = resumable_keys()
    out = []
    a, b = saved.to_dict(), current.to_dict()
    for section, fields in a.items():
        for key, value in fields.items():
            name = f"{section}.{key}"
            if name in may_change:
                continue
            if b[section][key] != value:
                out.append(f"{name}: {value!r} -> {b[section][key]!r}")
    for component in sorted(set(saved.components) | set(current.components)):  # components' own settings
        section, _, name = component.partition(".")
        before, after = saved.settings_of(section, name), current.settings_of(section, name)
        for f in dataclasses.fields(before):
            if not resumable(type(before), f) and getattr(before, f.name) != getattr(after, f.name):
                out.append(f"{component}.{f.name}: {saved.components.get(component, {}).get(f.name)!r} -> "
                           f"{current.components.get(component, {}).get(f.name)!r}")
    return out


def load_weights(model, file: Path) -> None:
    """Load a safetensors state dict into ``model``; tied weights (absent from the file) must share storage."""
    state = read_tensors(file)
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in state if k in params}
    untied = [k for k in missing if k not in params or params[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise CheckpointError(f"{file} does not fit the model: unexpected {unexpected[:5]}, missing {untied[:5]}; "
                              "was model.name changed since the checkpoint was written?")


def save_pretrained(model, tokenizer, path: Path) -> None:
    """The model and tokenizer as an HF checkpoint directory: one file, with the model's own parameter names.

    No sharding, and no conversion to a hub layout (transformers 5 converts some families), so
    that ``load_weights`` reads it back into the same module.
    """
    options: dict[str, Any] = {"max_shard_size": "100000GB"}
    if "save_original_format" in inspect.signature(model.save_pretrained).parameters:
        options["save_original_format"] = False
    model.save_pretrained(path, safe_serialization=True, **options)
    tokenizer.save_pretrained(path)


def save(run: Checkpointed, step: int) -> Path:
    """A resumable checkpoint after RL step ``step`` (atomic; ``latest`` updated; old ones pruned)."""
    from safetensors.torch import save_model

    refuse_non_finite(run, step_name(step))
    learner, policy = run.learner, run.policy
    reference = learner.reference.frozen_copy if learner.reference is not None else None

    def write(tmp: Path) -> None:
        if policy.is_lora:
            policy.save(tmp, run.tokenizer)  # adapter_model.safetensors + adapter_config.json, as PEFT writes
        else:
            save_pretrained(run.model, run.tokenizer, tmp)
        save_state(learner.optimizer.state_dict(), tmp, "optimizer")
        if learner.critic is not None:
            save_model(learner.critic, str(tmp / "critic.safetensors"))
            save_state(learner.critic_optimizer.state_dict(), tmp, "critic_optimizer")
        if reference is not None:
            save_model(reference, str(tmp / "reference.safetensors"))
        save_state(rng_state({"learner": learner.generator}), tmp, "rng")
        own = run.own.save(tmp, save_state, rng_state)  # (roles' own optimisers; their adapters: policy.save)
        state = {**own, "format": FORMAT, "step": step, "policy_version": run.worker.policy_version,
                 "skipped_updates": learner.skipped_updates, "consecutive_skips": run.consecutive_skips,
                 "curriculum": run.curriculum.state_dict(), "logs": run.writer.offsets(),
                 "critic": learner.critic is not None, "reference": reference is not None,
                 "lora": policy.is_lora, "loss_scaler": policy.precision.state_dict(),
                 "estimator": run.estimator.state_dict(),
                 "device": run.device, "dtype": run.config.model.dtype}
        (tmp / "state.json").write_text(json.dumps(state, indent=2))
        (tmp / "config.toml").write_text(to_toml(run.config))

    return commit_checkpoint(run.writer.dir / "checkpoints", step_name(step), write,
                             keep=run.config.train.keep_checkpoints)


def refuse_non_finite(run: Checkpointed, name: str) -> None:
    """A ``CheckpointError`` naming the last good checkpoint when the weights to be saved as ``checkpoints/NAME``
    hold a NaN or an infinity: a checkpoint is never written that would resume into them."""
    if run.learner is not None:
        bad = non_finite_weights(run.learner) + run.own.non_finite()
    else:
        bad = non_finite((n, p) for n, p in run.model.named_parameters() if p.requires_grad)
    if bad:
        raise CheckpointError(f"refusing to save checkpoints/{name}: {len(bad)} trained tensors hold NaN or infinite "
                              f"values ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})."
                              + resume_hint(run.writer.dir, run.config.train.checkpoint_every))


@torch.no_grad()
def non_finite(named) -> list[str]:
    """The names of ``(name, tensor)`` pairs whose tensor holds a NaN or an infinity (one host sync)."""
    named = list(named)
    if not named:
        return []
    finite = torch.stack([torch.isfinite(t).all().to(named[0][1].device) for _, t in named]).tolist()
    return [name for (name, _), ok in zip(named, finite) if not ok]


def non_finite_weights(learner) -> list[str]:
    """The trained tensors holding a NaN or an infinity: the policy's, the optimiser's float32 masters, the
    critic's. The learner's skips keep a non-finite gradient out of them; a finite step too large for float32 (a
    learning rate near 1e39) still makes them so, and then nothing the run does next means anything."""
    named = [(n, p) for n, p in learner.model.named_parameters() if p.requires_grad]
    seen = {id(p) for _, p in named}
    named += [(f"optimizer master {i}", m) for i, m in enumerate(trainable_grads(learner.optimizer))
              if id(m) not in seen]
    if learner.critic is not None:
        named += [(f"critic.{n}", p) for n, p in learner.critic.named_parameters() if p.requires_grad]
    return non_finite(named)


def resume(run: Checkpointed) -> int:
    """Restore ``checkpoints/latest`` into ``run`` (its learner built); returns the step it ends after. Its
    checksums are verified first (a checkpoint written before them loads unverified, with a warning)."""
    learner, policy = run.learner, run.policy
    reference = learner.reference.frozen_copy if learner.reference is not None else None
    root = run.writer.dir / "checkpoints"
    clean_partial(root)  # temporaries of a save that was killed
    path = latest_checkpoint(root)
    if not verify_checksums(path):  # (before anything is read: a damaged file is named, never loaded)
        warnings.warn(f"checkpoint {path} has no checksums.json (written by an older ctxrl): its files are loaded "
                      "unverified", stacklevel=2)
    state = _checked_state(run, path, reference)
    if policy.is_lora:
        policy.load_adapter_state(read_tensors(path / "adapter_model.safetensors"), str(path))
    else:
        load_weights(run.model, path / "model.safetensors")
    try:
        learner.optimizer.load_state_dict(load_state(path, "optimizer"))
    except ValueError as exc:  # e.g. no float32 masters in it: written before, or with other precision settings
        raise CheckpointError(f"{path}: the optimiser state does not fit this run: {exc}") from None
    policy.precision.load_state_dict(state.get("loss_scaler") or {})
    if learner.critic is not None:
        _load_module(learner.critic, path / "critic.safetensors")
        learner.critic_optimizer.load_state_dict(load_state(path, "critic_optimizer"))
    if reference is not None:
        _load_module(reference, path / "reference.safetensors")
    set_rng_state(load_state(path, "rng"), {"learner": learner.generator})
    run.own.resume(path, state, load_state, read_tensors, set_rng_state)  # (roles' own adapters, if any)
    sync_engine(run, int(state["policy_version"]), restored=True)
    learner.skipped_updates = int(state["skipped_updates"])
    run.consecutive_skips = int(state["consecutive_skips"])
    run.curriculum.load_state_dict(state["curriculum"])
    run.estimator.load_state_dict(state.get("estimator") or {})  # (rae's baselines; older checkpoints: none)
    try:
        run.writer.rewind(state["logs"], step=int(state["step"]))
    except LogRewindError as exc:
        raise CheckpointError(str(exc)) from None
    return int(state["step"])


def _checked_state(run: Checkpointed, path: Path, reference) -> dict[str, Any]:
    """``state.json`` of the checkpoint at ``path``, once its config, format and parts are known to fit ``run``."""
    learner, policy = run.learner, run.policy
    differences = config_differences(load_config(path / "config.toml"), run.config)
    if differences:
        raise CheckpointError(f"cannot resume from {path}: the config changed in ways that matter: "
                              + "; ".join(differences) + ". Undo these changes, or start a new run directory.")
    try:
        state = json.loads((path / "state.json").read_text())
    except ValueError as exc:
        raise damaged(path, "state.json", f"cannot be read ({exc})") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path}/state.json has format {state.get('format')!r}; this ctxrl reads format {FORMAT}")
    for key in ("step", "policy_version", "skipped_updates", "consecutive_skips"):
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise damaged(path, "state.json", f"says {key} = {value!r}, which is no count of steps")
    for flag, have, what, files in (
            ("critic", learner.critic is not None, "a critic (algo.advantage=gae)",
             ("critic.safetensors", "critic_optimizer.safetensors", "critic_optimizer.json")),
            ("reference", reference is not None, "a frozen reference model (algo.kl_coef > 0)",
             ("reference.safetensors",)),
            ("lora", policy.is_lora, "LoRA adapters (lora.rank > 0)", ("adapter_model.safetensors",))):
        if bool(state.get(flag)) != have:
            raise CheckpointError(f"{path}: the checkpoint {'has' if state.get(flag) else 'lacks'} {what}, "
                                  "the run does not match it")
        missing = [f for f in files if have and not (path / f).exists()]
        if missing:
            raise CheckpointError(f"checkpoint {path} is incomplete: {', '.join(missing)} missing")
    if state.get("device", run.device).split(":")[0] != run.device.split(":")[0]:
        warnings.warn(f"resuming on {run.device} a run checkpointed on {state['device']}: it continues "
                      "correctly, but not with the numbers an uninterrupted run would have given", stacklevel=2)
    return state


def _load_module(module, file: Path) -> None:
    """``safetensors.torch.load_model``, a file that cannot be read named as the others are (``damaged``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    try:
        load_model(module, str(file))
    except (SafetensorError, OSError) as exc:
        raise damaged(file.parent, file.name, f"cannot be read ({exc})") from None


def finite_weights(path: Path) -> bool:
    """Whether every tensor of the checkpoint's weights (``model.safetensors``, or a LoRA run's adapters) is finite:
    matching checksums say the files are as written, not that what was written was good. Read one tensor at a time;
    an unreadable file is not good."""
    from safetensors import SafetensorError, safe_open

    files = [f for f in (path / "model.safetensors", path / "adapter_model.safetensors") if f.exists()]
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as tensors:
                for name in tensors.keys():
                    if not torch.isfinite(tensors.get_tensor(name)).all():
                        return False
    except (SafetensorError, OSError):
        return False
    return bool(files)


def resume_hint(run_dir: Path, checkpoint_every: int) -> str:
    """Where to resume from: the newest checkpoint written before any skipped-update streak."""
    root = run_dir / "checkpoints"
    good = []
    for path in sorted(root.glob(f"{STEP_PREFIX}*")):
        try:
            state = json.loads((path / "state.json").read_text())
        except (OSError, ValueError):
            continue
        if state.get("consecutive_skips", 0) == 0 and finite_weights(path):
            good.append(path)
    if not good:
        why = "train.checkpoint_every=0" if not checkpoint_every else "none was written before the problem began"
        return f" No checkpoint from before the problem is available ({why})."
    return (f" The last good checkpoint is {good[-1]}: point {root / 'latest'} at it (its name on one line), "
            f"fix the cause and resume with --resume (settings that may change: {resumable_summary()}; "
            "any other change needs a new run).")
