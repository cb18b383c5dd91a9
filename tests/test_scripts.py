"""Every benchmark script runs, at tiny sizes on the CPU, so none can rot between GPU sessions.

The experiments are smoke-run by their own tests (tests/test_context.py runs experiments/context.py,
tests/test_meta_experiment.py runs experiments/meta.py). The figures these scripts exist for come
from GPU runs (docs/engine.md, docs/algorithms.md, docs/environments.md); here only that they run
end to end and report what they say they report.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = "tiny:pretrain_steps=0"
SMALL = [f"model.name={TINY}", "sft.demos=4", "sft.epochs=1", "sft.batch_size=4", "eval.tasks=2",
         "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "run.samples_per_step=0"]


def script(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMOKE_RUNS = {  # script -> the test that runs it
    "benchmarks/code_shape.py": "tests/test_scripts.py::test_code_shape_counts_what_it_says",
    "benchmarks/demo_figures.py": "tests/test_scripts.py::test_demo_figures_tells_a_changed_figure_from_wall_clock",
    "benchmarks/episode_figure.py": "tests/test_scripts.py::test_episode_figure_draws_the_trajectories_picture",
    "benchmarks/algo_presets.py": "tests/test_scripts.py::test_algo_presets_trains_a_preset_and_the_claims",
    "benchmarks/async_rollouts.py": "tests/test_scripts.py::test_async_rollouts_runs_both_arms_on_a_local_ray",
    "benchmarks/data_parallel.py": "tests/test_scripts.py::test_data_parallel_runs_one_and_two_ranks_over_gloo",
    "benchmarks/engine_host.py": "tests/test_scripts.py::test_engine_host_times_a_turns_admission_and_parking",
    "benchmarks/engine_throughput.py": "tests/test_scripts.py::test_engine_throughput_checks_and_measures_on_the_cpu",
    "benchmarks/env_training.py": "tests/test_scripts.py::test_env_training_reports_before_and_after",
    "experiments/plan_check.py": "tests/test_plan_check.py::test_a_fair_comparison_passes_a_changed_control_not",
    "experiments/ceilings.py": "tests/test_plan_check.py::test_ceilings_sweeps_managers_and_budgets",
    "experiments/context_rl.py": "tests/test_context_rl.py::test_the_page_holds_the_tables_its_records_give",
    "experiments/repo_tasks_page.py": "tests/test_repo_tasks_page.py::test_the_page_holds_what_the_records_give",
    "experiments/offpolicy.py":
        "tests/test_offpolicy_page.py::test_every_run_finished_and_the_cheap_blocks_are_the_records",
    "experiments/meta_rl.py":
        "tests/test_meta_rl_page.py::test_the_cheap_blocks_are_the_records_and_the_arms_meet_at_step_40",
    "benchmarks/gpu_memory.py": "tests/test_scripts.py::test_gpu_memory_runs_both_modes_without_a_gpu",
    "benchmarks/grpo_step.py": "tests/test_scripts.py::test_grpo_step_smoke_runs_engines_and_learner_on_the_cpu",
    "benchmarks/learner_memory.py": "tests/test_scripts.py::test_learner_memory_runs_every_setting_on_the_cpu",
    "benchmarks/master_grad_add.py": "tests/test_scripts.py::test_master_grad_add_times_both_ways_and_checks_the_sums",
    "benchmarks/reasoning_gym_families.py": "tests/test_scripts.py::test_reasoning_gym_families_checks_and_tabulates",
    "benchmarks/serve_soak.py": "tests/test_scripts.py::test_serve_soak_loses_no_episode_to_hostile_clients",
    "benchmarks/shared_gpu.py": "tests/test_scripts.py::test_shared_gpu_runs_two_trainings_side_by_side_on_the_cpu",
    "benchmarks/shared_prefix.py":
        "tests/test_shared_prefix.py::test_the_benchmark_smoke_runs_every_workload_and_reports_savings",
    "benchmarks/tiny_skills.py": "tests/test_scripts.py::test_tiny_skills_scores_each_format",
    "benchmarks/train_step.py": "tests/test_scripts.py::test_train_step_times_the_real_command_on_the_cpu",
    "experiments/batch.py": "tests/test_batch.py::test_runs_wait_for_builds_and_a_failed_build_skips_its_runs",
    "experiments/judge_tune.py":
        "tests/test_judge_tune.py::test_the_tuned_judge_saves_reloads_as_reward_judge_and_its_verdict_parses",
    "experiments/context.py": "tests/test_context.py::test_context_experiment_runs_end_to_end",
    "experiments/meta.py": "tests/test_meta_experiment.py::test_reflection_experiment_smoke",
    "experiments/selfplay.py": "tests/test_scripts.py::test_selfplay_trains_evaluates_and_rates_checkpoints",
    "experiments/stats.py": "tests/test_tables.py::test_the_bootstrap_over_seeds_is_hand_checked",
    "experiments/claims.py": "tests/test_tables.py::test_the_claims_table_from_a_tiny_claims_file",
    "experiments/tables.py": "tests/test_tables.py::test_collecting_again_replaces_records_and_reports_write_plots",
}


def test_every_script_is_smoke_run_somewhere():
    scripts = {f"{p.parent.name}/{p.name}" for p in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("experiments/*.py")]}
    assert scripts == set(SMOKE_RUNS), "add the new script's smoke test to SMOKE_RUNS"
    for path, test in SMOKE_RUNS.items():
        file, name = test.split("::")
        source = (ROOT / file).read_text()
        loads = f'{Path(path).name}"' in source or f'experiment_module("{Path(path).stem}")' in source
        assert f"def {name}(" in source and loads, test


def test_engine_host_times_a_turns_admission_and_parking(tmp_path):
    report = script("benchmarks/engine_host.py").main(
        ["--tasks", "2", "--samples", "3", "--turns", "3", "--task-tokens", "40", "--turn-tokens", "8",
         "--obs-tokens", "20", "--repeats", "1", "--out", str(tmp_path / "host.json")])
    turns = report["turns"]
    assert [t["turn"] for t in turns] == [0, 1, 2] and all(t["plan_ms"] >= 0 and t["park_ms"] >= 0 for t in turns)
    # turn 0: each task's prompt prefilled once, copied to its other 2 samples; later turns reuse each episode's
    # kept ids (its prompt and all it sampled but the last id)
    assert turns[0]["reused"] == 2 * 2 * 40
    assert turns[1]["reused"] == 6 * (40 + 8 - 1) and turns[2]["reused"] == 6 * (40 + 8 + 20 + 8 - 1)
    assert json.loads((tmp_path / "host.json").read_text())["turns"] == turns


def test_master_grad_add_times_both_ways_and_checks_the_sums(tmp_path, capsys):
    report = script("benchmarks/master_grad_add.py").main(["--smoke", "--out", str(tmp_path / "add.json")])
    assert report["equal"] is True and report["triton_program"] is False  # (the CPU: one add_ a pair)
    assert [r["arm"] for r in report["arms"]] == ["per_parameter", "adder"] and all(r["ms"] > 0 for r in report["arms"])
    assert report["tensors"] == 2 * 12 + 2 and report["elements"] > 0  # (qwen2-test: 2 layers of 12, embedding, norm)
    assert json.loads((tmp_path / "add.json").read_text()) == report
    assert "sums equal: True" in capsys.readouterr().out


def test_engine_throughput_checks_and_measures_on_the_cpu(capsys):
    report = script("benchmarks/engine_throughput.py").main(
        ["--device", "cpu", "--model", TINY, "--dtype", "float32", "--batch-sizes", "1,2", "--prompt-len", "8",
         "--new-tokens", "4", "--repeats", "1"])
    [check] = report["checks"]
    assert check["logprob_max_abs_diff"] < 1e-4 and check["seeded_rows_same_alone_and_batched"] == "2/2"
    assert [r["batch"] for r in report["throughput"]] == [1, 2]
    assert all(r["ctxrl_tok_s"] > 0 and r["hf_generate_tok_s"] > 0 for r in report["throughput"])
    assert "throughput: prompt 8 tokens" in capsys.readouterr().out


def test_algo_presets_trains_a_preset_and_the_claims(tmp_path):
    report = script("benchmarks/algo_presets.py").main(
        ["--out", str(tmp_path), "--steps", "1", "--seeds", "0", "--presets", "gspo", *SMALL])
    assert set(report["presets"]) == {"gspo"} and set(report["claims"]) == {"grpo", "grpo+void_filter", "otc_grpo"}
    assert (tmp_path / "algo_presets.md").read_text().count("| gspo |") == 1
    assert (tmp_path / "algo_claims.png").stat().st_size > 0


def test_env_training_reports_before_and_after(tmp_path, capsys):
    summaries = script("benchmarks/env_training.py").main(
        ["--env", "calculator", "--model", TINY, "--steps", "1", "--out", str(tmp_path), *SMALL])
    assert set(summaries) == {"calculator-s0"} and summaries["calculator-s0"]["steps"] == 1
    assert json.loads((tmp_path / "summary.json").read_text()).keys() == {"calculator-s0"}
    assert "calculator" in capsys.readouterr().out


@pytest.mark.slow  # minutes on a 2-core CPU: out of the default run (`-m slow` runs it)
def test_gpu_memory_runs_both_modes_without_a_gpu(tmp_path):
    rows = script("benchmarks/gpu_memory.py").main(["--smoke", "--out", str(tmp_path)])
    assert [r["mode"] for r in rows] == ["cudnn-allowed", "cudnn-off"]
    assert all(r["wall_seconds"] > 0 for r in rows)


@pytest.mark.slow  # minutes on a 2-core CPU: out of the default run (`-m slow` runs it)
def test_grpo_step_smoke_runs_engines_and_learner_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "grpo_step.json"
    report = script("benchmarks/grpo_step.py").main(
        ["--smoke", "--sections", "decode,agentic,learner", "--decode-arms", "hfengine,fastengine", "--profile",
         "--out", str(out)])
    assert json.loads(out.read_text())["sections"].keys() == {"decode", "agentic", "learner"}
    decode = {r["arm"]: r for r in report["sections"]["decode"]}
    assert [row["batch"] for row in decode["hfengine"]["rows"]] == [2, 4]
    assert all(row["tok_s"] > 0 and row["lp_max"] < 1e-4 for row in decode["hfengine"]["rows"]), decode
    agentic = {r["arm"]: r for r in report["sections"]["agentic"]}
    assert agentic["hfengine"]["prompt_tokens"] == 4 * (8 + (8 + 4 + 5))  # 4 episodes of 2 turns
    for arm in ("fastengine",):  # skipped (with a note) while ctxrl.engine.fast does not import
        assert "skipped" in decode[arm] or all("error" not in row for row in decode[arm]["rows"]), decode[arm]
        assert "skipped" in agentic[arm] or agentic[arm]["episodes_s"] > 0, agentic[arm]
    learners = {r["arm"]: r for r in report["sections"]["learner"]}
    assert learners.keys() == {"padded", "flat"}
    for learner in learners.values():
        assert "error" not in learner and learner["tok_s"] > 0 and learner["mfu"] >= 0, learner
    assert learners["flat"]["flat_vs_hf_logprob_max"] < 1e-4  # the same model through both forward passes
    assert learners["flat"]["loss"] == pytest.approx(learners["padded"]["loss"], abs=1e-5)
    # --profile: one more run of each under the profiler, its wall and busy time (on the CPU: CPU ops' self time;
    # the engine's decode loop runs on its own thread, which the CPU profiler does not follow: CUDA kernels it sees)
    for profiled in [agentic["hfengine"], learners["flat"]]:
        assert profiled["profile_wall_s"] > 0 and profiled["profile_busy_s"] >= 0 and profiled["profile_kernels"] > 0
    assert decode["hfengine"]["rows"][-1]["profile_wall_s"] > 0
    printed = capsys.readouterr().out
    assert "learner: one PPO update" in printed and "profiled: wall" in printed


@pytest.mark.slow  # minutes on a 2-core CPU: out of the default run (`-m slow` runs it)
def test_learner_memory_runs_every_setting_on_the_cpu(capsys):
    rows = script("benchmarks/learner_memory.py").main(
        ["--smoke", "--settings", "legacy,mixed,mixed+ckpt,lora,lora+ckpt"])
    assert [r["setting"] for r in rows] == ["legacy", "mixed", "mixed+ckpt", "lora", "lora+ckpt"]
    assert all("error" not in r and r["skipped"] == 0.0 and r["step_s"] > 0 for r in rows), rows
    full, lora = rows[1], rows[3]
    assert lora["trainable_params"] < full["trainable_params"] and lora["engine_copy_bytes"] < full["engine_copy_bytes"]
    assert "peak GiB" in capsys.readouterr().out


@pytest.mark.slow  # minutes on a 2-core CPU: out of the default run (`-m slow` runs it)
def test_shared_gpu_runs_two_trainings_side_by_side_on_the_cpu(tmp_path, capsys):
    rows = script("benchmarks/shared_gpu.py").main(["--dry-run", "--run-root", str(tmp_path), "--out",
                                                    str(tmp_path / "shared.json")])
    assert [(r["run"], r["rc"]) for r in rows] == [(0, 0), (1, 0)], rows
    assert all(r["wall_s"] > 0 and r["planned_gib"] is None and r["peak_gib"] is None for r in rows)  # no plan on CPU
    assert all((tmp_path / f"run-{i}" / "checkpoints" / "final").is_dir() for i in range(2))
    assert json.loads((tmp_path / "shared.json").read_text())["rows"] == rows
    assert "planned GiB" in capsys.readouterr().out


def test_episode_figure_draws_the_trajectories_picture(tmp_path):
    figure = script("benchmarks/episode_figure.py")
    episode, decode = figure.scripted_example()
    assert episode.success and sum(episode.loss_mask) > 0 and 0 in episode.loss_mask  # sampled and context tokens
    path = figure.main([str(tmp_path / "episode.png")])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_code_shape_counts_what_it_says(tmp_path, capsys):
    shape = script("benchmarks/code_shape.py")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(70))
    (pkg / "a.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n\n\nclass Small:\n    pass\n"
                              "\n\ndef from_config(c):\n    return dict(lr=c.lr, steps=c.train.steps, other=c.steps)\n"
                              "\n\ndef elsewhere(x):\n    return dict(lr=x.lr, n=config.rollout.n)\n")
    assert shape.definitions(pkg, ast.FunctionDef, 60) == [(71, "pkg/a.py:long")]  # def line + 70
    assert shape.definitions(pkg, ast.ClassDef, 2) == []
    assert shape.definitions(pkg, ast.ClassDef, 1) == [(2, "pkg/a.py:Small")]
    # lr and steps in from_config (other=c.steps is not a copy); n through a config name; lr=x.lr elsewhere is not
    assert shape.copied_fields(pkg) == ["pkg/a.py:83 lr", "pkg/a.py:83 steps", "pkg/a.py:87 n"]
    figures = shape.main(["--json"])  # the repository itself
    assert figures["config_fields"] > 100
    # (issue 50 C24: the tests build their runs through build(config, run_dir); no Trainer is left to build)
    assert figures["trainer_constructions_in_tests"] == figures["trainer_constructions_any_form"] == 0
    assert json.loads(capsys.readouterr().out)["classes_over_limit"] == figures["classes_over_limit"]


def test_code_shape_counts_the_copies_it_cannot_see_by_name_and_every_form_of_a_trainer(tmp_path):
    """The figures issue 50 added: config fields handed on under another name, Trainers built through a module or
    an alias, the fields one component reads still declared by a core section, and a comparison with a before."""
    shape = script("benchmarks/code_shape.py")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "config.py").write_text("from dataclasses import dataclass\n\n\n@dataclass\nclass RewardConfig:\n"
                                   "    judge: str = ''\n    outcome: float = 1.0\n\n\n@dataclass\nclass Config:\n"
                                   "    reward: RewardConfig = None\n    components: dict = None\n")
    (pkg / "b.py").write_text("def spec(config, hf):\n    r = config.reward\n"
                              "    return dict(target=r.judge, judge=config.reward.judge, outcome=r.outcome,\n"
                              "                config=hf.config, other=hf.judge)\n")
    assert shape.section_field_keywords(pkg) == [("pkg/b.py:3", "target", "reward.judge"),
                                                 ("pkg/b.py:3", "judge", "reward.judge"),
                                                 ("pkg/b.py:3", "outcome", "reward.outcome")]
    assert shape.copied_fields(pkg) == ["pkg/b.py:3 judge"]  # (config=hf.config hands on a whole config)
    assert shape.component_fields_in_core(pkg) == ["reward.judge"]
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text("from ctxrl.train import trainer\nfrom ctxrl.train.trainer import Trainer as Run"
                                     "\n\nRun(1)\ntrainer.Trainer(2)\nTrainer(3)\nRunner(4)\n")
    assert shape.trainer_constructions_any_form(tests) == ["tests/test_a.py:4", "tests/test_a.py:5",
                                                           "tests/test_a.py:6"]
    assert shape.trainer_constructions(tests) == (1, 1)  # (the narrow figure: a bare Trainer( only)
    assert shape.compare({"classes_over_limit": 2, "largest_classes": []},
                         {"classes_over_limit": 1, "largest_classes": [], "new": 3}) == ["  classes_over_limit: 2 -> 1"]


def test_demo_figures_tells_a_changed_figure_from_wall_clock(tmp_path, capsys):
    figures = script("benchmarks/demo_figures.py")

    def run(name: str, rows: list[dict], weights: bytes) -> Path:
        (tmp_path / name / "checkpoints" / "final").mkdir(parents=True)
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / name / "checkpoints" / "final" / "model.safetensors").write_bytes(weights)
        return tmp_path / name

    before = run("before", [{"step": 1, "loss": -0.41181, "seconds": 3.0, "time_update": 1.0}], b"w")
    slower = run("slower", [{"step": 1, "loss": -0.41181, "seconds": 9.5, "time_update": 7.0}], b"w")
    assert figures.main([str(before), str(slower)]) == []
    assert "the same figures" in capsys.readouterr().out
    assert figures.main([str(before), "--save", str(tmp_path / "before.json")]) == []
    assert figures.main([str(tmp_path / "before.json"), str(slower)]) == []  # (saved figures compare the same)
    changed = run("changed", [{"step": 1, "loss": -0.41182, "seconds": 3.0}], b"v")
    found = figures.main([str(tmp_path / "before.json"), str(changed)])
    assert found[0] == "row 0 loss: -0.41181 -> -0.41182" and found[1].startswith("final weights: sha256 ")
    assert len(found) == 2 and figures.differences(figures.figures(before), figures.figures(run("short", [], b"w"))) \
        == ["metrics.jsonl has 1 rows before and 0 after"]
    assert figures.figures(ROOT / "benchmarks" / "results" / "demo-cpu2-50-before.json")["weights_sha256"] == \
        "414829ab0facf946fd7a24c4e6009ef3dd8c2676e1c9b005490713181820ec30"  # (the demo before issue 50)


@pytest.mark.parametrize("fmt", ["plain", "chat", "chat+system"])
def test_tiny_skills_scores_each_format(fmt):
    module = script("benchmarks/tiny_skills.py")
    if fmt == "plain":
        results = module.main(["--model", TINY, "--tasks", "2", "--threads", "1"])
        assert list(results) == [TINY] and all(0.0 <= x <= 1.0 for x in results[TINY])
    else:
        from ctxrl.envs.calculator import CalculatorEnv
        from ctxrl.models.loader import load_model, load_tokenizer
        from ctxrl.train.tiny import ensure_model

        path = ensure_model(TINY)
        tasks = CalculatorEnv.sample_tasks("heldout", 2, 5)
        assert 0.0 <= module.transcription_accuracy(load_model(path), load_tokenizer(path), fmt, tasks) <= 1.0


@pytest.mark.slow  # minutes on a 2-core CPU: out of the default run (`-m slow` runs it)
def test_async_rollouts_runs_both_arms_on_a_local_ray(capsys):
    pytest.importorskip("ray")
    rows = script("benchmarks/async_rollouts.py").main(["--smoke"])
    assert [r["arm"] for r in rows] == ["sync", "async"]
    assert rows[0]["staleness_max"] == 0.0 and rows[1]["staleness_max"] == 1.0
    assert all(r["steps"] == 2 and r["step_s"] > 0 for r in rows)
    assert "async / sync step time" in capsys.readouterr().out


@pytest.mark.slow  # minutes on a 2-core CPU: out of the default run (`-m slow` runs it)
def test_data_parallel_runs_one_and_two_ranks_over_gloo(tmp_path, capsys):
    rows = script("benchmarks/data_parallel.py").main(["--smoke", "--gpus", "1,2", "--out", str(tmp_path / "dp.json")])
    assert [r["world"] for r in rows] == [1, 2] and all("error" not in r for r in rows), rows
    one, two = rows
    assert sum(two["tokens_per_rank"]) == one["tokens"] == two["tokens"]
    assert two["first_loss"] == pytest.approx(one["first_loss"], abs=1e-6)  # float32: the same loss, two ranks
    assert two["first_grad_norm"] == pytest.approx(one["first_grad_norm"], rel=1e-4)
    assert "learner, data-parallel" in capsys.readouterr().out


def test_serve_soak_loses_no_episode_to_hostile_clients():
    pytest.importorskip("fastapi")
    figures = script("benchmarks/serve_soak.py").main(["--smoke"])
    assert figures["server_alive"] and figures["episodes"] >= 1 and figures["chat_calls"] >= 2
    assert figures["lost"] == 0 and figures["corrupted"] == 0, figures["problems"]
    assert figures["unexpected"] == [] and figures["hostile_requests"] >= 1
    assert all(400 <= int(key.split()[-1]) < 500 for key in figures["hostile_by_status"])
    assert figures["latency_p50_s"] > 0 and figures["rss_start_mb"] > 0


def test_train_step_times_the_real_command_on_the_cpu(tmp_path):
    """``benchmarks/train_step.py`` runs ``python -m ctxrl train`` on a random checkpoint it writes, with the
    fixed-length environment, and reads the step's times back (the GPU arms' sizes are the memory plan's)."""
    bench = script("benchmarks/train_step.py")
    report = bench.main(["--smoke", "--arms", "default", "--cache", str(tmp_path / "cache"),
                         "--out", str(tmp_path / "train_step.json")])
    (arm,) = report["arms"]
    assert "error" not in arm, arm
    assert arm["steps_timed"] == 1 and arm["step_s"] > 0 and arm["rollout_s"] > 0 and arm["update_s"] > 0
    # 4 prompts x 2 completions of exactly 16 tokens (a random policy never stops) after a 16-word prompt
    assert arm["tokens"] >= 4 * 2 * (16 + 16)
    assert arm["micro_batches"] >= 1 and arm["flat_forward"] == 0  # (the CPU trains through HF's pass)
    assert json.loads((tmp_path / "train_step.json").read_text())["arms"][0]["arm"] == "default"
    args = bench.parser().parse_args(["--before-tokens", "3328"])
    assert bench.arm_overrides("before", args)[1][-1] == "train.max_tokens_per_microbatch=3328"
    assert bench.arm_overrides("mine=train.lr=1e-5+rollout.max_batch_size=64", args) == (
        "mine", ["train.lr=1e-5", "rollout.max_batch_size=64"])
    with pytest.raises(SystemExit, match="unknown arm 'fast'"):
        bench.arm_overrides("fast", args)


