"""``ctxrl`` command line: argument parsing and printing; the work is ``ctxrl.train.trainer``'s.

Commands: ``demo``, ``train``, ``eval``, ``config``, ``merge``, ``serve``, ``envs``, ``check-env``, ``tools``,
``mcp-serve``, ``report``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ctxrl.config import Config, load_config
from ctxrl.errors import CheckpointError, ConfigError, CtxrlError


def _default_run_dir(config: Config) -> Path:
    return Path("runs") / f"{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _train(config: Config, run_dir: Path, *, resume: bool = False) -> dict[str, Any]:
    """Train with progress on stderr (bars on a terminal, lines elsewhere: ``--json`` keeps stdout for the JSON)."""
    from ctxrl.report.progress import console_progress
    from ctxrl.train.trainer import train

    follower = int(os.environ.get("RANK", "0")) > 0  # a data-parallel learner rank under torchrun: rank 0 reports
    with console_progress(quiet=follower or not config.run.progress) as progress:
        return train(config, run_dir, progress=progress, resume=resume)


def print_table(summary: dict[str, Any], *, stderr: bool = False) -> None:
    """The before/after table of a run and where it is; on stderr with ``--json``, whose stdout is the JSON alone.
    A run of no RL steps has nothing after: one column, the evaluation it made."""
    from rich.console import Console
    from rich.table import Table

    trained = summary["steps"] > 0
    after = "after SFT-only control" if summary.get("objective") == "sft" else "after RL"
    before = "after warm start" if summary.get("warm_start") else "before RL"
    table = Table(title=f"success per split, before vs {after} (greedy)" if trained else f"success per split, "
                  f"{before} (greedy; no RL steps)")
    table.add_column("split")
    table.add_column(before, justify="right")
    if trained:
        table.add_column(after, justify="right")
        table.add_column("change", justify="right")

    def cell(x: float | None, form: str = ".2f") -> str:
        return "-" if x is None else format(x, form)  # "-": a split the environment has no tasks for

    def row(*cells: str) -> None:
        table.add_row(*(cells if trained else cells[:2]))

    for split in ("train", "heldout", "ood"):
        b, a = summary[f"{split}_success_before"], summary[f"{split}_success_after"]
        row(split, cell(b), cell(a), cell(None if a is None or b is None else a - b, "+.2f"))
    for split in ("heldout", "ood"):
        gap = cell(summary[f"gap_{split}_after"], "+.2f")
        row(f"generalisation gap (train - {split})", *(("", gap, "") if trained else (gap,)))
    row("tool calls / episode", cell(summary["tool_calls_before"]), cell(summary["tool_calls_after"]), "")
    console = Console(stderr=stderr)
    console.print(table)
    steps = summary["steps"]
    console.print(f"run directory: {summary['run_dir']}  ({steps} step{'' if steps == 1 else 's'}, "
                  f"{summary['wall_seconds']}s)")


def _run_dir(chosen: str | None, default: Path) -> Path:
    """``--run-dir`` (or ``default``) as a directory made before any work starts: a file, a device or a place no
    directory can be made is one line now, not a traceback after the warm start."""
    path = Path(chosen) if chosen else default
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--run-dir {path} is a file, not a directory; name a directory (a new one, or the run's to "
                          "--resume)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--run-dir {path}: cannot make the directory ({exc.strerror}); name one you can write") \
            from None
    return path


def _config_from_args(path: str | None, args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if getattr(args, "distributed", None):
        overrides.append(f"distributed.backend={args.distributed}")
    return load_config(path, overrides)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.model:  # a named real model: its preset first, so that the command line still overrides it
        from ctxrl.models.loader import resolve_device
        from ctxrl.models.presets import preset_overrides

        where = "gpu" if resolve_device("auto") == "cuda" else "cpu"
        args.overrides = [*preset_overrides(args.model, where), *args.overrides]
    config = _config_from_args(None, args)
    run_dir = _run_dir(args.run_dir, _default_run_dir(config))
    summary = _train(config, run_dir)
    print_table(summary, stderr=args.json)
    if args.json:
        print(json.dumps(summary))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.config is None or ("=" in args.config and not Path(args.config).exists()):
        given = f" ({args.config} is an override, not a file)" if args.config else ""
        raise ConfigError(f"ctxrl train needs a TOML config file first{given}, e.g. ctxrl train "
                          "examples/calculator_tiny.toml train.steps=5 (the examples are in examples/; ctxrl demo "
                          "runs the default configuration without one)")
    config = _config_from_args(args.config, args)
    if args.resume and not args.run_dir:
        raise CheckpointError("--resume needs --run-dir: the directory of the run to continue")
    run_dir = _run_dir(args.run_dir, _default_run_dir(config))
    summary = _train(config, run_dir, resume=args.resume)
    if summary.get("follower"):  # rank > 0 under torchrun: rank 0 prints the run's results
        return 0
    print_table(summary, stderr=args.json)
    if args.json:
        print(json.dumps(summary))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ctxrl.config import to_toml
    from ctxrl.report.writer import RunWriter
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import RolloutWorker
    from ctxrl.run.evaluation import evaluate_splits

    # (a LoRA checkpoint loads as its base with the adapters merged in: nothing to wrap again)
    overrides = [*args.overrides, f"model.name={json.dumps(str(args.checkpoint))}", "sft.enabled=false", "lora.rank=0"]
    config = load_config(args.config, overrides)
    from ctxrl.envs.hooks import available_splits
    from ctxrl.run.preflight import preflight

    have = available_splits(preflight(config, training=False, split=args.split))  # before the checkpoint loads
    run_dir = _run_dir(args.run_dir, _default_run_dir(config).with_name(f"eval-{time.strftime('%Y%m%d-%H%M%S')}"))
    worker = RolloutWorker.from_spec(RolloutSpec.from_config(config))
    from ctxrl.report.sinks import make_sinks

    writer = RunWriter(run_dir, sinks=make_sinks(config.report, run_dir, name=f"eval-{config.run.name}",
                                                 config=config.as_record()), folders=())
    writer.write_config(to_toml(config))
    skipped = [s for s in ("train", "heldout", "ood") if s not in have and not args.split]
    if skipped:
        print(f"note: no {' or '.join(skipped)} tasks: skipped", file=sys.stderr)
        writer.log_metrics({"phase": "note", "step": 0, "skipped_splits": skipped})
    splits = (args.split,) if args.split else tuple(s for s in ("train", "heldout", "ood") if s in have)
    from ctxrl.report.progress import console_progress

    try:
        with console_progress(quiet=not config.run.progress) as progress:
            results = evaluate_splits(worker, config, writer, 0, splits, progress)
    finally:
        worker.close()  # (its MCP servers)
    writer.close()
    table = Table(title=f"evaluation of {args.checkpoint}")
    for column in ("split", "success", "reward", "tool calls/ep", "turns/ep"):
        table.add_column(column)
    for split, r in results.items():
        table.add_row(split, f"{r['success']:.3f}", f"{r['reward']:.3f}", f"{r['tool_calls']:.2f}", f"{r['turns']:.2f}")
    console = Console(stderr=args.json)  # (with --json, stdout is the JSON alone: `ctxrl eval ... --json | jq`)
    console.print(table)
    gaps = {f"gap_{split}": results["train"]["success"] - results[split]["success"]
            for split in ("heldout", "ood") if "train" in results and split in results}
    if gaps:
        console.print("generalisation gap (train - split): "
                        + ", ".join(f"{k[4:]} {v:+.3f}" for k, v in gaps.items()))
    if args.json:
        print(json.dumps({"checkpoint": str(args.checkpoint), **{k: v for k, v in results.items()}, **gaps}))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved configuration and check it (and what it names) without loading a model."""
    config = load_config(args.config, args.overrides)  # (a typo is refused before torch is imported: in a second)
    from ctxrl.config import to_toml
    from ctxrl.run.preflight import preflight

    preflight(config)  # the checks `ctxrl train` runs before it builds or loads a model: valid here is valid there
    print(to_toml(config), end="")
    print(f"# valid: environment {config.env.name!r}, model {config.model.name!r}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from ctxrl.rollout.spec import RolloutSpec, spec_engine
    from ctxrl.rollout.worker import spec_renderer

    try:
        import uvicorn

        from ctxrl.serve.server import Server
    except ImportError as exc:
        raise ConfigError(f"ctxrl serve needs the serve extra ({exc.name} is missing): "
                          "pip install -e '.[serve]'") from None
    api_key = args.api_key or os.environ.get("CTXRL_API_KEY") or None
    if args.train:  # training: the harnesses are in other processes; they claim episodes over HTTP
        from ctxrl.serve.harness import Remote

        Remote.api_key = api_key
        args.overrides = [*args.overrides, "env.name=harness", f'env.harness.agent="remote:{args.port}"']
        if args.checkpoint:
            args.overrides.append(f"model.name={json.dumps(str(args.checkpoint))}")
        args.resume, args.steps, args.json, args.distributed = False, None, False, None
        return cmd_train(args)
    config = load_config(args.config, args.overrides)
    name, aliases = served_names(config.model.name, args.model_name, args.checkpoint)
    if args.checkpoint:  # (a LoRA checkpoint loads as its base with the adapters merged in)
        config = load_config(args.config, [*args.overrides, f"model.name={json.dumps(str(args.checkpoint))}",
                                           "lora.rank=0"])
    from ctxrl.models.prepare import prepare
    from ctxrl.run.preflight import preflight
    from ctxrl.serve.server import MAX_BODY_BYTES, MAX_SESSIONS, RENDERS_PER_CLIENT, bind, check_settings
    from ctxrl.types import MAX_ABS_REWARD

    check_settings(max_total_tokens=config.rollout.max_total_tokens, max_new_tokens=config.rollout.max_new_tokens,
                   max_concurrency=args.max_concurrency, max_body_bytes=MAX_BODY_BYTES,
                   read_timeout_s=args.read_timeout, session_timeout_s=args.session_timeout,
                   max_sessions=MAX_SESSIONS, max_abs_reward=MAX_ABS_REWARD,
                   renders_per_client=RENDERS_PER_CLIENT)  # (a bad setting: one line before any model loads)
    sock = bind(args.host, args.port)  # a port in use: one line now, not after the model loaded
    preflight(config, training=False)
    prepare(config.model.name)  # (a tiny model is built, a GGUF file converted, once)
    spec = RolloutSpec.from_config(config)
    renderer = spec_renderer(spec)
    from ctxrl.models.loader import load_model

    model = load_model(spec.model.name, dtype=spec.model.dtype, device=spec.model.device)
    engine = spec_engine(spec, model, renderer)
    server = Server(engine, renderer, model_name=name, max_total_tokens=config.rollout.max_total_tokens,
                    max_new_tokens=config.rollout.max_new_tokens, stop_ids=tuple(config.rollout.stop_ids),
                    api_key=api_key, max_concurrency=args.max_concurrency, read_timeout_s=args.read_timeout,
                    session_timeout_s=args.session_timeout, aliases=aliases)
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"warning: serving on {args.host} without an API key (--api-key or CTXRL_API_KEY)", file=sys.stderr)
    print(serve_banner(name, args.checkpoint, args.host, args.port), file=sys.stderr)
    uvicorn.Server(uvicorn.Config(server.app(), log_level="warning")).run(sockets=[sock])
    return 0


