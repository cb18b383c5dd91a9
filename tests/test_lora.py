"""LoRA through PEFT: only adapters train; the engine shares the frozen base; PEFT loads what ctxrl saves."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from ctxrl.config import ConfigError, load_config
from ctxrl.engine.base import SamplingParams
from ctxrl.engine.hf import HFEngine
from ctxrl.models.loader import load_model
from ctxrl.train.batch import collate
from ctxrl.train.learner import Learner, PPOSettings
from ctxrl.train.logprobs import token_logprobs
from ctxrl.train.policy import Policy, export_merged
from ctxrl.types import Episode, Task

LORA = ["lora.rank=4", "lora.alpha=8", "model.device=cpu"]


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    rows = []
    for n, p in ((20, 5), (16, 6), (26, 8)):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        rows.append(Episode(task=Task(id="t", prompt="p", answer="a"), input_ids=ids, loss_mask=[0] * p + [1] * (n - p),
                            behavior_logprobs=[0.0] * p + [-7.0] * (n - p), turn_index=[0] * n))
    return collate(rows, 0, advantages=[1.0, -1.0, 0.5])


@pytest.fixture
def trained(tiny_path):
    """A LoRA policy after a few updates (adapters non-zero), its engine copy, and the base for comparison."""
    policy = Policy.load(load_config(None, LORA), "cpu")
    engine_model = policy.engine_model()
    learner = Learner(policy.model, policy.precision.optimizer(policy.trainable_parameters(), lr=1e-2),
                      PPOSettings(mini_batches=1), pad_token_id=0, precision=policy.precision)
    for _ in range(3):
        learner.update(_batch(policy.model.config.vocab_size))
    return policy, engine_model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


IDS = torch.tensor([[4, 9, 17, 33, 60, 11, 5, 8]])


def test_only_adapters_train_and_the_base_is_unchanged(trained, tiny_path):
    policy, _ = trained
    base = load_model("tiny")
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
    frozen = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
              for n, p in policy.model.named_parameters() if not p.requires_grad}
    for name, p in base.named_parameters():
        assert torch.equal(frozen[name], p), name
    # the adapters moved the policy away from the base
    assert not torch.allclose(_logits(policy.model, IDS), _logits(base, IDS))


def test_the_engine_shares_the_base_and_samples_with_the_synced_adapters(trained):
    policy, engine_model = trained
    shared = {p.data_ptr() for p in policy.model.parameters() if not p.requires_grad}
    engine_frozen = {n: p for n, p in engine_model.named_parameters() if "lora_" not in n}
    assert all(p.data_ptr() in shared for p in engine_frozen.values())  # the base is held once
    engine = HFEngine(engine_model, pad_token_id=0)
    state, partial = policy.engine_state()
    assert partial and state and all("lora_" in n for n in state)
    engine.load_weights(state, version=3, partial=True)
    prompt = IDS[0].tolist()
    completion = asyncio.run(engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=6, seed=4)))
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        learner = token_logprobs(policy.model, ids, torch.ones_like(ids))[0, len(prompt) - 1:]
    torch.testing.assert_close(torch.tensor(completion.logprobs), learner, atol=1e-4, rtol=0)
    with pytest.raises(KeyError, match="no tensors"):
        engine.load_weights({"not.a.weight": torch.zeros(1)}, version=4, partial=True)


def test_the_reference_is_the_base_with_adapters_off(trained):
    policy, _ = trained
    base = load_model("tiny")
    ids = IDS
    ref = policy.reference().logprobs(ids, torch.ones_like(ids))
    with torch.no_grad():
        expected = token_logprobs(base, ids, torch.ones_like(ids))
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=0)
    assert policy.reference().frozen_copy is None  # nothing for a checkpoint to hold


def test_saved_adapters_load_with_peft_and_merge_for_serving(trained, tmp_path, tokenizer):
    from peft import PeftModel

    policy, _ = trained
    path = policy.save(tmp_path / "final", tokenizer)
    assert (path / "adapter_config.json").exists() and (path / "adapter_model.safetensors").exists()
    assert not (path / "model.safetensors").exists()  # adapters only
    expected = _logits(policy.model, IDS)
    reloaded = PeftModel.from_pretrained(load_model("tiny"), str(path))
    torch.testing.assert_close(_logits(reloaded, IDS), expected, atol=1e-5, rtol=0)
    merged = export_merged(path, tmp_path / "merged")
    assert (merged / "model.safetensors").exists() and (merged / "tokenizer.json").exists()
    torch.testing.assert_close(_logits(load_model(str(merged)), IDS), expected, atol=1e-4, rtol=0)
    # ctxrl's own loader takes the adapter directory too (ctxrl eval --checkpoint): base + adapters, merged
    torch.testing.assert_close(_logits(load_model(str(path)), IDS), expected, atol=1e-4, rtol=0)


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match="critic"):
        load_config(None, ["lora.rank=4", "algo.advantage=gae"])
    with pytest.raises(ConfigError, match="lora.rank must be >= 0"):
        load_config(None, ["lora.rank=-1"])
    with pytest.raises(ConfigError, match="before the warm start"):  # the LoRA reference is the base
        load_config(None, ["lora.rank=4", "algo.kl_coef=0.01"])
    load_config(None, ["lora.rank=4", "algo.kl_coef=0.01", "sft.enabled=false"])
    with pytest.raises(ConfigError, match="target_modules"):
        load_config(None, ["lora.rank=4", "lora.target_modules= "])
    with pytest.raises(ValueError, match="lora.target_modules"):
        Policy.load(load_config(None, [*LORA, "lora.target_modules=no_such_proj"]), "cpu")


def test_a_lora_run_trains_checkpoints_and_resumes_exactly(tmp_path, monkeypatch):
    """Warm start and RL on the adapters; a run resumed from its step-2 checkpoint ends with the same adapters."""
    from safetensors.torch import load_file

    from ctxrl.algo.estimators import broadcast
    from ctxrl.algo.estimators.outcome import GRPO
    from ctxrl.train.trainer import train

    monkeypatch.setattr(GRPO, "estimate", lambda self, episodes, **kw: [  # a learning signal for the random model
        broadcast(e, 1.0 if i % 2 else -1.0) for i, e in enumerate(episodes)])
    small = ["model.name=tiny:pretrain_steps=0", "sft.demos=8", "sft.epochs=1", "sft.batch_size=4", "eval.tasks=2",
             "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=12", "run.progress=false",
             "train.eval_every=0", "run.samples_per_step=1", "train.checkpoint_every=1", "lora.rank=4",
             "train.lr=1e-2", "train.keep_checkpoints=0"]
    full = tmp_path / "full"
    train(load_config(None, [*small, "train.steps=3"]), full)
    split = tmp_path / "split"
    train(load_config(None, [*small, "train.steps=2"]), split)
    train(load_config(None, [*small, "train.steps=3"]), split, resume=True)
    step = full / "checkpoints" / "step-000003"
    assert (step / "adapter_model.safetensors").exists() and not (step / "model.safetensors").exists()
    assert json.loads((step / "state.json").read_text())["lora"] is True
    a = load_file(str(full / "checkpoints" / "final" / "adapter_model.safetensors"))
    b = load_file(str(split / "checkpoints" / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = load_file(str(full / "checkpoints" / "step-000000" / "adapter_model.safetensors"))
    assert any(not torch.equal(start[k], a[k]) for k in a)  # RL moved the adapters
    # the base is named as the user named it, not by this machine's cache directory
    adapter_config = json.loads((full / "checkpoints" / "final" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "tiny:pretrain_steps=0"
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows if r["phase"] == "rl"] == [0.0, 0.0, 0.0]
    assert (full / "checkpoints" / "final-merged" / "model.safetensors").exists()  # lora.export_merged


def test_ctxrl_merge_writes_a_servable_checkpoint_and_refuses_a_directory_without_adapters(trained, tmp_path,
                                                                                           tokenizer, capsys):
    from ctxrl.cli import main

    policy, _ = trained
    path = policy.save(tmp_path / "step", tokenizer)
    assert main(["merge", str(path), "--out", str(tmp_path / "served"), "--dtype", "bfloat16"]) == 0
    served = load_model(str(tmp_path / "served"))
    assert next(served.parameters()).dtype == torch.float32  # loaded as asked; stored in bf16
    torch.testing.assert_close(_logits(served, IDS), _logits(policy.model, IDS), atol=0.1, rtol=0)
    assert main(["merge", str(tmp_path / "served"), "--out", str(tmp_path / "x")]) == 2
    assert "holds no LoRA adapters" in capsys.readouterr().err


@pytest.mark.slow  # (12 s: a spawned process; test_boundary's spawned worker keeps the process boundary in the
# default run, and the in-process adapter hand-over tests here keep LoRA's)
def test_a_worker_in_another_process_takes_the_adapters_alone_and_plays_what_the_trainers_engine_does(tiny_path):
    """The spec carries the LoRA settings: a worker that loads its own model wraps it like the learner, so the
    adapters (sent alone, partial) fit it, and it plays exactly what the trainer's shared-base engine plays."""
    from ctxrl.envs.calculator import CalculatorEnv
    from ctxrl.rollout.process import ProcessWorker
    from ctxrl.rollout.spec import RolloutRequest, RolloutSpec
    from ctxrl.rollout.worker import RolloutWorker, spec_renderer

    config = load_config(None, [f"model.name={tiny_path}", "model.device=cpu", "rollout.temperature=1.0",
                                "rollout.max_new_tokens=12", "env.max_turns=2", "lora.rank=4"])
    spec = RolloutSpec.from_config(config)
    assert spec.lora.rank == 4 and RolloutSpec.from_dict(spec.to_dict()) == spec
    policy = Policy.load(config, "cpu")
    g = torch.Generator().manual_seed(3)
    for p in policy.trainable_parameters():
        p.data = 0.05 * torch.randn(p.shape, generator=g)
    state, partial = policy.engine_state()
    renderer = spec_renderer(spec)
    engine = HFEngine(policy.engine_model(), pad_token_id=renderer.tokenizer.pad_token_id, seed=spec.engine_seed,
                      decode=renderer.decode)
    local = RolloutWorker(spec, engine, renderer)
    local.load_weights(state, version=2, partial=partial)
    request = RolloutRequest(tasks=CalculatorEnv.sample_tasks("train", 2, seed=4), group_size=2, seed=9)
    here = local.run(request)
    with ProcessWorker(spec) as remote:
        remote.load_weights(state, version=2, partial=partial)
        there = remote.run(request)

    def plain(episodes):
        out = [e.to_dict() for e in episodes]
        for e in out:
            del e["info"]["seconds"]
        return out

    assert plain(there) == plain(here) and all(e.policy_version == 2 for e in there)


