"""Engines turn prompt ids into sampled ids with log-probabilities."""

from ctxrl.engine.base import Completion, Engine, SamplingParams
from ctxrl.engine.hf import HFEngine

__all__ = ["Completion", "Engine", "HFEngine", "SamplingParams"]
