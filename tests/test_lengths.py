"""ctxrl.envs.lengths: token lengths of scripted episodes, the figure a context budget is set against."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ctxrl.envs.check import play_solution
from ctxrl.envs.fact_hunt import FactHuntEnv
from ctxrl.envs.lengths import episode_lengths, lengths_table


class CountingRenderer:
    """Ten tokens a message, five for the tool schemas, three for the generation prompt: every figure below
    follows by hand from the messages of the scripted episodes."""

    def prompt_ids(self, messages, tools):
        return [0] * (10 * len(messages) + (5 if tools else 0) + 3)

    def conversation_ids(self, messages, tools):
        return [0] * (10 * len(messages) + (5 if tools else 0))


def test_lengths_follow_from_the_scripted_messages():
    lengths = episode_lengths(FactHuntEnv, CountingRenderer(), n_tasks=4, seed=3, splits=("train", "ood"))
    for split in ("train", "ood"):
        episodes = [play_solution(FactHuntEnv, t, 3)[0] for t in FactHuntEnv.sample_tasks(split, 4, 3)]
        totals = sorted(10 * len(m) + 5 for m in episodes)
        replies = sorted(sum(x.role == "assistant" for x in m) for m in episodes)
        r = lengths[split]
        assert r["opening"] == 10 * 2 + 5 + 3  # system and task, the tools, the generation prompt
        assert r["turn"] == 20  # a read call and its page
        assert r["episode"] == [totals[0], (totals[1] + totals[2]) / 2, totals[-1]]
        assert r["turns"] == (replies[1] + replies[2]) / 2
    assert lengths["ood"]["episode"][0] > lengths["train"]["episode"][0]  # OOD trails are longer
    table = lengths_table(lengths)
    assert table.splitlines()[0].split() == ["split", "opening", "turn", "episode", "min", "/", "median", "/", "max",
                                             "turns"]
    assert table.splitlines()[1].startswith("train          28     20")
    with pytest.raises(ValueError, match="n_tasks must be at least 1"):
        episode_lengths(FactHuntEnv, CountingRenderer(), n_tasks=0)


def test_lengths_cover_only_the_splits_an_environment_has(tmp_path):
    from ctxrl.envs.registry import configured_env_class

    path = tmp_path / "mine.jsonl"  # a task file without OOD tasks: jsonl_tools says so through its splits hook
    path.write_text("\n".join(json.dumps({"prompt": f"What is {a} plus {b}?", "answer": str(a + b)})
                              for a in range(10) for b in range(5)) + "\n")
    env_cls = configured_env_class("jsonl_tools", data=str(path), tools="calculator", verifier="numeric")
    lengths = episode_lengths(env_cls, CountingRenderer(), n_tasks=3)
    assert set(lengths) == {"train", "heldout"} and lengths["train"]["tasks"] == 3


def test_a_tiny_specs_tokenizer_twin_has_its_tokenizer_without_its_pre_training(tmp_path, monkeypatch):
    from ctxrl.models.tiny import TinySpec, tokenizer_twin
    from ctxrl.train.tiny import ensure_tiny

    monkeypatch.setenv("CTXRL_CACHE", str(tmp_path))
    big = TinySpec(envs="calculator+fact_hunt", hidden_size=64, num_layers=2, intermediate_size=128, pretrain_steps=1,
                   pretrain_batch_size=2, pretrain_chat_batch_size=2)  # pre-trained (one step), the twin is not
    twin = tokenizer_twin(TinySpec(envs="calculator+fact_hunt", hidden_size=512, num_layers=8, pretrain_steps=1500))
    assert (twin.hidden_size, twin.pretrain_steps, twin.envs) == (TinySpec().hidden_size, 0, "calculator+fact_hunt")
    a, b = ensure_tiny(big), ensure_tiny(twin)
    assert a != b and (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_check_env_prints_lengths_with_a_tiny_models_tokenizer(tmp_path):
    env = {**os.environ, "CTXRL_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    spec = "tiny:envs=calculator+fact_hunt,hidden_size=512,num_layers=8,pretrain_steps=1500"  # never pre-trained
    proc = subprocess.run([sys.executable, "-m", "ctxrl.cli", "check-env", "fact_hunt", "--tasks", "3", "--json",
                           "--lengths", spec], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lengths = json.loads(proc.stdout.strip().splitlines()[-1])["lengths"]
    assert set(lengths) == {"train", "heldout", "ood"}
    train = lengths["train"]
    assert 100 < train["opening"] < train["episode"][0] <= train["episode"][1] <= train["episode"][2]
    built = [json.loads((p / "ctxrl_tiny.json").read_text()) for p in (tmp_path / "cache").iterdir()
             if p.is_dir()]  # (the build's lock file sits beside the models)
    assert [(b["hidden_size"], b["pretrain_steps"]) for b in built] == [(128, 0)]  # only the twin was built
    proc = subprocess.run([sys.executable, "-m", "ctxrl.cli", "check-env", "fact_hunt", "--tasks", "2", "--lengths",
                           str(tmp_path / "missing")], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
