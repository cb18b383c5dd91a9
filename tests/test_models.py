"""Loading the tiny model and tokenizer, and the loader's error messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ctxrl.models.loader import ModelLoadError, load_model, load_tokenizer, parse_tiny, resolve
from ctxrl.models.tiny import TinySpec


def test_tiny_loads_as_qwen2(tiny_path, tokenizer, model):
    from transformers import Qwen2ForCausalLM

    assert Path(tiny_path, "config.json").exists()
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.hidden_size == TinySpec().hidden_size
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id is not None
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_resolve_is_cached(tiny_path):
    assert resolve("tiny:pretrain_steps=0") == tiny_path
    assert resolve(tiny_path) == tiny_path


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


def test_digits_split_one_per_token(tokenizer):
    ids = tokenizer.encode("12345", add_special_tokens=False)
    assert len(ids) == 5
    assert [tokenizer.decode([i]) for i in ids] == list("12345")
    ids = tokenizer.encode("x = 9081726354", add_special_tokens=False)
    digit_tokens = [tokenizer.decode([i]) for i in ids][-10:]
    assert digit_tokens == list("9081726354")


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