def test_a_checkpoint_whose_base_directory_is_gone_merges_with_base_named(trained, tmp_path, tokenizer, capsys):
    """Adapters saved before the base was named as configured hold this machine's cache directory: elsewhere
    it does not exist, and ``ctxrl merge ADAPTERS OUT --base NAME`` names the base instead."""
    from ctxrl.cli import main

    policy, _ = trained
    path = policy.save(tmp_path / "old", tokenizer)
    adapter_config = json.loads((path / "adapter_config.json").read_text())
    named = adapter_config["base_model_name_or_path"]
    assert named == policy.name and not Path(named).is_absolute()  # as the config named it
    adapter_config["base_model_name_or_path"] = str(tmp_path / "another-machine" / "cache" / "tiny-abc")
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    assert main(["merge", str(path), str(tmp_path / "x")]) == 2
    assert "--base" in capsys.readouterr().err
    assert main(["merge", str(path), str(tmp_path / "merged"), "--base", named]) == 0
    torch.testing.assert_close(_logits(load_model(str(tmp_path / "merged")), IDS), _logits(policy.model, IDS),
                               atol=1e-4, rtol=0)


def test_ensure_model_of_an_adapter_directory_builds_its_tiny_base(tmp_path, monkeypatch):
    """``ctxrl eval --checkpoint ADAPTERS`` on a machine that never built the tiny base: the stage that builds
    tiny models builds it first (the loader refuses an unbuilt one)."""
    import ctxrl.train.tiny as stage
    from ctxrl.models.loader import parse_tiny

    built = []
    monkeypatch.setattr(stage, "ensure_tiny", lambda spec, on_progress=None: built.append(spec))
    monkeypatch.setattr(stage, "resolve", lambda name, on_progress=None: name)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "tiny:num_layers=1"}))
    assert stage.ensure_model(str(tmp_path)) == str(tmp_path)
    assert built == [parse_tiny("tiny:num_layers=1")]
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/somewhere/else"}))
    built.clear()
    stage.ensure_model(str(tmp_path))
    assert built == []  # a directory is the loader's to find (and to say it is missing)
