"""The command line's edges as a new user meets them (issue 53): a typo in a path, a missing config, an override
written as an option, a typo refused before torch is imported, a run of no RL steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ctxrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "examples" / "calculator_tiny.toml")


def test_a_checkpoint_typo_lists_the_checkpoints_near_it(tmp_path, capsys, monkeypatch):
    for name in ("final", "step-000040"):
        (tmp_path / "runs" / "calc" / "checkpoints" / name).mkdir(parents=True)
        (tmp_path / "runs" / "calc" / "checkpoints" / name / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert main(["eval", CONFIG, "--checkpoint", "runs/calc/checkpoints/fnal"]) == 2
    err = capsys.readouterr().err
    assert err == ("ctxrl: model error: runs/calc/checkpoints/fnal does not exist (no file or directory there). "
                   "Checkpoints near it: runs/calc/checkpoints/final, runs/calc/checkpoints/step-000040\n")
    assert not (tmp_path / "runs" / "eval").exists() and sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
        "calc"]  # (no run directory made for an evaluation that cannot start)


@pytest.mark.parametrize("argv, message", [
    (["train"], "ctxrl train needs a TOML config file first, e.g. ctxrl train examples/calculator_tiny.toml"),
    (["train", "train.steps=3"], "(train.steps=3 is an override, not a file)"),
])
def test_train_without_a_config_says_what_to_pass(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, hint", [
    (["config", CONFIG, "--train.steps=3"], "an override takes no dashes: write train.steps=3"),
    (["demo", "--train.steps", "3"], "an override takes no dashes: write train.steps=3"),
])
def test_an_override_written_as_an_option_gets_its_spelling(argv, hint, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and hint in capsys.readouterr().err


def test_a_config_typo_is_refused_without_importing_torch():
    code = ("import sys\nfrom ctxrl.cli import main\nassert main(['config', sys.argv[1], 'trian.steps=3']) == 2\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, CONFIG], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "unknown config section [trian]; did you mean 'train'?" in proc.stderr
    assert proc.stdout.strip() == "False"


def test_a_run_of_no_rl_steps_has_no_after_column(capsys):
    from ctxrl.cli import print_table

    summary = {f"{split}_success_{when}": 0.5 for split in ("train", "heldout", "ood") for when in ("before", "after")}
    summary.update({"gap_heldout_after": 0.0, "gap_ood_after": 0.0, "tool_calls_before": 0.0, "tool_calls_after": 0.0,
                    "run_dir": "runs/x", "steps": 0, "wall_seconds": 3.0, "warm_start": True})
    print_table(summary, stderr=True)
    out, err = capsys.readouterr()
    assert out == "" and "after warm start" in err and "no RL steps" in err
    assert "after RL" not in err and "change" not in err


@pytest.mark.slow  # loads the model and builds the server: 20 s on a 2-core CPU
def test_the_serve_banner_names_the_checkpoint_it_serves(tiny_path, capsys, monkeypatch):
    import socket

    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)  # (the banner comes before it)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", CONFIG, "--checkpoint", tiny_path, "--port", str(port)]) == 0
    err = capsys.readouterr().err
    assert f"ctxrl serve: checkpoint {tiny_path} as model 'tiny' on http://127.0.0.1:{port}/v1" in err


def test_check_env_says_what_passed_in_plain_words(capsys):
    assert main(["check-env", "calculator", "--tasks", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("calculator: OK: the same seed gives the same tasks and openings, every split has tasks")
    assert "what it supports (each needs an optional method of the environment" in out
    assert "seeded sampling" not in out and "hooks enable" not in out
