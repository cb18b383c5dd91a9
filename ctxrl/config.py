"""Run configuration: the sections (``ctxrl.sections``) loaded from TOML into one ``Config``.

A config file has one table per section (``[model]``, ``[env]``, ``[rollout]``, ``[context]``,
``[meta]``, ``[sft]``, ``[algo]``, ``[reward]``, ``[curriculum]``, ``[train]``, ``[lora]``, ``[eval]``,
``[run]``, ``[report]``, ``[distributed]``, ``[roles]``), and a registered component may have a table of its own
inside its section (``[algo.rae]``: ``ctxrl.settings``);
the command line overrides any field as ``section.field=value`` (the value is read as a TOML literal, or as a
string if it is not one).
An unknown section or field, or a value of the wrong type or out of range, is a ``ConfigError``
that names the key and suggests the nearest valid one.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


from ctxrl.errors import ConfigError
from ctxrl.prompts import SUMMARY_INSTRUCTION
from ctxrl.sections import (  # noqa: F401 - the sections are re-exported: ctxrl.config stays their face
    RESUMABLE,
    SECTIONS,
    AlgoConfig,
    ContextConfig,
    CurriculumConfig,
    DistributedConfig,
    EnvConfig,
    EvalConfig,
    LoRAConfig,
    MetaConfig,
    ModelConfig,
    ReportConfig,
    RewardConfig,
    RolesConfig,
    RolloutConfig,
    RunConfig,
    SFTConfig,
    TrainConfig,
)
from ctxrl.settings import check_number, coerce, nearest, resumable

__all__ = ["Config", "ConfigError", "describe_fields", "fields_markdown", "from_dict", "load_config", "to_toml"]

NO_DEFAULT: Any = object()
"""``Renamed.default`` of a key whose every value is moved, and said."""


@dataclass(frozen=True)
class Renamed:
    """A key that moved. A config that names ``old`` (an older one, or a run's saved ``config.toml``) is read as
    though it named ``new``: ``from_dict`` moves it before the sections are built, with one warning per load that
    names every key it moved; a config that sets both is an error."""

    old: str
    """``section.key``, as older versions wrote it."""
    new: str | Callable[[Mapping[str, Any]], str]
    """Where it lives now: ``section.key``, another section's, or a component's table (``section.NAME.key``); or a
    function of the config being read (its tables, as read) that says where (``context.max_summaries`` into the
    table of the manager that config names)."""
    default: Any = NO_DEFAULT
    """The old key's default. An old saved ``config.toml`` writes every field, so a value equal to it says nothing:
    it is dropped without a word (moved, it would open the table of a component the run does not use)."""
    kind: type | tuple[type, ...] = object
    """Only a value of this type is the old key (``reward.judge``: a string is the old key, a table the new one's)."""


RENAMED: tuple[Renamed, ...] = (
    Renamed("meta.context", "meta.carry"),
    # issue 50: a component's own fields into its table
    Renamed("curriculum.horizon_start_turns", "curriculum.horizon.start_turns", 2),
    Renamed("curriculum.horizon_warmup_steps", "curriculum.horizon.warmup_steps", 20),
    Renamed("curriculum.horizon_stages", "curriculum.horizon.stages", 3),
    Renamed("curriculum.self_paced_pool", "curriculum.self_paced.pool", 4),
    Renamed("curriculum.self_paced_floor", "curriculum.self_paced.floor", 0.02),
    Renamed("algo.dual_clip", "algo.ppo_clip.dual_clip", 0.0),
    Renamed("algo.lam", "algo.gae.lam", 1.0),
    Renamed("algo.gae_level", "algo.gae.level", "token"),
    Renamed("algo.vf_clip", "algo.gae.vf_clip", 0.2),
    Renamed("train.critic_lr", "algo.gae.critic_lr", 1e-3),
    Renamed("meta.credit", "algo.meta.credit", "cross_episode"),
    Renamed("meta.normalize", "algo.meta.normalize", "std"),
    Renamed("meta.baseline", "algo.meta.baseline", "loo"),
    Renamed("meta.gamma_trial", "algo.meta.gamma_trial", 1.0),
    Renamed("context.max_summaries", lambda data: f"context.{_summarizer(data)}.max_summaries", 2),
    Renamed("context.eval_max_summaries", lambda data: f"context.{_summarizer(data)}.eval_max_summaries", 2),
    Renamed("context.summary_max_tokens", lambda data: f"context.{_summarizer(data)}.max_tokens", 64),
    Renamed("context.summary_instruction", "context.summarize.instruction", SUMMARY_INSTRUCTION),
    Renamed("context.max_branches", "context.fold.max_branches", 4),
    Renamed("context.branch_reward", "context.fold.branch_reward", 0.0),
    Renamed("env.harness", "env.harness.agent", "", kind=str),  # (first: a table now, where the two below may go)
    Renamed("env.tools", lambda data: f"env.{_data_env(data)}.tools", ""),
    Renamed("env.verifier", lambda data: f"env.{_data_env(data)}.verifier", "exact"),
    Renamed("reward.judge", "reward.judge.target", "", kind=str),  # (first: a table now, where the rest go)
    *(Renamed(f"reward.judge_{key}", f"reward.judge.{key}", default) for key, default in (
        ("weight", 1.0), ("model", ""), ("rubric", ""), ("input", "transcript"), ("reference", False),
        ("max_tokens", 64), ("retries", 2), ("timeout_s", 60.0), ("concurrency", 8), ("cache", ""),
        ("api_key_env", "OPENAI_API_KEY"))),
    *(Renamed(f"meta.demos_{key}", f"meta.demos.{key}", default) for key, default in (
        ("max", 0), ("steps", 0), ("kind", "linear"), ("mode", "count"), ("source", "solve"), ("pool", 64))),
)
"""Every key that was renamed, oldest first."""


def _data_env(data: Mapping[str, Any]) -> str:
    """Whose table ``env.tools`` and ``env.verifier`` move to: ``harness``'s when the config names it (its JSONL
    tasks are played with them), else ``jsonl_tools``'s."""
    env = data.get("env")
    return "harness" if isinstance(env, dict) and env.get("name") == "harness" else "jsonl_tools"


def _summarizer(data: Mapping[str, Any]) -> str:
    """Whose table the old shared summary limits move to: the config's manager when it is ``select`` (which read
    them too), else ``summarize``'s."""
    context = data.get("context")
    manager = context.get("manager") if isinstance(context, dict) else None
    return "select" if manager == "select" else "summarize"

# Names users bring from other libraries, in whatever section they put them: an unknown key that is one gets
# "did you mean <ctxrl key> (TRL's NAME)?" rather than the nearest spelling (learning_rate is not mini_batches).
# Only where the meaning matches; a foreign knob ctxrl lacks is left to the fuzzy suggestion.
ALIASES = {
    # TRL (GRPOConfig and the transformers TrainingArguments it extends)
    "learning_rate": ("train.lr", "TRL"), "num_generations": ("rollout.group_size", "TRL"),
    "beta": ("algo.kl_coef", "TRL"), "max_completion_length": ("rollout.max_new_tokens", "TRL"),
    "per_device_train_batch_size": ("train.micro_batch_size", "TRL"), "num_iterations": ("train.ppo_epochs", "TRL"),
    "epsilon": ("algo.clip_low", "TRL"), "epsilon_high": ("algo.clip_high", "TRL"),
    "loss_type": ("algo.agg", "TRL"), "max_steps": ("train.steps", "TRL"), "report_to": ("report.sinks", "TRL"),
    "save_steps": ("train.checkpoint_every", "TRL"), "eval_steps": ("train.eval_every", "TRL"),
    "save_total_limit": ("train.keep_checkpoints", "TRL"),
    "vllm_gpu_memory_utilization": ("model.gpu_memory_fraction", "TRL"),
    # verl (actor_rollout_ref.*, algorithm.*, data.*)
    "n": ("rollout.group_size", "verl"), "max_response_length": ("rollout.max_new_tokens", "verl"),
    "response_length": ("rollout.max_new_tokens", "verl"), "train_batch_size": ("rollout.tasks_per_step", "verl"),
    "kl_loss_coef": ("algo.kl_coef", "verl"), "kl_loss_type": ("algo.kl_kind", "verl"),
    "clip_ratio": ("algo.clip_low", "verl"), "clip_ratio_low": ("algo.clip_low", "verl"),
    "clip_ratio_high": ("algo.clip_high", "verl"), "clip_ratio_c": ("algo.ppo_clip.dual_clip", "verl"),
    "entropy_coeff": ("algo.entropy_coef", "verl"), "loss_agg_mode": ("algo.agg", "verl"),
    "adv_estimator": ("algo.advantage", "verl"), "total_training_steps": ("train.steps", "verl"),
    "ppo_micro_batch_size_per_gpu": ("train.micro_batch_size", "verl"),
    "ppo_max_token_len_per_gpu": ("train.max_tokens_per_microbatch", "verl"),
    "gpu_memory_utilization": ("model.gpu_memory_fraction", "verl and vLLM"),
    "max_model_len": ("rollout.max_total_tokens", "vLLM"), "max_num_seqs": ("rollout.max_batch_size", "vLLM"),
    # PEFT's LoraConfig
    "r": ("lora.rank", "PEFT"), "lora_r": ("lora.rank", "PEFT"), "lora_alpha": ("lora.alpha", "PEFT"),
    "lora_dropout": ("lora.dropout", "PEFT"),
}


def unknown_key_hint(section: str, key: str, fields: list[str]) -> str:
    """The end of an unknown-key error: the ctxrl key another library's name means (``ALIASES``), else the
    nearest of ``fields`` (``section.field`` names)."""
    if key in ALIASES:
        target, origin = ALIASES[key]
        return f"; did you mean {target} ({origin}'s {key})?"
    return nearest(f"{section}.{key}", fields)


def component_hint(section: str, key: str) -> str:
    """The end of an unknown-key error for a key that is a component's own setting: the tables it belongs in (this
    imports the section's registries, on the error's path only)."""
    from ctxrl.run.components import owners

    tables = owners(section, key)
    return f"; {key} is a setting of {' and '.join(f'[{t}]' for t in tables)}" if tables else ""


@dataclass(frozen=True)
class Config:
    """Everything a run is configured with: one section per table (``ctxrl.sections``), and the components' own
    tables. Building one checks each number against its field's metadata; ``validate`` checks the rest."""

    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    meta: MetaConfig = field(default_factory=MetaConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    roles: RolesConfig = field(default_factory=RolesConfig)
    components: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The tables of registered components' own settings, by ``section.name`` (``[algo.clipped_grpo]``:
    ``ctxrl.settings``), each as its ``Settings`` read it (every field, defaults included)."""

    def __post_init__(self) -> None:
        _check_numbers(self)  # (the rest, which needs the registries, is validate's: from_dict runs it once)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The sections' fields, by section (the components' tables are ``components``)."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in _section_types()}

    def as_record(self) -> dict[str, Any]:
        """Everything the run was configured with, for metric sinks: the sections and the components' tables."""
        return {**self.to_dict(), "components": self.components}

    def settings_of(self, section: str, name: str) -> Any:
        """The ``Settings`` of the component registered as ``name`` in ``section`` (``algo``: estimators,
        ``context``: context managers, ``env``: environments), from its table or its defaults; None when the
        component declares none. An environment of a family (``reasoning_gym:chain_sum``) reads its family's table
        (``ctxrl.run.components.settings_of``)."""
        from ctxrl.run.components import settings_of

        return settings_of(self, section, name)


def _check_numbers(config: Config) -> None:
    """Each number of each section finite and in the range its field declares (``ctxrl.settings.check_number``): a
    ``Config`` built in Python is refused as one read from TOML is, without importing anything."""
    for section in SECTIONS:
        obj = getattr(config, section)
        for f in dataclasses.fields(obj):
            check_number(f"{section}.{f.name}", getattr(obj, f.name), f.metadata, f.default)


def validate(config: Config) -> None:
    """Every check of a whole configuration (``ctxrl.run.validate``); the first problem is a ``ConfigError`` naming
    the key. ``from_dict`` (so ``load_config``) runs it once; a ``Config`` built or replaced in Python is checked
    only for its numbers until it is passed here."""
    from ctxrl.run.validate import validate as check

    check(config)


# -- loading -----------------------------------------------------------------------------------
def _section_types() -> dict[str, type]:
    """Each section's table name and class (``ctxrl.sections.SECTIONS``)."""
    return SECTIONS


def from_dict(data: dict[str, Any]) -> Config:
    """Build a ``Config`` from nested dicts, rejecting unknown or ill-typed keys, and check it (``validate``)."""
    from ctxrl.run.components import COMPONENT_REGISTRIES

    sections = _section_types()
    built: dict[str, Any] = {}
    components: dict[str, dict[str, Any]] = {}
    for name, values in renamed(data).items():
        if name not in sections:
            aliased = [k for k in values if k in ALIASES] if isinstance(values, dict) else []
            hint = unknown_key_hint(name, aliased[0], []) if aliased else nearest(name, list(sections))
            raise ConfigError(f"unknown config section [{name}]{hint}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of fields, got {values!r}")
        cls = sections[name]
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in values.items():
            if name in COMPONENT_REGISTRIES and isinstance(value, dict) and key not in fields:
                components[f"{name}.{key}"] = value  # a component's own table: checked once plugins are imported
                continue
            if key not in fields:
                raise ConfigError(f"unknown config key {name}.{key}" + (
                    component_hint(name, key) or unknown_key_hint(name, key, [f"{name}.{f}" for f in fields])))
            kwargs[key] = coerce(f"{name}.{key}", value, hints[key])
        built[name] = cls(**kwargs)
    config = Config(**built, components=components)
    validate(config)
    return config


def renamed(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (a config's tables, as read) with every key of ``RENAMED`` it names moved to where it lives now
    (a copy: ``data`` is left as it was). The moves are said in one ``DeprecationWarning``; a value at the old key's
    default is dropped without one; old and new set together are a ``ConfigError``."""
    data = copy.deepcopy(dict(data))
    moved = []
    for rename in RENAMED:
        section, _, key = rename.old.partition(".")
        table = data.get(section)
        if not isinstance(table, dict) or key not in table or not isinstance(table[key], rename.kind):
            continue
        value = table.pop(key)
        new = rename.new if isinstance(rename.new, str) else rename.new(data)
        *path, last = new.split(".")
        target: Any = data
        for part in path:  # (found, not made: a value dropped below must not open a table)
            target = target.get(part, {}) if isinstance(target, dict) else None
        if isinstance(target, dict) and last in target:
            raise ConfigError(f"{rename.old} was renamed {new}; the config sets both, keep only {new}")
        if rename.default is not NO_DEFAULT and value == rename.default:
            continue
        target = data
        for part in path:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{rename.old} was renamed {new}, but the config's {part} is not a table")
        target[last] = value
        moved.append((rename.old, new, value))
    if len(moved) == 1:
        old, new, value = moved[0]
        warnings.warn(f"config key {old} was renamed {new}; reading it as {new} = {value!r} (write the new name to "
                      "silence this)", DeprecationWarning, stacklevel=3)
    elif moved:
        said = "; ".join(f"{old} was renamed {new} (read as {new} = {value!r})" for old, new, value in moved)
        warnings.warn(f"config keys were renamed: {said} (write the new names to silence this)", DeprecationWarning,
                      stacklevel=3)
    return data


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.field=value`` -> (section, field, value); the value is a TOML literal or a string."""
    key, sep, raw = text.partition("=")
    if not sep or "." not in key:
        raise ConfigError(f"override {text!r} must look like section.field=value, e.g. train.steps=10")
    section, _, name = key.strip().partition(".")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, name, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML file (or start from defaults) and apply ``section.field=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: malformed TOML: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); a config file is TOML, which is UTF-8") \
                from None
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to read; a config's tables and lists nest a few levels") \
                from None
    for text in overrides:
        section, name, value = parse_override(text)
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ConfigError(f"cannot override {section}.{name}: [{section}] is not a table")
        component, dot, key = name.partition(".")
        if dot:  # section.component.key: the component's own table
            table = data[section].setdefault(component, {})
            if not isinstance(table, dict):
                raise ConfigError(f"cannot override {section}.{name}: {section}.{component} is not a table")
            table[key] = value
        else:
            data[section][name] = value
    return from_dict(data)


def to_toml(config: Config) -> str:
    """The resolved configuration as TOML (round-trips through ``load_config``)."""
    lines = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
        for name, table in sorted(config.components.items()):
            if name.partition(".")[0] == section:
                lines.append(f"[{name}]")
                lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
                lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + "".join(_toml_char(c) for c in str(value)) + '"'


def _toml_char(c: str) -> str:
    """One character of a TOML basic string: backslash, quote and every control character escaped (a raw one would
    make the file unreadable, so that ``--resume`` refused the run's own config)."""
    if c in '\\"':
        return "\\" + c
    if c == "\n":
        return "\\n"
    if c == "\t":
        return "\\t"
    return f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c


def _tables() -> list[tuple[str, type]]:
    """``(key, dataclass)`` of every table the configuration reference lists: the sections, then the settings of
    the components ctxrl ships (``ctxrl.run.components.builtin_tables``; a plugin's are its own to document)."""
    from ctxrl.run.components import builtin_tables

    return [*_section_types().items(), *builtin_tables()]


def resumable_keys() -> frozenset[str]:
    """``section.field`` of every setting that may change on ``--resume`` (``RESUMABLE``), and
    ``section.NAME.field`` of the built-in components' settings that may."""
    return frozenset(f"{key}.{f.name}" for key, cls in _tables() for f in dataclasses.fields(cls) if resumable(cls, f))


def resumable_summary() -> str:
    """``resumable_keys`` for a message: a section (or component table) whose every field is resumable as
    ``section.*``."""
    names = []
    for key, cls in _tables():
        if getattr(cls, "resumable", False):
            names.append(f"{key}.*")
        else:
            names += [f"{key}.{f.name}" for f in dataclasses.fields(cls) if f.metadata.get("resumable", False)]
    return ", ".join(names)


def describe_fields() -> list[tuple[str, str, Any, str]]:
    """(key, type, default, docstring) of every field of the sections, from the docstrings under each field."""
    return [row for section, cls in _section_types().items() for row in _describe(section, cls)]


def describe_components() -> list[tuple[str, str, Any, str]]:
    """(key, type, default, docstring) of every field of the built-in components' own tables (``algo.rae.KEY``)."""
    from ctxrl.run.components import builtin_tables

    return [row for key, cls in builtin_tables() for row in _describe(key, cls)]


def _describe(prefix: str, cls: type) -> list[tuple[str, str, Any, str]]:
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for prev, node in zip(body, body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[prev.target.id] = node.value.value
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        name = hint.__name__ if typing.get_origin(hint) is None else str(hint).replace("typing.", "")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        doc = docs.get(f.name, "")
        if resumable(cls, f):
            doc = doc.rstrip() + " May change on `--resume`."
        out.append((f"{prefix}.{f.name}", name, default, doc))
    return out


def fields_markdown() -> str:
    """The configuration reference as Markdown: the sections' fields, then the built-in components' own tables
    (docs/configuration.md is generated from it)."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [_row(*row) for row in describe_fields()]
    lines += ["", "The tables of ctxrl's own components, each read only by the component its section names "
              "(`algo.advantage`, `context.manager`, `env.name`, `curriculum.kind`; a family's table by every "
              "environment of the family):", "",
              "| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [_row(*row) for row in describe_components()]
    return "\n".join(lines)


def _row(key: str, type_name: str, default: Any, doc: str) -> str:
    return f"| `{key}` | {type_name} | `{_toml_value(default)}` | {' '.join(doc.split())} |"


if __name__ == "__main__":
    print(fields_markdown())
