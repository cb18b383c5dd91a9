"""Local search (BM25 via bm25s), QA metrics, and the search_qa environment."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs import assert_env_ok, get_env_class
from ctxrl.envs.search_qa import SearchQAEnv, kb_index, knowledge_base
from ctxrl.rollout.agent import run_episode
from ctxrl.rollout.spec import RolloutLimits
from ctxrl.tools.search import Document, SearchIndex, exact_match, normalize_answer, search_tool, token_f1


def test_index_ranks_by_bm25_and_reads_jsonl(tmp_path):
    docs = [Document("1", "Paris", "Paris is the capital of France."),
            Document("2", "Rome", "Rome is the capital of Italy."),
            Document("3", "Cats", "Cats chase mice.")]
    index = SearchIndex(docs)
    hits = index.search("capital of France", k=2)
    assert [d.id for d, _ in hits] == ["1", "2"] and hits[0][1] > hits[1][1] > 0
    assert index.search("the of a", k=3) == []  # stop words only
    assert len(index.search("cats", k=10)) == 1  # only documents that match
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in [{"id": "a", "title": "T", "text": "zebra stripes"},
                                                      {"text": "lions roar"}]) + "\n\n")
    from_file = SearchIndex.from_jsonl(path)
    assert [d.id for d in from_file.docs] == ["a", "2"] and from_file.search("zebra")[0][0].title == "T"
    path.write_text('{"title": "no text"}\n')
    with pytest.raises(ValueError, match="corpus.jsonl:1: each line needs a string field 'text'"):
        SearchIndex.from_jsonl(path)
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="corpus.jsonl:1: not JSON"):
        SearchIndex.from_jsonl(path)
    with pytest.raises(ValueError, match="at least one document"):
        SearchIndex([])
    tool_text = asyncio.run(search_tool(index, k=1)(query="Italy"))
    assert tool_text == "[1] Rome: Rome is the capital of Italy."


@pytest.mark.parametrize("given,gold,em,f1", [
    ("The Eiffel Tower", "eiffel tower", True, 1.0), ("Keltra.", "keltra", True, 1.0),
    ("new york city", "New York", False, 0.8), ("Rome", "Paris", False, 0.0), ("", "Paris", False, 0.0),
])
def test_qa_metrics(given, gold, em, f1):
    assert exact_match(given, gold) is em
    assert token_f1(given, gold) == pytest.approx(f1)
    assert normalize_answer("  The  A-Team!! ") == "ateam"


def test_conformance_kb_and_retrieval():
    assert_env_ok(SearchQAEnv, n_tasks=16)
    assert get_env_class("search_qa") is SearchQAEnv
    kb = knowledge_base()
    assert len(kb.people) == 120 and knowledge_base() is kb  # fixed, built once
    for split, hops in (("train", {1, 2}), ("heldout", {1, 2}), ("ood", {3})):
        tasks = SearchQAEnv.sample_tasks(split, 20, seed=1)
        assert {t.context["hops"] for t in tasks} <= hops
        for task in tasks:
            assert len(task.data["lookups"]) == task.context["hops"]
            for query in task.data["lookups"]:  # searching an entity's name finds its own document first
                assert kb_index().search(query, k=1)[0][0].title == query


def test_scripted_episode(renderer):
    task = SearchQAEnv.sample_tasks("ood", 1, seed=3)[0]
    limits = RolloutLimits(max_turns=4, max_new_tokens=64, max_total_tokens=4096)
    episode = asyncio.run(run_episode(SearchQAEnv(), task, ScriptedEngine(SearchQAEnv.solve(task), renderer),
                                      renderer, limits, seed=0))
    assert episode.success and episode.tool_calls == 3
    assert task.data["lookups"][1] in episode.messages[3].content  # the first result names the next hop


def test_pretraining_variant_is_another_world_and_shortcut_stops_after_one_search(renderer):
    variant = SearchQAEnv.pretraining_variant(5)
    assert issubclass(variant, SearchQAEnv) and variant.kb_seed != SearchQAEnv.kb_seed
    own, other = knowledge_base(SearchQAEnv.kb_seed), knowledge_base(variant.kb_seed)
    assert not set(own.people) & set(other.people)  # no fact of the training world is pre-trained on
    task = next(t for t in variant.sample_tasks("train", 20, seed=1) if t.context["hops"] == 2)
    assert task.data["lookups"][0] in other.people
    limits = RolloutLimits(max_turns=4, max_new_tokens=64, max_total_tokens=4096)
    solved = asyncio.run(run_episode(variant(), task, ScriptedEngine(variant.solve(task), renderer), renderer,
                                     limits, seed=0))
    assert solved.success and solved.tool_calls == 2  # the variant's tool searches its own world
    # the shortcut: one search, then the entity it revealed, which is not the 2-hop answer
    short = asyncio.run(run_episode(variant(), task, ScriptedEngine(variant.shortcut(task), renderer), renderer,
                                    limits, seed=0))
    assert short.tool_calls == 1 and not short.success
    one_hop = next(t for t in SearchQAEnv.sample_tasks("train", 20, seed=1) if t.context["hops"] == 1)
    assert SearchQAEnv.shortcut(one_hop) == SearchQAEnv.solve(one_hop)


def test_demos_from_other_worlds_never_hold_the_training_worlds_facts(renderer):
    from ctxrl.demos.play import WORLD_EPISODES, build_demos

    n = WORLD_EPISODES + 20
    demos = asyncio.run(build_demos(SearchQAEnv, renderer, n, seed=3, shortcut_fraction=0.5, other_worlds=True))
    assert len(demos) == n and all(d.success or d.tool_calls == 1 for d in demos)
    own = set(knowledge_base(SearchQAEnv.kb_seed).people)
    asked = [d.task.data["lookups"][0] for d in demos]
    assert not own & set(asked)
    variants = (SearchQAEnv.pretraining_variant(3 * 100_003), SearchQAEnv.pretraining_variant(3 * 100_003 + 1))
    worlds = {type_.kb_seed for type_ in variants}
    assert len(worlds) == 2  # two chunks, two worlds
    assert asked[0] in knowledge_base(SearchQAEnv.pretraining_variant(3 * 100_003).kb_seed).people
    assert asked[-1] in knowledge_base(SearchQAEnv.pretraining_variant(3 * 100_003 + 1).kb_seed).people
    # without other_worlds the demos come from the environment's own world
    own_demos = asyncio.run(build_demos(SearchQAEnv, renderer, 5, seed=3))
    assert all(d.task.data["lookups"][0] in own for d in own_demos)


def test_redundant_demos_search_the_answer_again_and_keep_their_share(renderer):
    """sft.redundant_fraction: right answers with one search more than solve, drawn after the shortcut's share."""
    from ctxrl.demos.play import build_demos

    limits = RolloutLimits(max_turns=5, max_new_tokens=64, max_total_tokens=4096)
    task = next(t for t in SearchQAEnv.sample_tasks("train", 20, seed=1) if t.context["hops"] == 2)
    texts = SearchQAEnv.redundant(task)
    assert texts[:2] == SearchQAEnv.solve(task)[:2] and task.answer in texts[2] and len(texts) == 4
    episode = asyncio.run(run_episode(SearchQAEnv(), task, ScriptedEngine(texts, renderer), renderer, limits, seed=0))
    assert episode.success and episode.tool_calls == 3
    assert task.answer in episode.messages[7].content  # the extra search finds the answer's own document

    n = 60
    plain = asyncio.run(build_demos(SearchQAEnv, renderer, n, seed=5, shortcut_fraction=0.3))
    mixed = asyncio.run(build_demos(SearchQAEnv, renderer, n, seed=5, shortcut_fraction=0.3, redundant_fraction=0.5))
    assert [d.task.id for d in plain] == [d.task.id for d in mixed]  # the same tasks; only their scripts differ
    hops = [d.task.context["hops"] for d in plain]
    extra = [m.tool_calls - p.tool_calls for m, p in zip(mixed, plain)]
    # the shortcut's share is untouched (the same draws); others gain one call, or all of solve's calls
    shortcut = [p.tool_calls == 1 and h == 2 and not p.success for p, h in zip(plain, hops)]
    for was_short, more, m, h in zip(shortcut, extra, mixed, hops):
        assert (more == 0) if was_short else (more in (0, 1) and m.success and m.tool_calls in (h, h + 1))
    redundant = sum(m.tool_calls == h + 1 for m, h in zip(mixed, hops))
    assert 0.3 * n <= redundant <= 0.7 * n  # about half of 60 draws
    assert sum(d.tool_calls for d in mixed) == sum(d.tool_calls for d in plain) + redundant
    only = asyncio.run(build_demos(SearchQAEnv, renderer, 10, seed=5, shortcut_fraction=0.0, redundant_fraction=1.0))
    assert all(d.success and d.tool_calls == d.task.context["hops"] + 1 for d in only)


