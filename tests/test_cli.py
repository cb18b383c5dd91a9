"""Smoke tests of the command line, in subprocesses, on the random-init tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SMALL = ["model.name=tiny:pretrain_steps=0", "sft.demos=8", "sft.epochs=1", "sft.batch_size=4", "eval.tasks=3",
         "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "run.progress=false"]


def ctxrl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "ctxrl.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_demo_json_smoke(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = ctxrl("demo", "--json", "--steps", "2", "--run-dir", str(run_dir), *SMALL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("heldout_success_before", "heldout_success_after", "ood_success_before", "ood_success_after",
                "steps", "run_dir", "wall_seconds"):
        assert key in summary
    assert summary["steps"] == 2
    assert Path(summary["run_dir"]) == run_dir
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    for key in ("reward", "success", "approx_kl", "clip_frac_low", "clip_frac_high", "entropy", "grad_norm",
                "tokens", "tool_calls", "tool_errors", "time_rollout", "time_update"):
        assert key in rl[0], key
    assert {r["split"] for r in rows if r["phase"] == "eval"} == {"train", "heldout", "ood"}
    assert summary["gap_ood_after"] == summary["train_success_after"] - summary["ood_success_after"]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all({s["mask"] for s in samples[0]["spans"]} <= {0, 1} for _ in [0])
    assert (run_dir / "config.toml").read_text().count("[") >= 8
    assert (run_dir / "checkpoints" / "final" / "model.safetensors").exists()
    assert (run_dir / "plots" / "reward.png").stat().st_size > 0
    assert (run_dir / "plots" / "success.png").stat().st_size > 0

    # The checkpoint evaluates through the same loader.
    proc = ctxrl("eval", str(Path(__file__).parents[1] / "examples" / "calculator_tiny.toml"), "--checkpoint",
                 str(run_dir / "checkpoints" / "final"), "--split", "heldout", "--json", "--run-dir",
                 str(tmp_path / "eval"), "eval.tasks=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "heldout" in json.loads(proc.stdout.strip().splitlines()[-1])


def test_unknown_config_key_is_a_clear_error(tmp_path: Path) -> None:
    proc = ctxrl("demo", "train.stepz=3", cwd=tmp_path)
    assert proc.returncode == 2
    assert "unknown config key train.stepz" in proc.stderr
    assert "'train.steps'" in proc.stderr


def registered_envs() -> list[str]:
    """The environments a fresh interpreter lists (this one may hold test environments registered by other tests)."""
    code = "from ctxrl.envs import list_envs; print(' '.join(list_envs()))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_envs_lists_every_registered_environment_in_80_columns(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    proc = ctxrl("envs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(map(len, lines)) <= 80, [line for line in lines if len(line) > 80]
    headers = [line.split(" (tools:")[0] for line in lines if " (tools: " in line and not line.startswith(" ")]
    assert headers == registered_envs()
    assert "  digits      1..3        4..4      digits in every number of the problem" in lines
    assert len(lines) < 110  # was a table of 150 wrapped lines (100 with issue 56's repo_tasks and two families)


def test_readme_names_every_registered_environment() -> None:
    import re

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    listed = readme[readme.index("Environments: "):].split("\n\n")[0]
    assert sorted(set(re.findall(r"`(\w+)`", listed))) == registered_envs()


def test_the_readme_fits_80_columns() -> None:
    """Prose, lists and the command blocks alike: a README read in a terminal (issue 34)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text().splitlines()
    assert [(n, len(line)) for n, line in enumerate(readme, 1) if len(line) > 80] == []


