"""Loading the tiny model and tokenizer, and the loader's error messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ctxrl.models.loader import ModelLoadError, load_model, load_tokenizer, parse_tiny, resolve
from ctxrl.models.tiny import TinySpec


def test_tiny_loads_as_llama(tiny_path, tokenizer, model):
    from transformers import LlamaForCausalLM

    assert Path(tiny_path, "config.json").exists()
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.hidden_size == TinySpec().hidden_size
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id is not None
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_tiny_tokenizer_keeps_three_digit_numbers_whole(tokenizer):
    """Loaded back through AutoTokenizer, numbers below 1000 are single tokens (Llama 3 style)."""
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("37 + 580 * 4 = 380240", add_special_tokens=False)]
    assert "".join(pieces) == "37 + 580 * 4 = 380240"
    assert [p for p in pieces if p.strip().isdigit()] == ["37", "580", "4", "380", "240"]
    for n in (0, 7, 42, 100, 999):
        assert len(tokenizer.encode(str(n), add_special_tokens=False)) == 1, n


def test_tiny_qwen2_arch_splits_digits():
    """``arch=qwen2`` builds a Qwen2 model whose tokenizer (as transformers enforces) splits digits."""
    from transformers import Qwen2ForCausalLM

    from ctxrl.train.tiny import ensure_model

    path = ensure_model("tiny:arch=qwen2,pretrain_steps=0")
    tok, model = load_tokenizer(path), load_model(path)
    assert isinstance(model, Qwen2ForCausalLM)
    assert [tok.decode([i]) for i in tok.encode("580", add_special_tokens=False)] == ["5", "8", "0"]
    assert model.config.vocab_size == len(tok)


def test_tiny_bad_arch():
    with pytest.raises(ModelLoadError, match="arch must be one of llama, qwen2"):
        parse_tiny("tiny:arch=gpt2")


def test_pretraining_batches_alternate_plain_and_chat(tokenizer):
    from ctxrl.demos.pretraining import pretraining_batches

    spec = TinySpec(pretrain_steps=4, pretrain_batch_size=3, pretrain_chat_batch_size=2)
    nested = pretraining_batches(tokenizer, spec)
    assert [len(b) for b in nested] == [3, 2, 3, 2]
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for step, batch in enumerate(nested):
        assert [im_start in seq for seq in batch] == [step % 2 == 1] * len(batch), step
    batches = [seq for batch in nested for seq in batch]
    for seq in batches:
        assert seq[-1] == tokenizer.pad_token_id
        assert tokenizer.pad_token_id not in seq[:-1]
        text = tokenizer.decode(seq)
        assert "<tool_call>" in text and "<answer>" in text and "<tool_response>" in text
        assert ("# Tools" in text) == (im_start in seq)  # chat batches carry the rollout system block
    assert len({tuple(seq) for seq in batches}) == 10  # fresh tasks, no repeats
    # a chat sequence is exactly a demo episode's ids, as a rollout would hold them
    import asyncio

    from ctxrl.chat.render import ChatRenderer
    from ctxrl.demos.play import build_demos
    from ctxrl.envs.calculator import CalculatorEnv

    demo = asyncio.run(build_demos(CalculatorEnv, ChatRenderer(tokenizer), 4, seed=spec.seed + 2))[0]
    assert nested[1][0] == list(demo.input_ids) + [tokenizer.pad_token_id]


def test_resolve_is_cached(tiny_path):
    assert resolve("tiny:pretrain_steps=0") == tiny_path
    assert resolve(tiny_path) == tiny_path


def test_an_unbuilt_tiny_model_is_refused_with_the_stage_that_builds_it(tmp_path, monkeypatch):
    """The library never builds the tiny model (its text comes from the environments, above it): ``resolve``
    names the stage, and the stage builds it once, after which ``resolve`` finds it."""
    from ctxrl.train.tiny import ensure_model

    monkeypatch.setenv("CTXRL_CACHE", str(tmp_path))
    name = "tiny:pretrain_steps=0,hidden_size=32,num_layers=1,intermediate_size=64"
    with pytest.raises(ModelLoadError, match=r"not built yet.*ctxrl.models.prepare.prepare"):
        resolve(name)
    with pytest.raises(ModelLoadError, match="not built yet"):
        load_tokenizer(name)
    built = ensure_model(name)
    assert Path(built, "config.json").exists() and Path(built).parent == tmp_path
    assert resolve(name) == built == ensure_model(name)  # (the second call builds nothing)


def test_a_run_built_directly_builds_its_tiny_model(tmp_path, monkeypatch):
    """Scripts that build a run themselves (``ctxrl.run.build.build``: experiments/meta.py) get the stage too, not
    the loader's refusal."""
    from ctxrl.config import load_config
    from ctxrl.run.build import build

    monkeypatch.setenv("CTXRL_CACHE", str(tmp_path / "cache"))
    name = "tiny:pretrain_steps=0,hidden_size=32,num_layers=1,intermediate_size=64"
    config = load_config(Path(__file__).parents[1] / "examples" / "calculator_tiny.toml",
                         [f"model.name={name!r}".replace("'", '"'), "model.device=cpu", "sft.enabled=false"])
    run = build(config, tmp_path / "run")
    assert resolve(name) == str(Path(run.tokenizer.name_or_path))


