"""``JudgeSpec``: a run's judge as plain data, what a rollout worker reads (``RolloutSpec.judge``).

It crosses the rollout boundary like the rest of the spec (JSON, no objects): the worker builds its ``Judge`` from
it (``ctxrl.judge.judge``), in this process, a subprocess or a Ray actor alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ctxrl.plain import PlainData

NO_CACHE = "off"
"""``reward.judge_cache`` that keeps nothing across runs."""


@dataclass(frozen=True)
class JudgeSpec(PlainData):
    """A run's judge, as a rollout worker reads it (``reward.judge*``; docs/judges.md)."""

    target: str = ""
    """An endpoint (``http(s)://...``) or a model to load here; empty: no judge."""
    model: str = ""
    rubric: str = ""
    input: str = "transcript"
    reference: bool = False
    max_tokens: int = 64
    retries: int = 2
    timeout_s: float = 60.0
    concurrency: int = 8
    cache: str = ""
    """A directory; empty: ``$CTXRL_CACHE/judge``; ``off``: nothing kept across runs."""
    api_key_env: str = "OPENAI_API_KEY"
    device: str = "cpu"
    """Where a local judge runs (the policy's device)."""
    dtype: str = "float32"

    @property
    def enabled(self) -> bool:
        return bool(self.target)

    @classmethod
    def from_config(cls, config: Any, device: str) -> JudgeSpec:
        r = config.reward
        return cls(target=r.judge, model=r.judge_model, rubric=r.judge_rubric, input=r.judge_input,
                   reference=r.judge_reference, max_tokens=r.judge_max_tokens, retries=r.judge_retries,
                   timeout_s=r.judge_timeout_s, concurrency=r.judge_concurrency, cache=r.judge_cache,
                   api_key_env=r.judge_api_key_env, device=device, dtype=config.model.dtype)