def serve_banner(name: str, checkpoint: str | None, host: str, port: int) -> str:
    """The line that says what is served where: a checkpoint by its path (the name clients send may still be the
    config's ``tiny``, which would otherwise read as the untrained model)."""
    what = f"checkpoint {checkpoint} as model {name!r}" if checkpoint else f"model {name!r}"
    return f"ctxrl serve: {what} on http://{host}:{port}/v1 (sessions: http://{host}:{port}/sessions/<id>/v1)"


def served_names(model_name: str, chosen: str | None, checkpoint: str | None) -> tuple[str, tuple[str, ...]]:
    """The model name clients send and the other names accepted: ``--model-name``, else the config's
    ``model.name`` (what a client was written against, ``model="tiny"``), with a checkpoint's directory name and
    path (``final``, ``runs/calc/checkpoints/final``) as aliases."""
    name = chosen or model_name
    others = (model_name, Path(checkpoint).name, str(checkpoint)) if checkpoint else (model_name,)
    return name, tuple(n for n in dict.fromkeys(others) if n != name)


def cmd_merge(args: argparse.Namespace) -> int:
    """Merge a LoRA run's adapters into their base: a plain checkpoint to serve."""
    from ctxrl.learner.policy import export_merged
    from ctxrl.run.validate import import_stages

    import_stages()  # (a tiny base is built by its stage: no config was loaded to import it)
    out = args.out or args.out_dir
    if not out:
        raise CtxrlError("ctxrl merge needs where to write the merged checkpoint: ctxrl merge ADAPTERS OUT")
    out = export_merged(args.adapters, out, base=args.base, dtype=args.dtype)
    print(f"merged {args.adapters} into its base: {out}")
    return 0


