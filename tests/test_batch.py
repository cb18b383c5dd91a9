"""experiments/batch.py: plans, the scheduler (builds first, slots per GPU, deadline) and packing."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import tarfile
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("batch", Path(__file__).parents[1] / "experiments" / "batch.py")
batch = importlib.util.module_from_spec(_spec)
sys.modules["batch"] = batch  # its dataclasses look their module up
_spec.loader.exec_module(batch)


def write_plan(tmp_path, text: str):
    path = tmp_path / "plan.toml"
    path.write_text(text)
    return path


def fake_build(jobs, code: str = "print('built')"):
    """Replace the model builds' command (a real build pre-trains a model) with ``code``."""
    for job in jobs:
        if job.kind == "build":
            job.argv = [sys.executable, "-c", code]
    return jobs


def test_plan_fills_vars_models_and_out_and_runs_need_their_models(tmp_path):
    plan = write_plan(tmp_path, """
[vars]
steps = "3"
[models]
a = "tiny:seed=0"
b = "tiny:seed=1"
[[run]]
name = "r1"
cmd = "python x.py --model {a} --steps {steps} --out {out}"
[[run]]
name = "r2"
cmd = "python x.py --model {b} --again {b}"
""")
    jobs = batch.load_plan(plan, tmp_path / "out")
    assert [j.name for j in jobs] == ["build-a", "build-b", "r1", "r2"]
    r1, r2 = jobs[2], jobs[3]
    assert r1.argv == [sys.executable, "x.py", "--model", "tiny:seed=0", "--steps", "3", "--out",
                       str(tmp_path / "out" / "runs" / "r1")]
    assert r1.needs == ["build-a"] and r2.needs == ["build-b"]
    assert jobs[0].argv[-1] == "tiny:seed=0" and jobs[0].kind == "build"


@pytest.mark.parametrize("text, message", [
    ('[[run]]\nname = "r"\ncmd = "python x.py {nope}"', "unknown placeholder {nope}"),
    ('[[run]]\nname = "r"\ncmd = "a"\n[[run]]\nname = "r"\ncmd = "b"', "two runs are named 'r'"),
    ('[[run]]\nname = "bad name"\ncmd = "a"', "needs a name"),
    ('[models]\na = "tiny"', "no [[run]] entries"),
    ('[stuff]\nx = 1', "unknown sections ['stuff']"),
    ('[vars]\na = "1"\n[models]\na = "tiny"\n[[run]]\nname = "r"\ncmd = "x"', "both [vars] and [models]"),
    ('[[run]\n', "cannot read plan"),
    ('[[run]]\nname = "a"\nneeds = ["b"]\ncmd = "x"\n[[run]]\nname = "b"\ncmd = "y"', "must list runs named above it"),
    ('[[run]]\nname = "a"\nneeds = "b"\ncmd = "x"', "must list runs named above it"),
])
def test_bad_plans_name_the_problem(tmp_path, text, message):
    with pytest.raises(batch.PlanError, match=message.replace("[", r"\[").replace("{", r"\{").replace("(", r"\(")):
        batch.load_plan(write_plan(tmp_path, text), tmp_path / "out")


def test_runs_wait_for_builds_and_a_failed_build_skips_its_runs(tmp_path):
    plan = write_plan(tmp_path, """
[models]
good = "tiny:seed=0"
bad = "tiny:seed=1"
[[run]]
name = "uses-good"
cmd = "python -c \\"import os; print('gpu', os.environ['CUDA_VISIBLE_DEVICES'])\\" {good}"
[[run]]
name = "uses-bad"
cmd = "python -c pass {bad}"
[[run]]
name = "fails"
cmd = "python -c \\"raise SystemExit(3)\\""
""")
    out = tmp_path / "out"
    jobs = fake_build(batch.load_plan(plan, out))
    jobs[1].argv = [sys.executable, "-c", "raise SystemExit(1)"]  # the build of 'bad' fails
    jobs = batch.run_plan(jobs, out, ["0", "1"], per_gpu=1, minutes=5, poll=0.05)
    states = {j.name: j.state for j in jobs}
    assert states == {"build-good": "done", "build-bad": "failed", "uses-good": "done", "uses-bad": "skipped",
                      "fails": "failed"}
    by_name = {j.name: j for j in jobs}
    assert by_name["uses-good"].started >= by_name["build-good"].ended
    assert by_name["fails"].returncode == 3
    log = (out / "runs" / "uses-good" / "log.txt").read_text()
    assert log.strip() in ("gpu 0", "gpu 1")
    status = json.loads((out / "status.json").read_text())
    assert status["counts"] == {"done": 2, "failed": 2, "skipped": 1}