def test_check_env_passes_and_fails_with_reasons(tmp_path: Path) -> None:
    proc = ctxrl("check-env", "calculator", "--tasks", "4", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {k: result[k] for k in ("env", "ok", "problems")} == {"env": "calculator", "ok": True, "problems": []}
    # which features the environment's hooks enable (ctxrl/envs/hooks.py)
    assert result["features"]["imperfect warm start (shortcut)"] is True
    assert result["features"]["trial demos (failure + reflection)"] is False
    proc = ctxrl("check-env", "minesweeper", "--tasks", "2", cwd=tmp_path)
    assert proc.returncode == 0 and "[x] trial demos (failure + reflection)" in proc.stdout
    # a third-party env by module:Class whose gold solution is wrong
    (tmp_path / "badenv.py").write_text(
        "from ctxrl.envs.calculator import CalculatorEnv\n"
        "class WrongSolver(CalculatorEnv):\n"
        "    name = 'wrong'\n"
        "    @staticmethod\n"
        "    def solve(task, **kwargs):\n"
        "        return ['<answer>-1</answer>']\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "ctxrl.cli", "check-env", "badenv:WrongSolver", "--tasks", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "problem(s)" in proc.stdout and "gold solution" in proc.stdout and "total reward 0.0 != 1.0" in proc.stdout
    proc = ctxrl("check-env", "calculatr", cwd=tmp_path)
    assert proc.returncode == 2 and "did you mean 'calculator'" in proc.stderr


def test_version_config_command_debug_and_no_prefix_matching(tmp_path: Path, capsys, monkeypatch) -> None:
    import pytest

    from ctxrl.cli import main
    from ctxrl.config import ConfigError

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("ctxrl ")
    example = str(Path(__file__).parents[1] / "examples" / "calculator_tiny.toml")
    assert main(["config", example, "env.name=kv_chain", "train.steps=7"]) == 0
    out = capsys.readouterr()
    assert 'name = "kv_chain"' in out.out and "steps = 7" in out.out and "valid" in out.err
    assert main(["config", example, "train.stepz=3"]) == 2  # one line, exit 2
    err = capsys.readouterr().err
    assert err.startswith("ctxrl: config error: unknown config key train.stepz") and err.count("\n") == 1
    with pytest.raises(ConfigError):  # --debug, before or after the command, shows the traceback instead
        main(["config", example, "train.stepz=3", "--debug"])
    with pytest.raises(ConfigError):
        main(["--debug", "config", example, "train.stepz=3"])
    monkeypatch.setenv("CTXRL_DEBUG", "1")
    with pytest.raises(ConfigError):
        main(["config", example, "train.stepz=3"])
    monkeypatch.delenv("CTXRL_DEBUG")
    with pytest.raises(SystemExit) as exit_:  # no abbreviations: --step is not --steps
        main(["demo", "--step", "3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err  # the command's usage, and the option meant
    assert err.startswith("usage: ctxrl demo") and "did you mean --steps?" in err
    with pytest.raises(SystemExit):  # a TRL flag: the override it means
        main(["train", example, "--learning_rate", "1e-5"])
    assert "did you mean the override train.lr=VALUE (TRL's learning_rate)?" in capsys.readouterr().err
    assert "exit codes" in __import__("ctxrl.cli", fromlist=["EPILOG"]).EPILOG


def test_served_model_name_is_the_configs() -> None:
    """``serve --checkpoint RUN/checkpoints/final`` answers to the config's model name (the docs' ``model="tiny"``),
    and to the checkpoint's name and path; ``--model-name`` replaces the first."""
    from ctxrl.cli import served_names

    assert served_names("tiny", None, "runs/calc/checkpoints/final") == (
        "tiny", ("final", "runs/calc/checkpoints/final"))
    assert served_names("tiny", "calc", "runs/c/final") == ("calc", ("tiny", "final", "runs/c/final"))
    assert served_names("Qwen/Qwen2.5-0.5B-Instruct", None, None) == ("Qwen/Qwen2.5-0.5B-Instruct", ())


def test_every_file_a_commands_help_names_exists_and_a_bad_port_is_refused(tmp_path: Path) -> None:
    """The examples ``ctxrl COMMAND --help`` prints name files of the checkout (two named files that never existed
    went unnoticed); ``mcp-serve --port`` outside 1..65535 is refused, not wrapped to another port."""
    import re

    from ctxrl.cli import EXAMPLES

    root = Path(__file__).parents[1]
    pattern = r"(?:examples|tests)/[\w./-]+\.(?:toml|py|jsonl)"
    named = {path for text in EXAMPLES.values() for path in re.findall(pattern, text)}
    assert named and not [p for p in sorted(named) if not (root / p).exists()]
    proc = ctxrl("mcp-serve", "--port", "70000", cwd=tmp_path)
    assert proc.returncode == 2 and "70000 is not a port number: use 1-65535" in proc.stderr