def cmd_envs(args: argparse.Namespace) -> int:
    """Every registered environment: its tools, its roles and each context parameter's train and OOD ranges."""
    import shutil

    for line in env_listing(shutil.get_terminal_size((80, 24)).columns):
        print(line)
    return 0


def env_listing(width: int) -> list[str]:
    """The lines of ``ctxrl envs``, none wider than ``width`` (at least 60): a block per registered environment
    (a table of six columns wrapped into 150 lines at 80 columns)."""
    import importlib
    import textwrap

    from ctxrl.envs.hooks import hook
    from ctxrl.envs.registry import SCHEMES, get_env_class, list_envs
    from ctxrl.envs.roles import roles_of

    width = max(width, 60)
    lines = [f"{'parameter':<14}{'train':<12}{'ood':<10}meaning"]
    for name in list_envs():
        cls = get_env_class(name)
        if hook(cls, "configure") is not None:  # built from data: nothing to show until configured
            lines += ["", f"{name} (tools: env.{name}.tools)", "  tasks from env.data (JSONL), docs/environments.md"]
            continue
        env = cls()
        tools = ", ".join(t.name for t in env.tools) or "none"
        env.close()
        lines += ["", textwrap.shorten(f"{name} (tools: {tools}; roles: {', '.join(roles_of(cls))})", width,
                                       placeholder="...)")]
        for p in cls.context_space.describe():
            if "choices" in p:
                train, ood = ", ".join(map(str, p["choices"])), "-"
            else:
                train, ood = "{}..{}".format(*p["train"]), "{}..{}".format(*p["ood"])
            meaning = p["description"]
            if len(train) > 11:  # a long list of choices goes with the meaning
                train, meaning = "choices", f"{meaning}: {train}"
            head = f"  {p['name']:<12}{train:<12}{ood:<10}"
            lines += textwrap.wrap(meaning, width, initial_indent=head, subsequent_indent=" " * 36,
                                   break_long_words=True) or [head.rstrip()]
    for prefix, module in sorted(SCHEMES.items()):  # families another package provides, named PREFIX:NAME
        summary = getattr(importlib.import_module(module), "SUMMARY", "")
        lines += ["", textwrap.shorten(f"{prefix}:NAME", width)]
        lines += textwrap.wrap(summary, width, initial_indent="  ", subsequent_indent="  ")
    return lines


