"""Shared session fixtures: the random-init tiny model (built once, cached on disk)."""

from __future__ import annotations

import pytest
import torch

TINY = "tiny:pretrain_steps=0"

# The tiny model's matrices are far too small for intra-op parallelism: with several OpenMP
# threads on a small (possibly shared) CPU a forward pass is ~100x slower than with one.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from ctxrl.models.loader import resolve

    return resolve(TINY)


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
