"""ConsoleProgress: stages that end stop their clocks and say done; the RL line fits the terminal."""

import io

import pytest
from rich.console import Console

from ctxrl.report.progress import ConsoleProgress, fit_fields

FIGURES = ["reward 0.50", "success 0.50", "heldout 0.80", "tools/ep 1.00", "12.3s/step"]


def _progress(width: int) -> ConsoleProgress:
    return ConsoleProgress(console=Console(width=width, record=True, file=io.StringIO(), force_terminal=False))


def test_a_stage_ends_when_the_next_starts_or_when_it_is_complete():
    progress = _progress(80)
    progress.stage("tiny model: tokenizer", 0, 0)
    progress.stage("tiny model: pre-training data", 0, 0)
    tokenizer = progress.bars.tasks[0]
    assert tokenizer.finished and tokenizer.stop_time is not None and tokenizer.fields["info"] == "done"
    progress.stage("tiny model: pre-training", 3, 5)
    progress.stage("tiny model: pre-training", 5, 5)
    assert all(task.finished and task.stop_time is not None for task in progress.bars.tasks)
    progress.close()
    text = progress.console.export_text()
    assert "0/?" not in text and text.count("done") == 3


def test_close_stops_clocks_without_calling_unfinished_work_done():
    progress = _progress(80)
    progress.stage("eval (step 0, heldout)", 2, 10)
    progress.close()
    task = progress.bars.tasks[0]
    assert task.stop_time is not None and not task.finished and task.fields["info"] == ""


@pytest.mark.parametrize("width", [60, 80, 120, 200])
def test_the_rl_line_fits_the_terminal(width):
    progress = _progress(width)
    progress.rl_start("RL (grpo, ppo_clip)", 40, 0)
    for _ in range(3):
        progress.rl_step(FIGURES)
    progress.close()
    lines = [line for line in progress.console.export_text().splitlines() if line.strip()]
    assert len(lines) == 1 and len(lines[0]) <= width, lines
    assert lines[0].startswith("RL (grpo, ppo_clip)") and "3/40" in lines[0]
    if width >= 80:
        assert "reward 0.50 success 0.50" in lines[0]
    if width >= 200:
        assert "12.3s/step" in lines[0]


@pytest.mark.parametrize("width", [80, 100])
def test_a_whole_run_fits_with_its_clocks_whole(width):
    progress = _progress(width)
    for step in range(1, 15):
        progress.sft(step, 14, 0.581)
    for split in ("train", "heldout", "ood"):
        for done in range(11):
            progress.stage(f"eval (step 0, {split})", done, 10)
    progress.rl_start("RL (grpo, ppo_clip)", 40, 0)
    for _ in range(40):
        progress.rl_step(FIGURES)
    for done in range(11):
        progress.stage("eval (step 40, heldout)", done, 10)
    progress.close()
    lines = [line for line in progress.console.export_text().splitlines() if line.strip()]
    assert len(lines) == 6 and all(len(line) <= width for line in lines), lines
    assert all(line.count("0:00:") == 2 for line in lines), lines  # elapsed and remaining, not cut to "0:00:…"
    assert "reward 0.50 success 0.50" in lines[4]


def test_fit_fields_keeps_the_first_that_fit():
    assert fit_fields(FIGURES, 24) == "reward 0.50 success 0.50"
    assert fit_fields(FIGURES, 5) == ""


@pytest.mark.parametrize("warm_start", [True, False])
def test_the_summary_table_says_what_the_first_column_is_and_counts_steps_in_words(warm_start, capsys):
    from ctxrl.cli import print_table

    summary = {f"{split}_success_{when}": 0.5 for split in ("train", "heldout", "ood") for when in ("before", "after")}
    summary.update({"gap_heldout_after": 0.0, "gap_ood_after": 0.0, "tool_calls_before": 0.0, "tool_calls_after": 1.0,
                    "run_dir": "runs/x", "steps": 1, "wall_seconds": 3.0, "warm_start": warm_start})
    print_table(summary)
    out = capsys.readouterr().out
    assert ("after warm start" in out) == warm_start and ("before RL" in out) != warm_start
    assert "(1 step, 3.0s)" in out


class _Clock:
    """A stand-in for ``time.monotonic`` that the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_progress_is_plain_lines_with_an_eta():
    from ctxrl.report.progress import LineProgress, console_progress

    stream = io.StringIO()
    assert isinstance(console_progress(stream=stream), LineProgress)  # a pipe, a log file, a notebook's stream
    clock = _Clock()
    progress = LineProgress(stream, clock=clock)
    progress.message("[bold]ctxrl[/bold] run dir runs/x")
    progress.stage("tiny model: tokenizer", 0, 0)
    clock.now = 4
    progress.stage("tiny model: pre-training", 0, 100)
    for done in range(1, 101):  # 2 s a step: a line when a tenth more is done and 10 s have passed
        clock.now += 2
        progress.stage("tiny model: pre-training", done, 100)
    progress.rl_start("RL (grpo, ppo_clip)", 4, 0)
    for _ in range(2):
        clock.now += 30
        progress.rl_step(["reward 0.50", "success 0.25", "30.0s/step"])
    progress.errored("step 2", 5, 64, "environment reset: RuntimeError: boom\nTraceback ...")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[:4] == ["ctxrl run dir runs/x", "tiny model: tokenizer: started", "tiny model: tokenizer: done in 4s",
                         "tiny model: pre-training: 10/100 after 20s, eta 3:00"]
    assert lines[12] == "tiny model: pre-training: 100/100 done in 3:20"
    assert lines[13:] == ["RL (grpo, ppo_clip): 4 steps",
                          "step 1/4: reward 0.50 success 0.25 30.0s/step | 30s, eta 1:30",
                          "step 2/4: reward 0.50 success 0.25 30.0s/step | 1:00, eta 1:00",
                          "step 2: 5 of 64 episodes errored: environment reset: RuntimeError: boom"]
    assert not any("\x1b" in line for line in lines)  # no escape codes in a log file


def test_a_quick_stage_off_a_terminal_is_one_line():
    from ctxrl.report.progress import LineProgress

    stream, clock = io.StringIO(), _Clock()
    progress = LineProgress(stream, clock=clock)
    for done in range(11):
        clock.now += 0.5
        progress.stage("eval (step 0, heldout)", done, 10)
    progress.sft(1, 2, 0.9)
    progress.close()  # the warm start did not finish: not called done
    assert stream.getvalue().splitlines() == ["eval (step 0, heldout): 10/10 done in 5s"]