def cmd_tools(args: argparse.Namespace) -> int:
    """The tools a run's policy will see: the environment's, its MCP servers' (started to list them), the context
    manager's; each with its description and parameters."""
    from ctxrl.envs.mcp import start_tools
    from ctxrl.rollout.agent import check_tool_names
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import spec_env_class
    from ctxrl.tools.mcp import close_hubs, mcp_hub

    config = load_config(args.config, args.overrides)
    spec = RolloutSpec.from_config(config)
    env_cls = spec_env_class(spec)
    try:
        tools = start_tools(env_cls)
        sources = mcp_hub(spec.env).sources if spec.env.mcp_servers else {}
    finally:
        close_hubs()
    rows = [(t.schema(), "MCP server {} as {!r}".format(*sources[t.name]) if t.name in sources
             else f"environment {config.env.name}") for t in tools]
    manager = spec.train.context.make()
    check_tool_names([t.schema() for t in tools], manager)  # (what the run's first episode would refuse)
    rows += [(schema, f"context manager {config.context.manager}") for schema in manager.tool_schemas]
    if args.json:
        print(json.dumps([{"source": source, **schema} for schema, source in rows]))
        return 0
    if not rows:
        print(f"no tools: environment {config.env.name!r} offers none, and env.mcp_servers is empty")
    for schema, source in rows:
        print("\n".join(tool_lines(schema["function"], source)))
    return 0


def tool_lines(function: dict[str, Any], source: str) -> list[str]:
    """A tool as ``ctxrl tools`` prints it: its name and where it comes from, its description, a line per parameter
    (its JSON type, required or not, its description); a parameter without a plain type shows its schema."""
    lines = [f"{function['name']}  ({source})", f"  {function.get('description') or '(no description)'}"]
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required") or [])
    properties = parameters.get("properties") or {}
    for name, spec in properties.items():
        kind = spec.get("type") if isinstance(spec, dict) else None
        kind = " or ".join(kind) if isinstance(kind, list) else kind
        if kind is None or kind in ("object", "array"):
            kind = json.dumps({k: v for k, v in spec.items() if k != "description"}, sort_keys=True)
        note = f": {spec['description']}" if isinstance(spec, dict) and spec.get("description") else ""
        lines.append(f"    {name} ({kind}{', required' if name in required else ''}){note}")
    if not properties:
        lines.append("    (no parameters)")
    return lines


def cmd_mcp_serve(args: argparse.Namespace) -> int:
    """Serve built-in tools over MCP: stdio (a client starts this command), or streamable HTTP with --port."""
    from ctxrl.tools.builtin import builtin_tools
    from ctxrl.tools.mcp import EXTRA_HINT, require_mcp

    try:
        require_mcp()
    except CtxrlError:
        raise ConfigError(f"ctxrl mcp-serve needs the mcp package, which is not installed: {EXTRA_HINT}") from None
    try:
        tools = builtin_tools(args.tools)
    except KeyError as exc:
        raise ConfigError(f"--tools: {exc.args[0]}") from None
    if not tools:
        raise ConfigError("--tools names no tool; give built-in tools, e.g. --tools calculator,python")
    from ctxrl.tools.mcp_serve import http_app, serve_stdio

    if args.port is None:
        import anyio

        anyio.run(serve_stdio, tools)  # (stdout is the protocol's: nothing else may print there)
        return 0
    import uvicorn

    print(f"ctxrl mcp-serve: {', '.join(t.name for t in tools)} on http://{args.host}:{args.port}/mcp",
          file=sys.stderr)
    uvicorn.run(http_app(tools, args.host), host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """One self-contained HTML page of one run, or a comparison of several (``ctxrl.report.html``)."""
    from ctxrl.report.html import write_report

    for run_dir in args.run_dirs:
        if not (Path(run_dir) / "metrics.jsonl").is_file():
            raise CtxrlError(f"{run_dir} is not a run directory (no metrics.jsonl); pass the --run-dir of a run")
    print(f"wrote {write_report(args.run_dirs, args.out)}")
    return 0


def cmd_check_env(args: argparse.Namespace) -> int:
    """Run the conformance suite on an environment; exit 1 listing every problem."""
    from ctxrl.demos.features import features
    from ctxrl.envs.base import EnvError
    from ctxrl.envs.check import check_env
    from ctxrl.envs.mcp import with_mcp_tools
    from ctxrl.envs.registry import configured_env_class
    from ctxrl.envs.roles import is_multi_role
    from ctxrl.sections import EnvConfig
    from ctxrl.tools.mcp import close_hubs

    try:
        given = {"tools": args.tools} if args.tools else {}  # (jsonl_tools' own settings, as flags)
        given |= {"verifier": args.verifier} if args.verifier != "exact" else {}
        cls = configured_env_class(args.name, {**_settings(args.set), **given}, data=args.data)
        cls = with_mcp_tools(cls, EnvConfig(mcp_servers=list(args.mcp_server)))
    except EnvError as exc:
        print(f"ctxrl: {exc.kind}: {exc}", file=sys.stderr)
        return 2
    notes: list[str] = []
    try:
        problems = check_env(cls, n_tasks=args.tasks, seed=args.seed, notes=notes, tool_format=args.tool_format)
    finally:
        close_hubs()
    enabled = features(cls)
    lengths = _episode_lengths(cls, args) if args.lengths and not problems else None
    if args.json:
        print(json.dumps({"env": args.name, "ok": not problems, "problems": problems, "notes": notes,
                          "features": enabled, **({"lengths": lengths} if lengths else {})}))
        return 1 if problems else 0
    if problems:
        print(f"{args.name}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  - {problem}")
    elif is_multi_role(cls):
        print(f"{args.name}: OK (roles {', '.join(cls.roles)}): the same seed gives the same tasks and openings, "
              f"every split has tasks, every role gets a seat, the scripted play gives each seat its expected "
              f"reward on every split, a finished match refuses another move, closing twice is safe")
    else:
        print(f"{args.name}: OK: the same seed gives the same tasks and openings, every split has tasks, the tool "
              f"schemas are valid, the scripted solution scores 1.0 on every split, a finished episode refuses "
              f"another step, closing twice is safe")
    for note in notes:
        print(f"note: {note}")
    print("what it supports (each needs an optional method of the environment; the list: ctxrl/envs/hooks.py):")
    for name, on in enabled.items():
        print(f"  [{'x' if on else ' '}] {name}")
    if lengths:
        from ctxrl.envs.lengths import lengths_table

        print(f"token lengths of the scripted episodes with {args.lengths}'s tokenizer and chat template "
              f"({args.tasks} tasks per split; a reply also needs rollout.max_new_tokens free):")
        print(lengths_table(lengths))
    elif args.lengths:
        print("token lengths: not measured, the environment has problems (above)")
    return 1 if problems else 0


def _settings(items: list[str]) -> dict:
    """``--set KEY=VALUE`` items as an environment's settings table (values read as TOML, as overrides are)."""
    from ctxrl.config import parse_override

    table = {}
    for item in items:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} must look like KEY=VALUE, e.g. --set tool=calculator")
        table[key.strip()] = parse_override(f"env.{item}")[2]
    return table


