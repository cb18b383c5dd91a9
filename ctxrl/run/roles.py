"""Separate trainable policies per role: a LoRA adapter per role on the run's one base, each with its own optimiser.

``roles.policies = ["player_1=own"]`` (with ``lora.rank > 0``) gives ``player_1`` a policy of its own: a PEFT
adapter named after the role, beside the ``default`` adapter that the shared policy trains, on the same frozen
base (held once). ``OwnRoles`` keeps what each such role needs:

- its adapter, added when the policy loads (``Policy.load(roles=)``, ``ctxrl.models.lora.add_adapters``) and
  copied from the shared adapter after the warm start (``after_warm_start``), so every policy starts from the same
  warm start;
- its engine: a copy of the policy that shares the base tensors and has its own copies of the adapters, with the
  role's adapter active (``Policy.engine_model(adapter=role)``); the rollout worker plays the role's seats with it
  (``RolloutWorker.role_engines``) and it gets the role's adapter after every update (``sync``);
- its learner: a ``Learner`` over the same module whose optimiser holds the role's adapter alone, updated on the
  rows of the role's seats with the role's adapter active (``take``, ``update``), with its own mini-batch order;
- its part of a checkpoint: PEFT writes every adapter (``ROLE/adapter_model.safetensors`` beside the shared one's),
  and ``save`` / ``resume`` add each learner's optimiser and random generator (``checkpoint.py`` calls them).

What it does not do: a critic per role (LoRA runs have none), rollouts in other processes (the configuration
refuses ``own`` with ``distributed.backend = "ray"`` and ``torchrun``), a KL reference per role (every adapter's
reference is the base, adapters off), or merged exports of the roles' adapters (``ctxrl merge`` takes one adapter
directory: ``checkpoints/final/ROLE``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ctxrl.errors import CheckpointError
from ctxrl.models.lora import DEFAULT_ADAPTER as DEFAULT
from ctxrl.models.lora import adapter_parameters
from ctxrl.types import Episode, TrainSequence

OWN = "own"


def own_roles(config: Any) -> tuple[str, ...]:
    """The roles ``roles.policies`` gives a trainable policy of their own (``ROLE=own``), in the order named."""
    out = []
    for pair in config.roles.policies:
        role, _, policy = pair.partition("=")
        if policy.strip() == OWN:
            out.append(role.strip())
    return tuple(out)



class OwnRoles:
    """The roles with policies of their own, their learners, and the rows each trains on (module docstring)."""

    def __init__(self, roles: tuple[str, ...], policy) -> None:
        self.roles, self.policy = roles, policy
        self.learners: dict[str, Any] = {}
        self.pending: dict[str, list[TrainSequence]] = {}

    def engines(self, spec, renderer) -> dict[str, Any]:
        """An engine per role over its own copy of the adapters, the role's active."""
        from ctxrl.rollout.spec import spec_engine

        return {role: spec_engine(spec, self.policy.engine_model(adapter=role), renderer) for role in self.roles}

    def after_warm_start(self) -> None:
        """Every role's adapter becomes a copy of the shared one (the warm start trains that one)."""
        shared = {n.replace(f".{DEFAULT}.", "."): p for n, p in adapter_parameters(self.policy.model, DEFAULT).items()}
        with torch.no_grad():
            for role in self.roles:
                for name, p in adapter_parameters(self.policy.model, role).items():
                    p.copy_(shared[name.replace(f".{role}.", ".")])

    def make_learners(self, run, reference) -> None:
        """A ``Learner`` per role over the run's module, its optimiser holding the role's adapter alone, its
        mini-batch order its own stream (``derive_seed(learner seed, i)`` for the ``i``-th role), ``reference`` the
        shared KL reference (the base: every adapter off)."""
        from ctxrl.learner.learner import Learner
        from ctxrl.seeds import derive_seed

        if not self.roles:
            return
        t, precision, model = run.config.train, self.policy.precision, self.policy.model
        try:
            for i, role in enumerate(self.roles, start=1):
                model.set_adapter(role)  # (its parameters require grad while the optimiser hooks them)
                optimizer = precision.optimizer(list(adapter_parameters(model, role).values()), lr=t.lr,
                                                weight_decay=t.weight_decay)
                self.learners[role] = Learner(model, optimizer, run.learner.settings,
                                              pad_token_id=run.tokenizer.pad_token_id, reference=reference,
                                              precision=precision, seed=derive_seed(run.seeds.learner, i))
        finally:
            model.set_adapter(DEFAULT)

    def take(self, episodes: list[Episode], rows: list[list[TrainSequence]]) -> list[list[TrainSequence]]:
        """Keep the rows of the roles' own seats for ``update``; return the others (the shared policy's)."""
        self.pending = {role: [] for role in self.roles}
        shared = []
        for episode, mine in zip(episodes, rows, strict=True):
            if episode.info.get("policy") == OWN:
                self.pending[episode.role].extend(mine)
            else:
                shared.append(mine)
        return shared

    def update(self) -> dict[str, float]:
        """Each role's learner on its rows, with its adapter active; its figures suffixed ``_ROLE``."""
        out: dict[str, float] = {}
        model = self.policy.model
        if not any(self.pending.values()):
            self.pending = {}
            return out
        try:
            for role, rows in self.pending.items():
                if not rows:
                    continue
                model.set_adapter(role)
                learner = self.learners[role]
                out.update({f"{k}_{role}": v for k, v in learner.update(learner.collate(rows)).items()})
        finally:
            model.set_adapter(DEFAULT)
        self.pending = {}
        return out

    def skipped_all(self, update: dict[str, float]) -> bool:
        """Whether some role's learner skipped every mini-batch update of the step (its ``skipped_ROLE`` figure)."""
        return any(update.get(f"skipped_{role}", 0.0) >= 1.0 for role in self.learners)

    def non_finite(self) -> list[str]:
        """The roles' trained tensors holding a NaN or an infinity: each adapter and its optimiser's masters."""
        from ctxrl.learner.precision import trainable_grads
        from ctxrl.run.checkpoint import non_finite

        named = []
        for role, learner in self.learners.items():
            adapter = adapter_parameters(self.policy.model, role)
            seen = {id(p) for p in adapter.values()}
            named += [(f"{role}: {n}", p) for n, p in adapter.items()]
            named += [(f"{role}: optimizer master {i}", m) for i, m in enumerate(trainable_grads(learner.optimizer))
                      if id(m) not in seen]
        return non_finite(named)

    def sync(self, worker, version: int) -> None:
        """Each role's engine gets its adapter, as policy ``version``."""
        for role in self.roles:
            state = {n: p.detach() for n, p in adapter_parameters(self.policy.model, role).items()}
            worker.role_engines[role].load_weights(state, version=version, partial=True)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def save(self, directory: Path, save_state, rng_state) -> dict[str, Any]:
        """Each learner's optimiser and generator into ``directory``; what ``state.json`` records of them."""
        for role, learner in self.learners.items():
            save_state(learner.optimizer.state_dict(), directory, f"optimizer-{role}")
            save_state(rng_state({"learner": learner.generator}), directory, f"rng-{role}")
        return {"own_roles": list(self.roles),
                "own_skipped_updates": {role: learner.skipped_updates for role, learner in self.learners.items()}}

    def resume(self, directory: Path, state: dict, load_state, read_tensors, set_rng_state) -> None:
        """Restore each role's adapter, optimiser and generator from a checkpoint ``save`` wrote."""
        from peft import set_peft_model_state_dict

        if list(state.get("own_roles", [])) != list(self.roles):
            raise CheckpointError(f"{directory}: the checkpoint has policies of their own for "
                                  f"{state.get('own_roles', [])}, the run for {list(self.roles)}")
        for role, learner in self.learners.items():
            file = directory / role / "adapter_model.safetensors"
            if not file.exists():
                raise CheckpointError(f"checkpoint {directory} is incomplete: {role}/adapter_model.safetensors missing")
            set_peft_model_state_dict(self.policy.model, read_tensors(file), adapter_name=role)
            learner.optimizer.load_state_dict(load_state(directory, f"optimizer-{role}"))
            set_rng_state(load_state(directory, f"rng-{role}"), {"learner": learner.generator})
            learner.skipped_updates = int(state.get("own_skipped_updates", {}).get(role, 0))
