"""``ctxrl serve``'s own settings from the command line: a bad one, or a port in use, is one line and exit 2 before any
model loads (issue 51)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ctxrl.cli import main

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "calculator_tiny.toml")


@pytest.mark.parametrize("argv, message", [
    (["--port", "99999"], "99999 is not a port number: use 1-65535"),
    (["--port", "http"], "'http' is not a port number"),
    (["--read-timeout", "nan"], "read_timeout_s (--read-timeout) must be a finite number > 0, got nan"),
    (["--max-concurrency", "-1"], "max_concurrency (--max-concurrency) must be a whole number >= 1, got -1"),
    (["--session-timeout", "-5"], "session_timeout_s (--session-timeout)"),
])
def test_a_bad_serve_setting_is_one_line_before_any_model(argv, message, capsys, monkeypatch):
    import ctxrl.models.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    if argv[0] == "--port":  # argparse's own check of the value's form
        with pytest.raises(SystemExit) as exited:
            main(["serve", CONFIG, *argv])
        assert exited.value.code == 2
    else:
        assert main(["serve", CONFIG, *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_port_in_use_is_one_line_and_nothing_says_it_serves(capsys, monkeypatch):
    import ctxrl.models.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", CONFIG, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port} is in use" in err and "ctxrl serve: model" not in err


@pytest.mark.parametrize("run_dir, message", [("/dev/null", "is a file, not a directory"),
                                              ("/proc/1/x", "cannot make the directory")])
def test_a_run_dir_that_cannot_be_one_is_one_line_before_any_work(run_dir, message, capsys, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    for chosen, expected in ((run_dir, message), (str(a_file), "is a file, not a directory")):
        assert main(["train", CONFIG, "--run-dir", chosen, "--steps", "1"]) == 2
        assert expected in capsys.readouterr().err