def test_no_gpu_runs_more_than_per_gpu_at_once(tmp_path):
    runs = "\n".join(f'[[run]]\nname = "r{i}"\ncmd = "python -c \\"import time; time.sleep(0.3)\\""' for i in range(4))
    out = tmp_path / "out"
    jobs = batch.run_plan(batch.load_plan(write_plan(tmp_path, runs), out), out, ["7"], per_gpu=2, minutes=5,
                          poll=0.02)
    assert all(j.state == "done" and j.gpu == "7" for j in jobs)
    spans = sorted((j.started, j.ended) for j in jobs)
    for t, _ in spans:  # at any start, at most 2 runs are alive
        assert sum(1 for s, e in spans if s <= t < e) <= 2


def test_the_deadline_stops_running_jobs_and_skips_waiting_ones(tmp_path):
    runs = "\n".join(f'[[run]]\nname = "r{i}"\ncmd = "python -c \\"import time; time.sleep(60)\\""' for i in range(2))
    out = tmp_path / "out"
    jobs = batch.run_plan(batch.load_plan(write_plan(tmp_path, runs), out), out, ["0"], per_gpu=1,
                          minutes=1.5 / 60, poll=0.05)
    assert [j.state for j in jobs] == ["stopped", "skipped"]
    assert jobs[0].process.wait(timeout=10) is not None  # the process is really gone


def test_pack_leaves_out_weights(tmp_path):
    run = tmp_path / "batch" / "runs" / "r"
    (run / "final").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "final" / "model.safetensors").write_bytes(b"x" * 1000)
    (run / "final" / "config.json").write_text("{}")
    target = batch.pack(tmp_path / "batch", tmp_path / "r.tgz")
    with tarfile.open(target) as tar:
        names = tar.getnames()
    assert "batch/runs/r/metrics.jsonl" in names and "batch/runs/r/final/config.json" in names
    assert not any(n.endswith(".safetensors") for n in names)


def test_only_keeps_matching_runs_and_their_builds(tmp_path, capsys):
    plan = write_plan(tmp_path, """
[models]
a = "tiny:seed=0"
b = "tiny:seed=1"
[[run]]
name = "x-a"
cmd = "python -c pass {a}"
[[run]]
name = "y-b"
cmd = "python -c pass {b}"
""")
    original = batch.load_plan
    batch.load_plan = lambda *a, **k: fake_build(original(*a, **k))
    try:
        code = batch.main(["run", str(plan), "--out", str(tmp_path / "out"), "--gpus", "cpu", "--only", "^x-"])
    finally:
        batch.load_plan = original
    assert code == 0
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert [j["name"] for j in status["jobs"]] == ["build-a", "x-a"]


def test_a_command_that_cannot_start_fails_alone_and_a_deaf_process_is_killed(tmp_path):
    plan = write_plan(tmp_path, """
[[run]]
name = "typo"
cmd = "no-such-program-here -c 1"
[[run]]
name = "deaf"
cmd = "python -c \\"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)\\""
""")
    out = tmp_path / "out"
    jobs = batch.load_plan(plan, out)
    original = batch._stop
    batch._stop = lambda js: original(js, grace=0.5)  # SIGTERM is ignored: SIGKILL after the grace
    try:
        jobs = batch.run_plan(jobs, out, ["0"], per_gpu=2, minutes=5 / 60, poll=0.05)  # time to ignore SIGTERM
    finally:
        batch._stop = original
    typo, deaf = jobs
    log = (out / "runs" / "typo" / "log.txt").read_text()
    assert typo.state == "failed" and "could not start 'no-such-program-here'" in log
    assert deaf.state == "stopped" and deaf.returncode == -9  # killed, and reaped
    status = json.loads((out / "status.json").read_text())
    assert {j["name"]: j["state"] for j in status["jobs"]} == {"typo": "failed", "deaf": "stopped"}