@pytest.mark.slow  # (two more ctxrl train processes, 30 s on 2 cores; the pool's tests run by default)
def test_train_step_times_partial_rollouts_against_waiting(tmp_path):
    """``--partial``: partial rollouts against waiting on the long-tailed multi-turn environment (docs/scaling.md).
    The pool's bookkeeping is tests/test_partial_rollouts.py's, in the default run."""
    report = script("benchmarks/train_step.py").main(["--smoke", "--partial", "8", "--cache", str(tmp_path / "cache")])
    waiting, partial = report["arms"]
    assert (waiting["arm"], partial["arm"]) == ("waiting", "partial") and "error" not in partial, partial
    assert waiting["trained_episodes"] == 4 * 2 and waiting["token_staleness"] is None  # (a waiting step trains all)
    assert 0 < partial["trained_episodes"] and partial["episodes_per_s"] > 0 and partial["token_staleness"] >= 0


def test_reasoning_gym_families_checks_and_tabulates(tmp_path, capsys):
    pytest.importorskip("reasoning_gym")
    rows = script("benchmarks/reasoning_gym_families.py").main(["--smoke", "--out", str(tmp_path / "families.md")])
    assert [r["family"] for r in rows] == ["chain_sum", "leg_counting"] and not any(r["problems"] for r in rows)
    text = (tmp_path / "families.md").read_text()
    assert "| `chain_sum` | `num_terms` 2..3 / 4..5, `num_digits` 1..2 / 3..4 | OK |" in text
    assert "2 of 2 families pass." in text and text in capsys.readouterr().out


def test_selfplay_trains_evaluates_and_rates_checkpoints(tmp_path, capsys):
    figures = script("experiments/selfplay.py").main(["--smoke", "--out", str(tmp_path)])
    run = figures["runs"]["kuhn_poker-s0"]
    assert run["steps"] == 1 and {"win_rate_vs_random", "win_low_vs_nash", "reward_vs_nash"} <= set(run["after"])
    assert set(figures["elo"]["kuhn_poker-s0"]) == {"step-000000", "step-000001", "random", "nash"}
    assert json.loads((tmp_path / "selfplay.json").read_text())["mean"]["random"]["seeds"] == 1
    collected = script("experiments/selfplay.py").main(["--collect", str(tmp_path)])
    assert collected["win_rate_vs_random"]["runs"] == 1 and "kuhn_poker-s0 Elo: " in capsys.readouterr().out
    scripted = script("experiments/selfplay.py").main(["--baselines", "4"])
    assert set(scripted) == {f"{a} vs {b}" for a in ("random", "nash", "always_bet", "always_check")
                             for b in ("random", "nash")}
    assert all(0 <= s["win_rate"] <= 1 and abs(s["reward"]) <= 2 for s in scripted.values())