def _episode_lengths(cls: type, args: argparse.Namespace) -> dict:
    """``episode_lengths`` with the renderer of the model ``--lengths`` names (a tiny spec that is not
    built yet: its tokenizer twin, built in seconds without pre-training)."""
    from ctxrl.chat.render import ChatRenderer
    from ctxrl.envs.lengths import episode_lengths
    from ctxrl.models.loader import generation_end_ids, load_tokenizer, parse_tiny
    from ctxrl.models.tiny import is_built, tokenizer_twin
    from ctxrl.train.tiny import ensure_tiny

    name = args.lengths
    spec = parse_tiny(name)
    if spec is not None:
        name = str(ensure_tiny(spec if is_built(spec) else tokenizer_twin(spec)))
    renderer = ChatRenderer(load_tokenizer(name), template_name=args.lengths, end_ids=generation_end_ids(name),
                            tool_format=args.tool_format)
    return episode_lengths(cls, renderer, n_tasks=args.tasks, seed=args.seed, tool_format=args.tool_format)


DESCRIPTION = """\
Multi-turn RL for LLM agents that call tools, token-faithful from the sampler to the loss.

A run: an optional supervised warm start on the environment's scripted solutions, an evaluation
on held-out and out-of-distribution tasks, RL steps (collect -> filter -> estimate -> update ->
log; ctxrl/run/step.py), and the evaluation again. Rollouts are played by a RolloutWorker
from plain data (a RolloutSpec built from the config, a RolloutRequest per batch); context
managers, advantage estimators and environments are registered extension points."""

EPILOG = """\
configuration: a TOML file with one table per section, any field overridden as section.field=value
(every field: docs/configuration.md). Layout of the code: docs/architecture.md.
errors: a mistake of yours (a bad config, an unknown environment, a model that does not load) is one
line and exit code 2; --debug (or CTXRL_DEBUG=1) shows its traceback.
exit codes: 0 done, 1 check-env found problems (or ctxrl crashed: its traceback is printed), 2 a
configuration, model or checkpoint error, 3 the run aborted itself, 128+N stopped by signal N
(resumable with --resume)."""

