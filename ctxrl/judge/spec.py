"""``JudgeSettings``: the judge's own table ``[reward.judge]``, which a rollout worker reads (``RolloutSpec.judge``).

It crosses the rollout boundary like the rest of the spec (JSON, no objects): the worker builds its ``Judge`` from
it (``ctxrl.judge.judge``) with the policy's device and dtype, in this process, a subprocess or a Ray actor alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ctxrl.judge.transcript import INPUTS
from ctxrl.settings import NON_NEGATIVE, POSITIVE

NO_CACHE = "off"
"""``reward.judge.cache`` that keeps nothing across runs."""


@dataclass(frozen=True)
class JudgeSettings:
    """``[reward.judge]``: a judge that grades every training episode (docs/judges.md)."""

    target: str = ""
    """A judge that grades every training episode, its score in [0, 1] a reward term (docs/judges.md): an
    OpenAI-compatible endpoint (``http://127.0.0.1:8000/v1``: ``ctxrl serve`` over another checkpoint, vLLM, a hosted
    API; needs ``pip install -e '.[judge]'``) or any ``model.name`` loaded in this process. Empty: no judge."""
    weight: float = 1.0
    """Weight of the judge's score. A judge-rewarded run that hides the verifier from training: ``reward.outcome=0``
    (evaluation still reports the environment's success)."""
    model: str = ""
    """The model an endpoint is asked for (empty: the first it lists, which is what ``ctxrl serve`` serves)."""
    rubric: str = ""
    """A TOML rubric: criteria (name, description, weight), their scale, optional one-word verdicts (docs/judges.md).
    Empty: one criterion, ``correct``, from 0 to 10."""
    input: str = "transcript"
    """What the judge reads: ``transcript`` (every message of the episode) or ``answer`` (its last assistant
    message)."""
    reference: bool = False
    """Show the judge the task's reference answer (reference-guided grading)."""
    max_tokens: int = field(default=64, metadata=POSITIVE)
    """Tokens the judge may write per reply."""
    retries: int = field(default=2, metadata=NON_NEGATIVE)
    """Further tries after a malformed reply (asked again with sampling), a call past its deadline or a transient
    failure; when every try fails the episode is errored (``errors_judge``), never scored 0."""
    timeout_s: float = field(default=60.0, metadata=POSITIVE)
    """Deadline of one call to the judge."""
    concurrency: int = field(default=8, metadata=POSITIVE)
    """Most calls to the judge in flight at once per rollout worker (they run while other episodes still play)."""
    cache: str = ""
    """Where verdicts are kept by the hash of the question, so that a rerun asks nothing again: a directory (empty:
    ``$CTXRL_CACHE/judge``), or ``off``."""
    api_key_env: str = "OPENAI_API_KEY"
    """The environment variable holding the endpoint's API key (a missing variable sends none)."""

    def __post_init__(self) -> None:
        if self.input not in INPUTS:
            raise ValueError(f"input must be one of {', '.join(INPUTS)}, got {self.input!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.target)