def test_missing_path():
    for loader in (resolve, load_tokenizer, load_model):
        with pytest.raises(ModelLoadError, match="does not exist"):
            loader("./does/not/exist")


def test_directory_without_weights(tiny_path, tmp_path):
    target = tmp_path / "noweights"
    target.mkdir()
    shutil.copy(Path(tiny_path, "config.json"), target / "config.json")
    with pytest.raises(ModelLoadError, match="no model weights"):
        load_model(str(target))
    with pytest.raises(ModelLoadError, match="no model weights"):
        resolve(str(target))


def test_tokenizer_without_chat_template(tiny_path, tokenizer, tmp_path):
    import copy

    target = tmp_path / "notemplate"
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    tok.save_pretrained(target)
    # make sure no template survives on disk in any of the places transformers looks
    (target / "chat_template.jinja").unlink(missing_ok=True)
    (target / "chat_template.json").unlink(missing_ok=True)
    cfg_path = target / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    shutil.copy(Path(tiny_path, "config.json"), target / "config.json")
    shutil.copy(Path(tiny_path, "model.safetensors"), target / "model.safetensors")
    with pytest.raises(ModelLoadError, match="chat template"):
        load_tokenizer(str(target))
    # ... and an explicit template fixes it
    from ctxrl.chat.template import CHATML_TOOLS_TEMPLATE

    tok2 = load_tokenizer(str(target), chat_template=CHATML_TOOLS_TEMPLATE)
    assert tok2.chat_template == CHATML_TOOLS_TEMPLATE


