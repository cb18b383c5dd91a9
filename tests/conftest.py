"""Shared session fixtures: the random-init tiny model (built once, cached on disk)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

TINY = "tiny:pretrain_steps=0"
ROOT = Path(__file__).resolve().parents[1]


def experiment_module(name: str):
    """``experiments/NAME.py`` loaded as a module (a script, not a package: its siblings are put on the path, as
    running it does). Page tests compare a page's generated blocks with what the module makes of the records."""
    sys.path.insert(0, str(ROOT / "experiments"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ALTERNATING = "test_alternating"
_registered: list[str] = []


def alternating_sign() -> str:
    """Register (once) an estimator giving +1 / -1 by episode parity, so that a random-init policy still moves every
    step (trainer side only); returns its ``algo.advantage`` name. Called by the test modules that train with it, not
    here, so that a run of other tests sees only the registered estimators it names."""
    if not _registered:
        from ctxrl.algo.estimators import Estimator, broadcast, register_estimator

        @register_estimator
        class AlternatingSign(Estimator):
            name = ALTERNATING
            needs_groups = False
            one_per_episode = True

            def estimate(self, episodes, *, token_rewards=None, values=None, segment_bonus=None):
                return [broadcast(e, 1.0 if i % 2 else -1.0, segment_bonus) for i, e in enumerate(episodes)]

        _registered.append(ALTERNATING)
    return ALTERNATING


def page_block(text: str, name: str) -> str:
    """What a page holds between ``<!-- NAME -->`` and ``<!-- /NAME -->`` (``experiments/tables.py`` fills it)."""
    return text.split(f"<!-- {name} -->\n", 1)[1].split(f"\n<!-- /{name} -->", 1)[0]


# The tiny model's matrices are far too small for intra-op parallelism: with several OpenMP
# threads on a small (possibly shared) CPU a forward pass is ~100x slower than with one.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from ctxrl.train.tiny import ensure_model

    return ensure_model(TINY)


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from ctxrl.models.loader import load_tokenizer

    return load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def model(tiny_path):
    from ctxrl.models.loader import load_model

    m = load_model(tiny_path, dtype="float32", device="cpu")
    m.eval()
    return m


@pytest.fixture(scope="session")
def renderer(tokenizer):
    from ctxrl.chat.render import ChatRenderer

    return ChatRenderer(tokenizer, template_name="tiny")


def _scored_episodes(vocab: int, lengths: list[int], seed: int = 0):
    """Episodes of random ids of the given lengths: the first third prompt, the rest sampled with random
    behaviour log-probs (the learner's inputs, for tests of its forward passes)."""
    from ctxrl.types import Episode, Task

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        prompt = max(1, n // 3)
        behaviour = (-torch.rand(n, generator=g)).tolist()
        out.append(Episode(task=Task(id=str(i), prompt="p", answer="a"), input_ids=ids,
                           loss_mask=[0] * prompt + [1] * (n - prompt),
                           behavior_logprobs=[0.0] * prompt + behaviour[prompt:], turn_index=[0] * n))
    return out


@pytest.fixture(scope="session")
def scored_episodes():
    """``scored_episodes(vocab, lengths, seed=0)``: random episodes for the learner's tests."""
    return _scored_episodes


def greedy_reply(name: str, renderer, text: str, max_new_tokens: int):
    """A named model's greedy reply to one user message through ctxrl's HF engine on the CPU, stopping at its end
    ids: (the completion, the model's parameter count)."""
    import asyncio

    from ctxrl.engine.base import SamplingParams
    from ctxrl.engine.hf import HFEngine
    from ctxrl.models.loader import load_model
    from ctxrl.types import Message

    model = load_model(name, dtype="float32", device="cpu").eval()
    engine = HFEngine(model, pad_token_id=renderer.tokenizer.pad_token_id)
    ids = renderer.prompt_ids([Message("user", text)], None)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_ids=renderer.end_ids)
    return asyncio.run(engine.generate(ids, params)), sum(p.numel() for p in model.parameters())