EXAMPLES = {
    "demo": (".venv/bin/ctxrl demo\n  .venv/bin/ctxrl demo --steps 5 eval.tasks=20 --json\n"
             "  .venv/bin/ctxrl demo --model smollm2-135m-instruct"),
    "train": (".venv/bin/ctxrl train examples/calculator_tiny.toml --run-dir runs/calc\n"
              "  .venv/bin/ctxrl train examples/presets/dapo.toml train.steps=100 model.dtype=bfloat16\n"
              "  .venv/bin/ctxrl train examples/calculator_tiny.toml --run-dir runs/calc --resume"),
    "eval": (".venv/bin/ctxrl eval examples/calculator_tiny.toml --checkpoint runs/calc/checkpoints/final "
             "--split heldout"),
    "config": (".venv/bin/ctxrl config examples/calculator_tiny.toml env.name=kv_chain > my.toml\n"
               "  .venv/bin/ctxrl config my.toml context.manager=summarize   # an error names the key to fix"),
    "envs": ".venv/bin/ctxrl envs",
    "serve": (".venv/bin/ctxrl serve examples/calculator_tiny.toml --port 8000\n"
              "  .venv/bin/ctxrl serve examples/calculator_tiny.toml --checkpoint runs/calc/checkpoints/final"),
    "merge": ".venv/bin/ctxrl merge runs/lora/checkpoints/step-000040 runs/lora/merged-40 --dtype bfloat16",
    "check-env": (".venv/bin/ctxrl check-env minesweeper\n"
                  "  .venv/bin/ctxrl check-env fact_hunt --lengths tiny:envs=calculator+fact_hunt\n"
                  "  .venv/bin/ctxrl check-env jsonl_tools --data tasks.jsonl --tools calculator --verifier numeric\n"
                  "  .venv/bin/ctxrl check-env jsonl_tools --data examples/mcp/tasks.jsonl --verifier numeric "
                  "--mcp-server 'python examples/mcp/calculator_server.py'\n"
                  "  .venv/bin/ctxrl check-env mypkg.maze:MazeEnv --json"),
    "tools": (".venv/bin/ctxrl tools examples/mcp/calculator.toml\n"
              "  .venv/bin/ctxrl tools examples/calculator_tiny.toml "
              "env.mcp_servers='[\"http://127.0.0.1:8000/mcp\"]'   # with ctxrl mcp-serve --tools python --port 8000"),
    "mcp-serve": (".venv/bin/ctxrl mcp-serve --tools calculator,python            # stdio, for a client to start\n"
                  "  .venv/bin/ctxrl mcp-serve --tools python --port 8000            # http://127.0.0.1:8000/mcp"),
    "report": (".venv/bin/ctxrl report runs/calc            # writes runs/calc/report.html\n"
               "  .venv/bin/ctxrl report runs/a runs/b --out compare.html"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ctxrl")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctxrl", description=DESCRIPTION, epilog=EPILOG, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ctxrl {_version()}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of errors that are otherwise one line (also CTXRL_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # (in this order in `ctxrl --help`)
    _add_demo_parser(sub)
    _add_train_parser(sub)
    _add_eval_parser(sub)
    _add_config_parser(sub)
    _add_merge_parser(sub)
    _add_serve_parser(sub)
    _add_envs_parser(sub)
    _add_check_env_parser(sub)
    _add_tools_parser(sub)
    _add_mcp_serve_parser(sub)
    _add_report_parser(sub)
    return parser


def _command(sub: argparse._SubParsersAction, name: str, help: str, description: str) -> argparse.ArgumentParser:
    """The subcommand ``name``'s parser, its example (``EXAMPLES``) as the epilog."""
    p = sub.add_parser(name, help=help, description=description, allow_abbrev=False,
                       epilog=f"example:\n  {EXAMPLES[name]}", formatter_class=argparse.RawDescriptionHelpFormatter)
    # --debug after the command as well as before it (`ctxrl train X --debug`)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="section.field=value",
                   help="config overrides, e.g. train.steps=10 model.dtype=bfloat16 (they may follow the options)")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """The options of a command that trains (``demo``, ``train``), and its overrides."""
    p.add_argument("--run-dir", help="run directory (default runs/<run.name>-<time>); new unless --resume")
    p.add_argument("--steps", type=int, help="RL steps (the same as train.steps=N)")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    p.add_argument("--distributed", choices=("none", "ray"),
                   help="where rollouts run (the same as distributed.backend=...; docs/scaling.md)")
    _add_overrides(p)


def _add_demo_parser(sub: argparse._SubParsersAction) -> None:
    demo = _command(sub, "demo", "train the tiny model (or a named real one) on the calculator env and show it improve",
                    "The default configuration on the locally built tiny model (built once, a few minutes on a "
                    "CPU): warm start, evaluation, 40 GRPO steps, evaluation, a before/after table. With --model "
                    "smollm2-135m-instruct: the real SmolLM2-135M-Instruct with its preset (examples/models/), "
                    "smaller on a CPU (docs/real-models.md).")
    demo.add_argument("--model", help="a named real model with a preset: smollm2-135m-instruct")
    _add_run_options(demo)
    demo.set_defaults(fn=cmd_demo)


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    train = _command(sub, "train", "train from a TOML config",
                     "Warm start, evaluate, RL, evaluate; writes runs/NAME/ (config.toml, metrics.jsonl, "
                     "samples.jsonl, checkpoints/, plots/).")
    train.add_argument("config", nargs="?", help="TOML config file, e.g. examples/calculator_tiny.toml")
    train.add_argument("--resume", action="store_true", help="continue the run in --run-dir from checkpoints/latest")
    _add_run_options(train)
    train.set_defaults(fn=cmd_train)


def _add_eval_parser(sub: argparse._SubParsersAction) -> None:
    ev = _command(sub, "eval", "evaluate a checkpoint",
                  "Evaluate a saved model on the config's environment (greedy by default), on the train, held-out "
                  "and OOD splits.")
    ev.add_argument("config", help="TOML config file naming the environment and evaluation settings")
    ev.add_argument("--checkpoint", required=True, help="checkpoint directory (e.g. RUN/checkpoints/final)")
    ev.add_argument("--split", choices=("heldout", "ood", "train"), help="one split only (default: all three)")
    ev.add_argument("--run-dir", help="where to write the evaluation's logs (default runs/eval-<time>)")
    ev.add_argument("--json", action="store_true", help="print the results as one JSON object")
    _add_overrides(ev)
    ev.set_defaults(fn=cmd_eval)


def _add_config_parser(sub: argparse._SubParsersAction) -> None:
    cfg = _command(sub, "config", "print the resolved configuration and check it",
                   "Load a config file with its overrides, check every field, the environment and a local model "
                   "path (no model is loaded), and print the resolved configuration as TOML.")
    cfg.add_argument("config", help="TOML config file")
    _add_overrides(cfg)
    cfg.set_defaults(fn=cmd_config)


def _add_merge_parser(sub: argparse._SubParsersAction) -> None:
    merge = _command(sub, "merge", "merge LoRA adapters into their base model",
                     "Load the base model named in a LoRA checkpoint's adapter_config.json (as the run's config "
                     "named it; --base names another), merge the adapters in and save a plain HF checkpoint "
                     "(with the tokenizer) that any engine can serve. A LoRA run "
                     "writes checkpoints/final-merged itself (lora.export_merged); this does it for any step.")
    merge.add_argument("adapters", help="a directory holding adapter_config.json and adapter_model.safetensors")
    merge.add_argument("out", nargs="?", help="directory to write the merged checkpoint to")
    merge.add_argument("--out", dest="out_dir", help="the same as OUT")
    merge.add_argument("--base", help="the base model's name or path, instead of the one adapter_config.json names "
                       "(tiny:..., a named model, an HF name or a directory): for adapters trained elsewhere")
    merge.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                       help="dtype of the merged weights (default float32)")
    merge.set_defaults(fn=cmd_merge)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = _command(sub, "serve", "an OpenAI- and Anthropic-compatible endpoint that records sessions as episodes",
                     "Serve the config's model (or --checkpoint) with OpenAI's Chat Completions (/v1/chat/completions) "
                     "and Responses (/v1/responses) APIs and Anthropic's Messages API (/v1/messages). A client with "
                     "base_url http://HOST:PORT/sessions/<id>/v1 (Anthropic's: http://HOST:PORT/sessions/<id>) has "
                     "its calls recorded as one token-faithful episode (GET /sessions/<id>/episode; POST "
                     "/sessions/<id>/reward). See docs/serve.md.")
    serve.add_argument("config", help="TOML config file (model, rollout limits)")
    serve.add_argument("--checkpoint", help="checkpoint directory to serve instead of model.name")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", help="require Authorization: Bearer KEY (or x-api-key: KEY) on every route; "
                       "prefer the CTXRL_API_KEY environment variable (a command line is visible to every process)")
    serve.add_argument("--model-name", help="the model name clients send (default: the config's model.name; "
                       "with --checkpoint, its directory name and path are accepted too)")
    serve.add_argument("--max-concurrency", type=int, default=256, help="requests in flight before 429 (default 256)")
    serve.add_argument("--read-timeout", type=float, default=30.0,
                       help="seconds a request's body may take to arrive before 408 (default 30)")
    serve.add_argument("--session-timeout", type=float, default=600.0,
                       help="seconds a session may stay idle before it is closed (default 600)")
    serve.add_argument("--train", action="store_true",
                       help="train on episodes played by harnesses in other processes: they take one with GET "
                            "/train/next and end it with POST /sessions/<id>/finish (env.data names the tasks)")
    serve.add_argument("--run-dir", help="with --train: the run directory (default runs/<run.name>-<time>)")
    _add_overrides(serve)
    serve.set_defaults(fn=cmd_serve)