def test_digits_grouped_in_threes(tokenizer):
    ids = tokenizer.encode("12345", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["123", "45"]
    ids = tokenizer.encode("x = 9081726354", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids][-4:] == ["908", "172", "635", "4"]


@pytest.mark.parametrize("token", ["<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>",
                                   "<tool_response>", "</tool_response>"])
def test_single_token_markers(tokenizer, token):
    ids = tokenizer.encode(token, add_special_tokens=False)
    assert len(ids) == 1
    assert tokenizer.decode(ids) == token
    assert ids[0] in tokenizer.encode(f"x = 1{token}\n", add_special_tokens=False)  # also inside text


def test_parse_tiny():
    assert parse_tiny("Qwen/Qwen2.5-0.5B-Instruct") is None
    assert parse_tiny("tinyllama") is None
    assert parse_tiny("tiny") == TinySpec()
    spec = parse_tiny("tiny:hidden_size=64")
    assert spec == TinySpec(hidden_size=64)
    assert parse_tiny("tiny:hidden_size=64,num_layers=2").num_layers == 2
    assert parse_tiny("tiny:pretrain_steps=0").pretrain_steps == 0
    with pytest.raises(ModelLoadError, match="bogus"):
        parse_tiny("tiny:bogus=1")
    with pytest.raises(ModelLoadError, match="hidden_size"):
        parse_tiny("tiny:hidden_size=big")


def test_parse_tiny_float_field():
    assert parse_tiny("tiny:pretrain_lr=0.001").pretrain_lr == 0.001


def test_bad_dtype(tiny_path):
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(tiny_path, dtype="int8")


def test_pretrain_lowers_the_loss(tokenizer):
    import copy

    from ctxrl.demos.pretraining import pretraining_batches
    from ctxrl.train.tiny import pretrain

    spec = TinySpec(pretrain_steps=2, pretrain_batch_size=4, pretrain_chat_batch_size=2, pretrain_lr=3e-3)
    batches = pretraining_batches(tokenizer, spec)
    model = copy.deepcopy(load_model(str(resolve("tiny:pretrain_steps=0"))))
    losses = pretrain(model, tokenizer, batches * 10, spec)
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.5
    assert not model.training
    with pytest.raises(ValueError, match="at least one sequence"):
        pretrain(model, tokenizer, [[]], spec)


def test_tiny_spec_envs_field(tokenizer):
    from ctxrl.demos.pretraining import pretraining_batches
    from ctxrl.models.loader import parse_tiny
    from ctxrl.models.tiny import PRETRAIN_ENVS

    # the default set leaves the cache key unchanged; another set is another model
    assert TinySpec().key() == TinySpec(envs="+".join(PRETRAIN_ENVS)).key()
    assert TinySpec(envs="calculator+kv_chain").key() != TinySpec().key()
    spec = parse_tiny("tiny:envs=calculator+kv_chain,pretrain_steps=2,pretrain_batch_size=4,pretrain_chat_batch_size=6")
    assert spec.env_names() == ("calculator", "kv_chain")
    chat = pretraining_batches(tokenizer, spec)[1]
    texts = [tokenizer.decode(seq) for seq in chat]
    # both environments' episodes, mixed in one batch
    assert any('"lookup"' in t for t in texts) and any('"calculator"' in t for t in texts)


def test_every_end_id_of_the_generation_config_ends_a_turn(tiny_path, tokenizer, tmp_path):
    """generation_config.json's eos_token_id (one id or a list) and rollout.stop_ids all stop a turn."""
    import json
    import shutil

    from ctxrl.chat.render import ChatRenderer
    from ctxrl.models.loader import generation_end_ids
    from ctxrl.rollout.generate import sampling_params
    from ctxrl.rollout.spec import RolloutLimits

    copy = tmp_path / "model"
    shutil.copytree(tiny_path, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert generation_end_ids(str(copy)) == [2, 7]
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert generation_end_ids(str(copy)) == [7]
    (copy / "generation_config.json").unlink()
    assert generation_end_ids(str(copy)) == []

    renderer = ChatRenderer(tokenizer, end_ids=[2, 7])
    assert renderer.end_ids[0] == renderer.eos_id and set(renderer.end_ids) == {renderer.eos_id, 2, 7}
    params = sampling_params(RolloutLimits(stop_ids=(9, 7), stop_strings=("</answer>",)), renderer, 8, None, 0)
    assert params.stop_ids == (*renderer.end_ids, 9)  # the template's end first, no repeats
    assert params.stop_strings == ("</answer>",)


def test_a_build_records_how_its_pretraining_went(tmp_path):
    """ctxrl_tiny.json keeps the pre-training loss of the first and last steps beside the spec, so that a build
    whose loss barely fell can be told from a good one (builds of one spec differ)."""
    import json

    from ctxrl.models.tiny import pretraining_record
    from ctxrl.train.tiny import build_tiny

    assert pretraining_record([]) == {}
    assert pretraining_record([4.0, 3.0, 2.0, 1.0], window=2) == {
        "pretraining_loss": {"steps": 4, "first": 3.5, "last": 1.5}}
    spec = TinySpec(pretrain_steps=2, pretrain_batch_size=4, pretrain_chat_batch_size=2)
    saved = json.loads((build_tiny(spec, tmp_path / "tiny") / "ctxrl_tiny.json").read_text())
    assert saved["pretrain_steps"] == 2 and saved["pretraining_loss"]["steps"] == 2
    assert 0 < saved["pretraining_loss"]["last"] < 20


def test_prepare_runs_the_preparer_its_scheme_registered(monkeypatch):
    """``ctxrl.models.prepare.prepare``: a ``tiny`` name goes to the stage that registered ``tiny`` (looked up when
    called, so a patched ``ensure_tiny`` is the one that runs); any other name only to the loader."""
    import ctxrl.train.tiny as stage
    from ctxrl.models import prepare as preparing
    from ctxrl.models.loader import parse_tiny

    built = []
    monkeypatch.setattr(stage, "ensure_tiny", lambda spec, on_progress=None: built.append(spec))
    monkeypatch.setattr(preparing.loader, "resolve", lambda name, on_progress=None: f"resolved {name}")
    assert preparing.prepare("tiny:num_layers=1") == "resolved tiny:num_layers=1"
    assert built == [parse_tiny("tiny:num_layers=1")]
    assert preparing.prepare("/some/checkpoint") == "resolved /some/checkpoint" and len(built) == 1
