"""The fast GPU engine: slot KV cache, continuous batching, prefix reuse, decode steps in CUDA graphs."""

from ctxrl.engine.fast.engine import FastEngine, UnsupportedModel
from ctxrl.engine.fast.model import unsupported_reason

__all__ = ["FastEngine", "UnsupportedModel", "unsupported_reason"]