def test_redundant_demos_are_refused_where_they_cannot_be_played(renderer):
    from ctxrl.demos.play import build_demos
    from ctxrl.envs.calculator import CalculatorEnv

    with pytest.raises(ValueError, match="no redundant hook.*sft.redundant_fraction=0"):
        asyncio.run(build_demos(CalculatorEnv, renderer, 2, redundant_fraction=0.5))
    with pytest.raises(ValueError, match="more than 1"):
        asyncio.run(build_demos(SearchQAEnv, renderer, 2, shortcut_fraction=0.7, redundant_fraction=0.5))


def test_bm25s_never_starts_jax(tmp_path):
    """bm25s runs JAX at import when it is installed, and JAX then takes 75% of the GPU's memory."""
    fake = tmp_path / "site" / "jax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"open({str(tmp_path / 'jax-imported')!r}, 'w').close()\n")
    (fake / "lax.py").write_text("def top_k(x, k):\n    raise AssertionError('bm25s used jax')\n")
    code = ("import sys; sys.modules.pop('bm25s', None)\n"
            "from ctxrl.tools.search import Document, SearchIndex\n"
            "index = SearchIndex([Document('a', 'Alpha', 'the alpha doc'), Document('b', 'Beta', 'a beta doc')])\n"
            "assert index.search('beta', k=1)[0][0].id == 'b'\n"
            "import jax  # a program's own import of JAX still works afterwards\n")
    root = Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{root}"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)
    assert (tmp_path / "jax-imported").exists()  # imported by the program, at the end
    (tmp_path / "jax-imported").unlink()
    subprocess.run([sys.executable, "-c", code.replace("import jax  #", "pass  #")], check=True, env=env, cwd=root)
    assert not (tmp_path / "jax-imported").exists()


def test_redundant_fraction_is_checked_before_the_model_loads():
    from ctxrl.config import load_config
    from ctxrl.envs.calculator import CalculatorEnv
    from ctxrl.errors import ConfigError
    from ctxrl.train.warm_start import check_demos

    ok = load_config(None, ["env.name=search_qa", "sft.shortcut_fraction=0.3", "sft.redundant_fraction=0.5"])
    check_demos(ok, SearchQAEnv)
    with pytest.raises(ConfigError, match="has no redundant hook"):
        check_demos(load_config(None, ["sft.redundant_fraction=0.5"]), CalculatorEnv)
    with pytest.raises(ConfigError, match="sft.shortcut_fraction=0.65 plus sft.redundant_fraction=0.5 is more than 1"):
        check_demos(load_config(None, ["env.name=search_qa", "sft.redundant_fraction=0.5"]), SearchQAEnv)
    check_demos(load_config(None, ["sft.redundant_fraction=0.5", "sft.enabled=false"]), CalculatorEnv)
    with pytest.raises(ConfigError, match="sft.redundant_fraction"):
        load_config(None, ["sft.redundant_fraction=1.5"])