def test_only_that_matches_nothing_is_an_error(tmp_path):
    plan = write_plan(tmp_path, '[[run]]\nname = "a"\ncmd = "python -c pass"')
    with pytest.raises(SystemExit, match="matches no run"):
        batch.main(["run", str(plan), "--out", str(tmp_path / "out"), "--gpus", "cpu", "--only", "zzz"])


def test_the_plans_the_docs_quote_load(tmp_path):
    for plan in sorted((Path(__file__).parents[1] / "experiments" / "plans").glob("*.toml")):
        jobs = batch.load_plan(plan, tmp_path)
        builds = {j.name for j in jobs if j.kind == "build"}
        runs = [j for j in jobs if j.kind == "run"]
        assert runs and all(set(j.needs) <= builds | {r.name for r in runs} for j in runs), plan
        assert all(j.argv[1].startswith(("experiments/", "benchmarks/")) for j in runs), plan


def test_a_run_waits_for_the_runs_it_needs_and_is_skipped_when_one_fails(tmp_path):
    teacher = tmp_path / "teacher.py"  # writes OUT/final after a while
    teacher.write_text("import pathlib, sys, time\ntime.sleep(0.3)\nout = pathlib.Path(sys.argv[1])\n"
                       "out.mkdir(parents=True, exist_ok=True)\n(out / 'final').write_text('t')\n")
    plan = write_plan(tmp_path, f"""
[vars]
teacher = "{teacher}"
""" + """
[[run]]
name = "teacher"
cmd = "python {teacher} {out}"
[[run]]
name = "broken"
cmd = "python -c \\"raise SystemExit(2)\\""
[[run]]
name = "student"
needs = ["teacher"]
cmd = "python -c \\"import pathlib; print(pathlib.Path('{runs}/teacher/final').read_text())\\""
[[run]]
name = "orphan"
needs = ["teacher", "broken"]
cmd = "python -c pass"
""")
    out = tmp_path / "out"
    jobs = batch.load_plan(plan, out)
    assert jobs[2].needs == ["teacher"] and jobs[3].needs == ["teacher", "broken"]
    jobs = {j.name: j for j in batch.run_plan(jobs, out, ["0", "1"], per_gpu=2, minutes=5, poll=0.05)}
    assert {n: j.state for n, j in jobs.items()} == {"teacher": "done", "broken": "failed", "student": "done",
                                                     "orphan": "skipped"}
    assert jobs["student"].started >= jobs["teacher"].ended  # (there was a free slot all along)
    assert (out / "runs" / "student" / "log.txt").read_text().strip() == "t"


def test_set_replaces_a_var_or_model_and_only_brings_what_a_run_needs(tmp_path):
    plan = write_plan(tmp_path, """
[vars]
steps = "30"
[models]
m = "smollm2-135m-instruct"
[[run]]
name = "t"
cmd = "python -c pass {m} {steps}"
[[run]]
name = "s"
needs = ["t"]
cmd = "python -c pass {m} {steps}"
[[run]]
name = "other"
cmd = "python -c pass"
""")
    jobs = batch.load_plan(plan, tmp_path / "out", settings={"m": "tiny:pretrain_steps=0", "steps": "1"})
    assert jobs[0].argv[-1] == "tiny:pretrain_steps=0" and jobs[1].argv[-2:] == ["tiny:pretrain_steps=0", "1"]
    assert batch.needed_by([jobs[2]], jobs) == {"s", "t", "build-m"}
    with pytest.raises(batch.PlanError, match="--set stpes: .* has no such entry under \\[vars\\] or \\[models\\]"):
        batch.load_plan(plan, tmp_path / "out", settings={"stpes": "1"})
    with pytest.raises(SystemExit, match="must look like NAME=VALUE"):
        batch.main(["run", str(plan), "--out", str(tmp_path / "out"), "--gpus", "cpu", "--set", "steps"])


