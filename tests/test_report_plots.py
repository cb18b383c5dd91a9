"""ctxrl.report.plots: each quantity on its own chart, evaluations as points, tool calls plotted."""

import json

from ctxrl.report.html import Run
from ctxrl.report.plots import plot_run, reward_figure, success_figure, tool_calls_figure


def _run_dir(tmp_path):
    rows = [{"phase": "eval", "step": 0, "split": "train", "success": 0.1, "tool_calls": 0.0},
            {"phase": "eval", "step": 0, "split": "heldout", "success": 0.2, "tool_calls": 0.0}]
    rows += [{"phase": "rl", "step": s, "reward": 0.5 * s, "success": 0.25 * s, "tool_calls": 1.0,
              "tool_errors": 0.0} for s in (1, 2, 3)]
    rows += [{"phase": "eval", "step": 3, "split": "train", "success": 0.9, "tool_calls": 1.0},
             {"phase": "eval", "step": 3, "split": "heldout", "success": 0.8, "tool_calls": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_reward_and_success_are_separate_charts(tmp_path):
    run = Run(_run_dir(tmp_path))
    reward = reward_figure(run).axes
    assert len(reward) == 1
    assert [line.get_label() for line in reward[0].get_lines()] == ["train reward"]
    assert list(reward[0].get_lines()[0].get_ydata()) == [0.5, 1.0, 1.5]
    success = success_figure(run).axes
    assert len(success) == 1
    labels = [line.get_label() for line in success[0].get_lines()]
    assert labels == ["training rollouts (sampled)", "train: greedy evaluation", "heldout: greedy evaluation"]


def test_evaluations_are_points_not_a_line(tmp_path):
    lines = success_figure(Run(_run_dir(tmp_path))).axes[0].get_lines()
    train_rollouts, train_eval = lines[0], lines[1]
    assert train_rollouts.get_linestyle() == "-"
    assert train_eval.get_linestyle() == "None" and train_eval.get_marker() == "o"
    assert list(train_eval.get_xdata()) == [0, 3] and list(train_eval.get_ydata()) == [0.1, 0.9]


def test_tool_calls_are_plotted(tmp_path):
    lines = tool_calls_figure(Run(_run_dir(tmp_path))).axes[0].get_lines()
    assert [line.get_label() for line in lines][:2] == ["tool calls (train)", "tool errors (train)"]
    assert list(lines[0].get_ydata()) == [1.0, 1.0, 1.0]


def test_plot_run_writes_three_pngs_and_an_empty_run_still_plots(tmp_path):
    (tmp_path / "a").mkdir()
    paths = plot_run(_run_dir(tmp_path / "a"))
    assert [p.name for p in paths] == ["reward.png", "success.png", "tool_calls.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("")
    assert len(plot_run(tmp_path / "b")) == 3
