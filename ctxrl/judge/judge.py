"""The judge: a model that grades each training episode against a rubric, its score a reward term.

``JudgeSettings`` (``ctxrl.judge.spec``, the table ``[reward.judge]``) is what a rollout worker reads
(``RolloutSpec.judge``). A worker with one builds a ``Judge`` once (``Judge.from_spec``: the backend, the rubric, the
cache) and, while it plays a training request, hands it each episode *as that episode finishes*
(``JudgeRound.submit``): the judge's calls run on the worker's event loop beside the episodes still being played,
at most ``reward.judge.concurrency`` at once, and the request returns once every episode is graded. Evaluation
episodes are never judged: evaluation reports the environment's own success.

Grading one episode (``Judge.grade``): the rubric's conversation over the episode's transcript or final answer
(``ctxrl.judge.transcript``), looked up in the cache first (``ctxrl.judge.cache``), else asked with a deadline of
``reward.judge.timeout_s`` per call. A reply the rubric cannot parse, a call past its deadline or a transient
failure is asked again, up to ``reward.judge.retries`` more times (after a malformed reply, with sampling: a greedy
judge would only repeat it). When every try fails the episode is **errored** (``error_kind = "judge"``, the reason
in ``info["error"]``): it is counted in the step's ``errors_judge`` and left out of the loss, never given a silent 0.
A graded episode carries ``info["judge"]``: its score in [0, 1], each criterion's, the reply, whether it came from
the cache, the tries and seconds it took. ``ctxrl.run.rewards`` adds ``reward.judge.weight`` times the score.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from ctxrl.judge.backends import EndpointBackend, JudgeUnavailable, LocalBackend, is_endpoint
from ctxrl.judge.cache import JudgeCache, cache_key, default_directory
from ctxrl.judge.rubric import JudgeParseError, Rubric, load_rubric
from ctxrl.judge.spec import NO_CACHE, JudgeSettings
from ctxrl.judge.transcript import judge_input
from ctxrl.types import Episode

RETRY_TEMPERATURE = 0.7
"""The temperature of a try after a malformed reply."""


class JudgeError(Exception):
    """Every try at grading an episode failed; the message says how, and the last reason."""


class Judge:
    """Grades episodes (module docstring). ``backend``: anything with ``identity`` and ``async complete``."""

    def __init__(self, spec: JudgeSettings, backend, rubric: Rubric, cache: JudgeCache) -> None:
        self.spec, self.backend, self.rubric, self.cache = spec, backend, rubric, cache

    @classmethod
    def from_spec(cls, spec: JudgeSettings, *, device: str = "cpu", dtype: str = "float32") -> Judge:
        """The judge of ``[reward.judge]``; a local one loads on ``device`` in ``dtype`` (the policy's)."""
        rubric = load_rubric(spec.rubric)
        if is_endpoint(spec.target):
            backend = EndpointBackend(spec.target, spec.model, api_key_env=spec.api_key_env, timeout_s=spec.timeout_s)
        else:
            backend = LocalBackend(spec.target, device=device, dtype=dtype)
        directory = None if spec.cache == NO_CACHE else (spec.cache or default_directory())
        return cls(spec, backend, rubric, JudgeCache(directory))

    def round(self) -> JudgeRound:
        """A request's grading: episodes submitted as they finish, awaited together (call inside the event loop)."""
        return JudgeRound(self)

    def question(self, episode: Episode) -> tuple[list, str]:
        """The judge's conversation about ``episode`` and its cache key."""
        spec = self.spec
        messages = self.rubric.messages(episode.task.prompt, judge_input(episode, spec.input), what=spec.input,
                                        reference=episode.task.answer if spec.reference else None)
        key = cache_key(self.backend.identity, dataclasses.asdict(self.rubric), [m.to_chat() for m in messages],
                        spec.max_tokens)
        return messages, key

    async def grade(self, episode: Episode, limit: asyncio.Semaphore | None = None) -> dict[str, Any]:
        """``info["judge"]`` of ``episode`` (module docstring); ``JudgeError`` when every try failed."""
        started = time.perf_counter()
        await self.ready()
        messages, key = self.question(episode)
        result = await self.answer(messages, key, limit)
        return {**result, "seconds": time.perf_counter() - started}

    async def ready(self) -> None:
        """The backend knows which model it asks (its ``identity`` keys the cache); ``JudgeError`` if it cannot."""
        ready = getattr(self.backend, "ready", None)
        if ready is None:
            return
        try:
            await ready()
        except JudgeUnavailable as exc:
            raise JudgeError(f"the judge could not name its model: {exc}") from None

    async def answer(self, messages, key: str, limit: asyncio.Semaphore | None = None) -> dict[str, Any]:
        """The cached verdict under ``key``, else the judge's (then cached)."""
        hit = self.cache.get(key)
        if hit is not None:
            return {**verdict(hit), "cached": True, "attempts": 0}
        async with limit if limit is not None else _no_limit():
            reply, scores, attempts = await self._ask(messages)
        record = {"reply": reply, "scores": scores, "score": self.rubric.combine(scores)}
        self.cache.put(key, record)
        return {**verdict(record), "cached": False, "attempts": attempts}

    async def _ask(self, messages) -> tuple[str, dict[str, float], int]:
        """The first parsed reply within ``1 + retries`` tries: (reply, scores, tries)."""
        spec, problems = self.spec, []
        temperature = 0.0
        for attempt in range(1 + spec.retries):
            try:
                reply = await asyncio.wait_for(self.backend.complete(messages, spec.max_tokens,
                                                                     temperature=temperature, seed=attempt),
                                               spec.timeout_s)
                asked = "\n".join(m.content for m in messages)  # (lines it echoes are the prompt's, not a verdict)
                return reply, self.rubric.parse(reply, asked), attempt + 1
            except JudgeParseError as exc:
                problems.append(f"malformed reply: {exc}")
                temperature = RETRY_TEMPERATURE
            except (TimeoutError, asyncio.TimeoutError):
                problems.append(f"no reply within reward.judge.timeout_s={spec.timeout_s:g} s")
            except JudgeUnavailable as exc:
                problems.append(str(exc))
                if exc.permanent:
                    break
                await asyncio.sleep(min(0.25 * 2 ** attempt, 4.0))
            except Exception as exc:  # noqa: BLE001 - anything else (a local judge out of memory, a client's own
                problems.append(f"{type(exc).__name__}: {exc}")  # error) is this episode's, never the request's
                await asyncio.sleep(min(0.25 * 2 ** attempt, 4.0))
        raise JudgeError(f"{len(problems)} of {1 + spec.retries} tries failed; last: {problems[-1]}")


def verdict(record: dict[str, Any]) -> dict[str, Any]:
    return {"score": record["score"], "scores": record["scores"], "reply": record["reply"][:500]}


class _no_limit:
    async def __aenter__(self):
        return None

    async def __aexit__(self, *exc):
        return False


class JudgeRound:
    """The grading of one request's episodes, each started as it finishes (``submit``) and awaited with ``wait``.
    Episodes that ask the judge the same question (a group's equal answers) share one call."""

    def __init__(self, judge: Judge) -> None:
        self.judge = judge
        self.limit = asyncio.Semaphore(judge.spec.concurrency)
        self.asked: dict[str, asyncio.Task] = {}
        self.tasks: list[asyncio.Task] = []
        self.naming = asyncio.Lock()  # (the first episode names the judge's model; the others wait, not ask too)

    def submit(self, episode: Episode) -> None:
        """Start grading ``episode`` now (an errored one is not graded: it trains on nothing)."""
        if episode.truncation != "error":
            self.tasks.append(asyncio.ensure_future(self.attach(episode)))

    async def attach(self, episode: Episode) -> None:
        started = time.perf_counter()
        try:
            async with self.naming:
                await self.judge.ready()
            messages, key = self.judge.question(episode)
            first = key not in self.asked
            if first:
                self.asked[key] = asyncio.ensure_future(self.judge.answer(messages, key, self.limit))
            result = await asyncio.shield(self.asked[key])
        except JudgeError as exc:
            episode.truncation = "error"
            episode.info["error"] = f"judge: {exc}"
            episode.info["error_kind"] = "judge"
            episode.info["judge"] = {"error": str(exc), "seconds": time.perf_counter() - started}
            return
        shared = {} if first else {"cached": True, "attempts": 0}
        episode.info["judge"] = {**result, **shared, "seconds": time.perf_counter() - started}

    async def wait(self) -> None:
        """Every submitted episode graded; then the backend's connections of this event loop are closed."""
        try:
            await asyncio.gather(*self.tasks)
        finally:
            close = getattr(self.judge.backend, "aclose", None)
            if close is not None:
                await close()