def test_a_plan_can_name_a_real_model_which_is_converted_once():
    """A named real model under [models] is converted (not pre-trained): its build prints the cached directory."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", batch.BUILD, "smollm2-135m-instruct"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    path, last = proc.stdout.split()[-2:]
    assert last == "converted" and (Path(path) / "ctxrl_gguf.json").exists()


def test_a_plans_tiny_model_is_built_by_the_stage(tmp_path):
    """A tiny spec under [models] is built (the library's loader only finds built ones): the build prints the
    cached directory and its pre-training record."""
    import os
    import subprocess

    spec = "tiny:pretrain_steps=0,hidden_size=32,num_layers=1,intermediate_size=64"
    proc = subprocess.run([sys.executable, "-c", batch.BUILD, spec], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CTXRL_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    path, last = proc.stdout.split()[-2:]
    assert last == "None" and (Path(path) / "config.json").exists() and Path(path).parent == tmp_path


def test_each_child_gets_one_gpu_and_its_share_of_the_cores():
    env = batch.child_environment("3", processes=24, cores=64, environ={"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["PATH"] == "/bin"
    assert all(env[name] == "2" for name in batch.THREAD_VARIABLES)  # 64 cores / 24 processes, rounded down
    assert batch.child_environment("0", processes=8, cores=2, environ={})["OMP_NUM_THREADS"] == "1"  # never 0
    mine = batch.child_environment("0", processes=24, cores=64, environ={"OMP_NUM_THREADS": "5"})
    assert mine["OMP_NUM_THREADS"] == "5" and mine["MKL_NUM_THREADS"] == "2"  # the user's own setting stays


def test_each_child_sizes_its_memory_from_its_share_of_the_card():
    from ctxrl.train.memory import GPU_SHARE_VARIABLE

    assert batch.GPU_SHARE_VARIABLE == GPU_SHARE_VARIABLE  # (the script names it without importing ctxrl)
    assert batch.child_environment("0", processes=8, per_gpu=4, environ={})[GPU_SHARE_VARIABLE] == "0.25"
    assert batch.child_environment("0", processes=6, per_gpu=6, environ={})[GPU_SHARE_VARIABLE] == "0.166667"
    assert batch.child_environment("0", processes=1, environ={})[GPU_SHARE_VARIABLE] == "1"
    mine = batch.child_environment("0", processes=8, per_gpu=4, environ={GPU_SHARE_VARIABLE: "0.5"})
    assert mine[GPU_SHARE_VARIABLE] == "0.5"  # the user's own share is kept


def test_a_child_process_sees_its_thread_share(tmp_path):
    show = "import os; print(os.environ['OMP_NUM_THREADS'])"
    plan = write_plan(tmp_path, f'[[run]]\nname = "r"\ncmd = "python -c \\"{show}\\""')
    out = tmp_path / "out"
    jobs = batch.run_plan(batch.load_plan(plan, out), out, ["0"], per_gpu=1, minutes=1, poll=0.02)
    assert jobs[0].state == "done"
    expected = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    assert (out / "runs" / "r" / "log.txt").read_text().strip() == expected


ISSUE38 = Path(__file__).parents[1] / "experiments" / "plans" / "issue38.toml"
TINY38 = {"m": "tiny:pretrain_steps=0", "teacher_steps": "1", "student_steps": "1",
          "smol": "rollout.tasks_per_step=2 rollout.group_size=2 eval.tasks=2 env.max_turns=2 "
                  "rollout.max_new_tokens=8 run.samples_per_step=0",
          "warm": "sft.demos=4 sft.epochs=1 sft.batch_size=4"}
"""The issue-38 plan at tiny size (``--set``): what its CPU smoke runs."""


def test_every_issue38_run_is_a_valid_configuration(tmp_path):
    """Every run's overrides (the judge's and the students' included), as benchmarks/env_training.py reads them."""
    from ctxrl.config import load_config

    jobs = batch.load_plan(ISSUE38, tmp_path / "out")
    arms = {}
    for job in jobs[1:]:
        if "benchmarks/env_training.py" not in job.argv:
            assert job.name == "ca135-b0-s0-tunejudge" and "experiments/judge_tune.py" in job.argv
            continue
        config = load_config(None, [a for a in job.argv if re.match(r"[a-z]+\.[a-z_.]+=", a)])
        arms[job.name.rsplit("-", 1)[1]] = config
    assert arms.keys() == {"verifier", "judge", "rl", "distill", "both", "dense", "denserl", "judgetuned"}
    tuned = tmp_path / "out" / "runs" / "ca135-b0-s0-tunejudge" / "judge"
    judge = {arm: arms[arm].settings_of("reward", "judge").target for arm in ("judge", "judgetuned")}
    assert judge["judgetuned"] == str(tuned) and arms["judgetuned"].reward.outcome == 0
    assert arms["judge"].reward.outcome == 0 and judge["judge"] == "smollm2-135m-instruct"
    assert arms["distill"].settings_of("algo", "distill").outcome == 0
    assert arms["both"].settings_of("algo", "distill").outcome == 1 and not arms["rl"].sft.enabled
    dense, denserl = (arms[a].settings_of("algo", "distill") for a in ("dense", "denserl"))
    assert (dense.coef, dense.outcome, dense.top_k) == (0, 0, 16) and (denserl.outcome, denserl.top_k) == (1, 16)
    teacher = arms["both"].settings_of("algo", "distill").teacher
    assert teacher == str(tmp_path / "out" / "runs" / "ca135-b0-s0-verifier" / "calculator-s0" / "checkpoints" /
                          "final")


@pytest.mark.slow  # two training processes: about 60 s on a busy 2-core CPU
def test_the_issue38_plan_runs_at_tiny_size_on_the_cpu(tmp_path):
    """The teacher run of the plan, then a student distilled from its checkpoint, through batch.py at tiny size."""
    jobs = batch.load_plan(ISSUE38, tmp_path / "out", settings=TINY38)
    keep = [j for j in jobs if j.name in ("ca135-b0-s0-distill", "ca135-b0-s0-dense")]
    jobs = [j for j in jobs if j.name in batch.needed_by(keep, jobs)]
    assert [j.name for j in jobs] == ["build-m", "ca135-b0-s0-verifier", "ca135-b0-s0-distill", "ca135-b0-s0-dense"]
    done = batch.run_plan(jobs, tmp_path / "out", ["cpu"], per_gpu=2, minutes=5, poll=0.2)
    logs = {j.name: (tmp_path / "out" / ("builds" if j.kind == "build" else "runs") / j.name / "log.txt")
            for j in done}
    assert all(j.state == "done" for j in done), {n: p.read_text()[-1500:] for n, p in logs.items()}
    rows = [json.loads(line) for line in (tmp_path / "out" / "runs" / "ca135-b0-s0-distill" / "calculator-s0" /
                                          "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("phase") == "rl" and "teacher_kl" in r for r in rows)
    rows = [json.loads(line) for line in (tmp_path / "out" / "runs" / "ca135-b0-s0-dense" / "calculator-s0" /
                                          "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("phase") == "rl" and r.get("distill_topk_kl", -1.0) >= 0 for r in rows)


def test_several_plans_run_as_one_batch_each_with_its_own_vars(tmp_path):
    one, two = tmp_path / "one.toml", tmp_path / "two.toml"
    one.write_text('[vars]\nsteps = "3"\n[models]\nm = "tiny:seed=0"\n'
                   '[[run]]\nname = "a"\ncmd = "python x.py {m} {steps}"\n')
    two.write_text('[vars]\nsteps = "7"\n[models]\nm = "tiny:seed=0"\n'
                   '[[run]]\nname = "b"\ncmd = "python y.py {m} {steps}"\n')
    jobs = batch.load_plans([one, two], tmp_path / "out", settings={"steps": "1"})
    assert [j.name for j in jobs] == ["build-m", "a", "b"]  # the model both build the same way, built once
    assert jobs[1].argv[-1] == "1" and jobs[2].argv[-1] == "1" and jobs[2].needs == ["build-m"]
    assert [j.argv[-1] for j in batch.load_plans([one, two], tmp_path / "out")[1:]] == ["3", "7"]
    with pytest.raises(batch.PlanError, match="--set stpes: no plan has such an entry"):
        batch.load_plans([one, two], tmp_path / "out", settings={"stpes": "1"})
    with pytest.raises(batch.PlanError, match="a run named 'a' is also in an earlier plan"):
        batch.load_plans([one, one], tmp_path / "out")
    two.write_text('[models]\nm = "tiny:seed=1"\n[[run]]\nname = "b"\ncmd = "python y.py {m}"\n')
    with pytest.raises(batch.PlanError, match="model 'm' is built differently by an earlier plan"):
        batch.load_plans([one, two], tmp_path / "out")
