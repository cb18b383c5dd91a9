"""Settings that work for the named real models, on a GPU and on a 2-core CPU.

``ctxrl demo --model NAME`` trains with them, and ``examples/models/NAME.toml`` (GPU) and
``examples/models/NAME-cpu.toml`` hold the same settings as files to copy (a test keeps the three in
step). They differ from the tiny demo model's defaults where a pretrained model needs it:

- the warm start is short and gentle (``sft.lr`` 3e-5, not 1e-3): the model already writes fluent
  text, and the demos only have to show it the tool-call format. They stay deliberately imperfect
  (``sft.shortcut_fraction``: most answer without the tool), so RL has something to fix;
- RL's learning rate is 5e-6, not 1e-4: every weight of a pretrained model matters;
- turns get more tokens, because SmolLM2's BPE spends more of them on a tool call than the tiny
  model's does, and the system turn carries the tool schemas (its template has no tool section);
- on a CPU everything is smaller (tasks, groups, demos, steps, evaluation tasks), so that the demo
  finishes within about 10 minutes on two cores (docs/real-models.md says what it gives up). With
  only 64 demos the warm start needs a higher learning rate (1e-4) to teach the format at all, and
  then 80% shortcut demos to leave the greedy policy not calling the tool (at 65% it already calls
  it and RL has nothing to show). RL stays at 1e-5: with 16 episodes a step, 3e-5 sent one run into
  calling the calculator four times an episode.
"""

from __future__ import annotations

from typing import Any

from ctxrl.errors import ConfigError

Settings = dict[str, dict[str, Any]]

_SMOLLM2_GPU: Settings = {
    "model": {"name": "smollm2-135m-instruct", "dtype": "bfloat16"},
    "env": {"name": "calculator", "max_turns": 4},
    "rollout": {"tasks_per_step": 16, "group_size": 8, "temperature": 1.0, "max_new_tokens": 96,
                "max_total_tokens": 1024},
    "sft": {"demos": 1000, "epochs": 1, "lr": 3e-5, "batch_size": 16},
    "train": {"steps": 20, "lr": 5e-6, "eval_every": 10},
    "eval": {"tasks": 100},
    "run": {"name": "smollm2-calculator"},
}

_SMOLLM2_CPU: Settings = {
    "model": {"name": "smollm2-135m-instruct", "dtype": "float32", "device": "cpu"},
    "env": {"name": "calculator", "max_turns": 4},
    "rollout": {"tasks_per_step": 4, "group_size": 4, "temperature": 1.0, "max_new_tokens": 64,
                "max_total_tokens": 768},
    "sft": {"demos": 64, "shortcut_fraction": 0.8, "epochs": 1, "lr": 1e-4, "batch_size": 8},
    "train": {"steps": 6, "lr": 1e-5, "eval_every": 0, "micro_batch_size": 8},
    "eval": {"tasks": 20},
    "run": {"name": "smollm2-calculator-cpu"},
}

PRESETS: dict[str, dict[str, Settings]] = {
    "smollm2-135m-instruct": {"gpu": _SMOLLM2_GPU, "cpu": _SMOLLM2_CPU},
}


def preset(model: str, where: str) -> Settings:
    """The settings of ``model`` for ``where`` (``gpu`` or ``cpu``); an unknown model is a ``ConfigError``."""
    found = PRESETS.get(model.lower())
    if found is None:
        raise ConfigError(f"no preset for model {model!r}; models with one: {', '.join(PRESETS)}")
    return found[where]


def preset_overrides(model: str, where: str) -> list[str]:
    """``preset(model, where)`` as ``section.field=value`` overrides (values as TOML literals)."""
    import json

    return [f"{section}.{key}={json.dumps(value)}" for section, fields in preset(model, where).items()
            for key, value in fields.items()]
