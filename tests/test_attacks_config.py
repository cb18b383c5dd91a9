"""Config values a run would trip on only later, deep in a traceback, are one ``ConfigError`` at load time, and every
string a config holds writes back as TOML that loads (issue 51)."""

from __future__ import annotations

import pytest
import tomllib

from ctxrl.config import ConfigError, load_config, to_toml


@pytest.mark.parametrize("override, message", [
    ("run.seed=-1", "run.seed must be >= 0, got -1"),
    ("eval.seed=-3", "eval.seed must be >= 0"),
    (f"run.seed={2**64}", "run.seed = 184467440737... (20 digits) is past what a setting can be"),
    (f"train.steps={9**400}", "(382 digits) is past what a setting can be"),
    ("model.device=banana", "model.device='banana' is not a device: use auto, cpu, cuda, cuda:N or mps"),
    ("env.name=os:system", "names builtin_function_or_method 'system', not an environment class"),
    ("env.name=nosuchenv", "env.name: unknown environment 'nosuchenv'"),
    ("model.chat_template={% if %}", "does not parse as a Jinja template"),
    ("model.chat_template=/no/such/template.jinja", "is neither a template (it has no {% or {{) nor an existing file"),
    ("rollout.temperature=1e-320", "rollout.temperature=1e-320 is too small to sample at"),
    ("eval.temperature=1e-9", "eval.temperature=1e-09 is too small"),
    ("run.name=a\ud800b", "run.name holds a lone surrogate"),
])
def test_a_value_that_would_fail_later_is_a_config_error_now(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert message in str(error.value)


def test_a_file_that_is_not_utf8_or_nests_too_deep_is_one_line(tmp_path):
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"[train]\nlr = 1e-4 # \xff\xfe\n")
    with pytest.raises(ConfigError, match="binary.toml: not UTF-8 text"):
        load_config(binary)
    nested = tmp_path / "nested.toml"
    nested.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested.toml: nested too deeply to read"):
        load_config(nested)


def test_control_characters_are_escaped_so_the_runs_config_loads_back(tmp_path):
    config = load_config(None, ["run.name=a\x07b\tc\x1bd\x7fe", 'context.summarize.instruction=say "hi"\\ now'])
    text = to_toml(config)
    assert tomllib.loads(text)["run"]["name"] == "a\x07b\tc\x1bd\x7fe"
    saved = tmp_path / "config.toml"
    saved.write_text(text)
    assert load_config(saved) == config


def test_templates_and_devices_that_are_right_still_load(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    for override in (f"model.chat_template={template}", "model.chat_template={{ messages }}", "model.device=cuda:1",
                     "rollout.temperature=0", "rollout.temperature=0.001", "run.seed=0"):
        load_config(None, [override])


@pytest.mark.parametrize("override", ["run.seed=-1", f"run.seed={2**64}", "model.device=banana", "env.name=os:system",
                                      "model.chat_template={% if %}", "rollout.temperature=1e-320",
                                      "model.chat_template=/no/such.jinja"])
def test_the_cli_says_one_line_and_exits_2_for_each(override, capsys):
    from pathlib import Path

    from ctxrl.cli import main

    example = Path(__file__).resolve().parents[1] / "examples" / "calculator_tiny.toml"
    assert main(["config", str(example), override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ctxrl: config error: ") and err.count("\n") == 1, err
