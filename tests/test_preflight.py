"""Every command checks its config, environment, splits, files and optional packages before any model work.

The model loaders and the tiny-model builder are replaced by functions that fail the test if called: a mistake
must be reported (exit 2, one line) before a model is built, converted, downloaded or loaded. ``ctxrl config``
runs the same checks, so it never calls valid what ``ctxrl train`` refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxrl.cli import main

EXAMPLE = str(Path(__file__).parents[1] / "examples" / "calculator_tiny.toml")


@pytest.fixture
def no_model_work(monkeypatch):
    """Building, resolving or loading a model fails the test."""
    import ctxrl.models.loader
    import ctxrl.train.tiny

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built or loaded before the config was checked")

    for module, name in ((ctxrl.train.tiny, "ensure_model"), (ctxrl.train.tiny, "ensure_tiny"),
                         (ctxrl.models.loader, "load_model"), (ctxrl.models.loader, "load_tokenizer"),
                         (ctxrl.models.loader, "resolve")):
        monkeypatch.setattr(module, name, refuse)


def _tasks_without_ood(tmp_path: Path) -> Path:
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 = ?", "answer": str(i + 1), "split": split}) + "\n"
                            for i, split in enumerate(["train", "train", "heldout"])))
    return data


def _checkpoint(tmp_path: Path) -> Path:
    """A directory that looks like a checkpoint (the checks read no weights)."""
    path = tmp_path / "final"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"")
    return path


def _refused(capsys, argv: list[str], *expected: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()  # (a progress bar that started leaves a blank line)
    assert err.startswith("ctxrl: ") and "\n" not in err, err
    for text in expected:
        assert text in err, err


@pytest.mark.parametrize("command", ["train", "config", "demo", "serve"])
def test_unknown_environment_before_any_model(command, tmp_path, capsys, no_model_work) -> None:
    argv = [command] if command == "demo" else [command, EXAMPLE]
    if command in ("train", "demo"):
        argv += ["--run-dir", str(tmp_path / "run")]
    _refused(capsys, [*argv, "env.name=nope"], "'nope'")


def test_eval_split_the_environment_lacks(tmp_path, capsys, no_model_work) -> None:
    data = _tasks_without_ood(tmp_path)
    _refused(capsys, ["eval", EXAMPLE, "--checkpoint", str(_checkpoint(tmp_path)), "--split", "ood",
                      "--run-dir", str(tmp_path / "eval"), "env.name=jsonl_tools", f"env.data={data}",
                      "env.jsonl_tools.tools=calculator"], "--split ood", "no 'ood' tasks", "train, heldout")
    assert not (tmp_path / "eval").exists()  # nothing written either


@pytest.mark.parametrize("command", ["train", "config"])
def test_missing_sink_package(command, tmp_path, capsys, monkeypatch, no_model_work) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    argv = [command, EXAMPLE, "report.sinks=jsonl,wandb"]
    _refused(capsys, argv + (["--run-dir", str(tmp_path / "run")] if command == "train" else []),
             "report.sinks has wandb", "wandb package is not installed", ".[wandb]")
    assert "valid" not in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "config", "eval", "serve"])
def test_missing_data_file(command, tmp_path, capsys, no_model_work) -> None:
    argv = [command, EXAMPLE, "env.name=jsonl_tools", f"env.data={tmp_path / 'missing.jsonl'}",
            "env.jsonl_tools.tools=calculator"]
    if command == "train":
        argv += ["--run-dir", str(tmp_path / "run")]
    if command == "eval":
        argv += ["--checkpoint", str(_checkpoint(tmp_path))]
    _refused(capsys, argv, "missing.jsonl", "does not exist")


def test_missing_demonstration_file(tmp_path, capsys, no_model_work) -> None:
    _refused(capsys, ["config", EXAMPLE, "meta.demos.max=1", "meta.demos.steps=5",
                      f"meta.demos.source={tmp_path / 'demos.jsonl'}"], "meta.demos.source", "does not exist")


def test_existing_run_dir_refused_before_the_model(tmp_path, capsys, no_model_work) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    _refused(capsys, ["train", EXAMPLE, "--run-dir", str(run)], "already holds a run")
    _refused(capsys, ["train", EXAMPLE, "--run-dir", str(tmp_path / "none"), "--resume"], "holds no run")


def test_hub_name_fails_fast(monkeypatch, tmp_path) -> None:
    """A hub name not in the cache: one lookup without retries, and a message that says what to do."""
    import huggingface_hub

    monkeypatch.chdir(tmp_path)  # (no checkpoint of the working tree near the path that does not exist)

    from ctxrl.models.loader import ModelLoadError, check_available

    calls = []

    def unreachable(self, name, **kwargs):
        calls.append(kwargs.get("timeout"))
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    with pytest.raises(ModelLoadError, match="hub cannot be reached.*hf download nope-org/nope-model"):
        check_available("nope-org/nope-model")
    assert calls == [10]
    with pytest.raises(ModelLoadError, match=r"^runs/x/checkpoints/final does not exist \(no file or directory "
                                             r"there\)\. No checkpoint directory is near it\.$"):
        check_available("runs/x/checkpoints/final")  # a relative path that does not exist: no hub lookup, no jargon
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        check_available("nope-org/nope-model")
    assert len(calls) == 1