def _add_envs_parser(sub: argparse._SubParsersAction) -> None:
    envs = _command(sub, "envs", "list environments and their context spaces",
                    "Every registered environment with its tools and the context parameters its tasks vary in "
                    "(train and OOD ranges).")
    envs.set_defaults(fn=cmd_envs)


def _add_check_env_parser(sub: argparse._SubParsersAction) -> None:
    from ctxrl.chat.formats import format_names

    check = _command(sub, "check-env", "run the environment conformance suite",
                     "Drive an environment as a rollout would and list every problem; also print which features "
                     "its optional hooks enable (ctxrl/envs/hooks.py).")
    check.add_argument("name", help="registered name, entry point, package.module:Class, or a family's PREFIX:NAME "
                                     "(reasoning_gym:chain_sum, verifiers:ID)")
    check.add_argument("--tasks", type=int, default=8, help="tasks per split to check (default 8)")
    check.add_argument("--seed", type=int, default=0, help="seed of the tasks drawn (default 0)")
    check.add_argument("--json", action="store_true", help="print the result as one JSON object")
    check.add_argument("--lengths", metavar="MODEL", default="",
                       help="also print the token lengths of scripted episodes (opening, one turn, whole episode) "
                            "with this model's tokenizer and chat template: an HF name, a path or a tiny spec")
    check.add_argument("--data", default="", help="task file, for environments built from data (jsonl_tools)")
    check.add_argument("--tools", default="", help="comma-separated built-in tools (jsonl_tools)")
    check.add_argument("--verifier", default="exact", help="answer check (jsonl_tools): exact, numeric, contains")
    check.add_argument("--mcp-server", action="append", default=[], metavar="COMMAND_OR_URL",
                       help="an MCP server whose tools the environment also offers, as in env.mcp_servers "
                            "(repeat for several; docs/mcp.md)")
    check.add_argument("--tool-format", default="hermes", choices=format_names(),
                       help="the format the gold solutions' tool calls are written in (docs/tool-formats.md)")
    check.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="one of the environment's own settings (its table [env.NAME]; a family's [env.PREFIX]), "
                            "a TOML value, e.g. --set tool=calculator (repeatable)")
    check.set_defaults(fn=cmd_check_env)


def _add_tools_parser(sub: argparse._SubParsersAction) -> None:
    tools = _command(sub, "tools", "list the tools a run's policy will see",
                     "The tools of a config's run, as the policy will see them: the environment's own, its MCP "
                     "servers' (started to list them, then shut down) and its context manager's, each with where "
                     "it comes from, its description and its parameters. No model is loaded.")
    tools.add_argument("config", help="TOML config file")
    tools.add_argument("--json", action="store_true",
                       help="print the tools as one JSON list of the schemas the chat template gets, with a source")
    _add_overrides(tools)
    tools.set_defaults(fn=cmd_tools)


def _add_mcp_serve_parser(sub: argparse._SubParsersAction) -> None:
    from ctxrl.tools.builtin import BUILTIN_TOOLS

    serve = _command(sub, "mcp-serve", "serve ctxrl's built-in tools as an MCP server",
                     "Serve built-in tools (the sandboxed python tool, the calculator) to any MCP client, with the "
                     "schemas, observations and deadlines ctxrl's policies get: over stdio (a client starts this "
                     "command), or streamable HTTP at http://HOST:PORT/mcp with --port (docs/mcp.md).")
    serve.add_argument("--tools", default=",".join(BUILTIN_TOOLS),
                       help=f"comma-separated built-in tools to serve (default: all, {','.join(BUILTIN_TOOLS)})")
    serve.add_argument("--port", type=_port, help="serve streamable HTTP on this port instead of stdio")
    serve.add_argument("--host", default="127.0.0.1", help="with --port: the address to listen on (default loopback)")
    serve.set_defaults(fn=cmd_mcp_serve)


def _port(text: str) -> int:
    """A TCP port from the command line: 1..65535 (a larger number would wrap around to another port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number: use 1-65535")
    return port


def _add_report_parser(sub: argparse._SubParsersAction) -> None:
    report = _command(sub, "report", "an HTML page of a run (or a comparison of runs)",
                      "One self-contained HTML page (no network needed to view it) from run directories' logs: "
                      "success by split, reward, tool calls, context length, entropy / KL / clip fractions, and "
                      "sample episodes with their loss mask. A run writes its own RUN_DIR/report.html too.")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories; two or more are compared")
    report.add_argument("--out", help="the page to write (default: the first RUN_DIR/report.html)")
    report.set_defaults(fn=cmd_report)


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def _option_hint(command: argparse.ArgumentParser, stray: list[str], words: list[str] = ()) -> str:
    """``; did you mean --steps?`` for the first stray option near one of the command's (abbreviations are off:
    ``--step`` is not ``--steps``), or the ``section.field=value`` override a TRL/verl flag means
    (``--learning_rate 1e-5``: ``train.lr=1e-5``), or the override an option-shaped one is (``--train.steps=3``;
    ``words``: the whole command line, where ``--train.steps 3`` finds its value)."""
    import difflib

    from ctxrl.config import ALIASES

    options = [o for o in command._option_string_actions if o.startswith("--")]
    for word in stray:
        if not word.startswith("--"):
            continue
        name = word[2:].partition("=")[0]
        if "." in name and any(a.dest == "overrides" for a in command._actions):  # --train.steps=3
            words = list(words)  # (the command line: `--train.steps 3` leaves its 3 among the positionals)
            following = words[words.index(word) + 1:words.index(word) + 2] if word in words else []
            value = word.partition("=")[2] or "".join(w for w in following if not w.startswith("-")) or "VALUE"
            return f"; an override takes no dashes: write {name}={value}"
        if name.replace("-", "_") in ALIASES:
            target, origin = ALIASES[name.replace("-", "_")]
            return f"; did you mean the override {target}=VALUE ({origin}'s {name})?"
        close = difflib.get_close_matches(word.partition("=")[0], options, n=1, cutoff=0.6)
        if close:
            return f"; did you mean {close[0]}?"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may follow options (`eval CONFIG --checkpoint X train.steps=3`); argparse leaves
    # those unparsed once the positional list has been filled, so collect them here.
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray:
        command = _subparser(parser, args.command)  # its usage, not the top-level one, and a suggestion
        command.error(f"unrecognized arguments: {' '.join(stray)}{_option_hint(command, stray, argv or sys.argv[1:])}")
    if extra:
        if not hasattr(args, "overrides"):
            parser.error(f"{args.command} takes no overrides: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    debug = args.debug or os.environ.get("CTXRL_DEBUG", "") not in ("", "0")
    try:
        return args.fn(args)
    except CtxrlError as exc:
        if debug:
            raise
        print(f"ctxrl: {exc.kind}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from ctxrl.run.health import TrainingAborted
        from ctxrl.run.loop import RunStopped

        if isinstance(exc, TrainingAborted):
            print(f"ctxrl: run aborted: {exc}", file=sys.stderr)
            return 3
        if isinstance(exc, RunStopped):
            print(f"ctxrl: {exc}", file=sys.stderr)
            return exc.exit_code
        raise
    except KeyboardInterrupt:
        print("ctxrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
