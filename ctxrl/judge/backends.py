"""Where a judge's replies come from: any OpenAI-compatible endpoint, or a model loaded in this process.

- ``EndpointBackend`` (``reward.judge = "http://host:port/v1"``): the Chat Completions API through the official
  ``openai`` client (the ``judge`` extra), so ``ctxrl serve`` over another checkpoint, vLLM, SGLang or a hosted API
  all work alike. ``reward.judge.model`` names the model to ask; left empty, the endpoint's first listed model (what
  ``ctxrl serve`` serves). The key is read from the environment variable ``reward.judge.api_key_env`` names.
- ``LocalBackend`` (``reward.judge`` = any ``model.name``: a checkpoint directory, a ``.gguf`` file, a named real
  model, ``tiny:...``): the model and its chat template in this process, sampled by ctxrl's ``HFEngine`` on the
  policy's device. Its conversations go through the same ``ChatRenderer`` (and its guard) as the policy's, so an
  episode's text cannot forge a turn of the judge's own prompt.

Both take the judge's messages and return its reply's text; a failure before any reply is ``JudgeUnavailable``,
``permanent`` when asking again cannot help (a 4xx other than 408/409/429: a wrong model name, a bad key).
Temperature 0 is the first ask; ``Judge`` asks again with sampling after a malformed reply.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from ctxrl.errors import ConfigError
from ctxrl.types import Message

RETRYABLE_STATUS = (408, 409, 429)


class JudgeUnavailable(Exception):
    """No reply came (``permanent``: asking again would fail the same way)."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def is_endpoint(target: str) -> bool:
    """Whether ``reward.judge`` names an HTTP endpoint (else a model to load)."""
    return target.startswith(("http://", "https://"))


def require_openai():
    """The ``openai`` module, or a one-line ``ConfigError`` naming the extra that installs it."""
    try:
        import openai
    except ImportError:
        raise ConfigError("reward.judge names an endpoint, which ctxrl asks through the official openai client; "
                          "pip install -e '.[judge]' (in a clone of ctxrl)") from None
    return openai


class EndpointBackend:
    """An OpenAI-compatible endpoint (module docstring)."""

    def __init__(self, base_url: str, model: str = "", *, api_key_env: str = "OPENAI_API_KEY",
                 timeout_s: float = 60.0) -> None:
        self.openai = require_openai()
        self.base_url, self.model, self.timeout_s = base_url.rstrip("/"), model, timeout_s
        self.api_key = os.environ.get(api_key_env, "") if api_key_env else ""
        self._client, self._loop = None, None

    @property
    def identity(self) -> dict[str, str]:
        return {"endpoint": self.base_url, "model": self.model}

    def client(self):
        """The client of the running event loop (its connections are reused within the loop; a rollout worker runs
        one loop per request and ``aclose`` ends it)."""
        import asyncio

        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = self.openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "none",
                                                   max_retries=0, timeout=self.timeout_s)
            self._loop = loop
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client, self._loop = self._client, None, None
            await client.close()

    async def ready(self) -> None:
        """Name the model before any question is keyed (``identity``): without ``reward.judge.model``, the first
        the endpoint lists (``ctxrl serve`` serves one). A verdict is then never cached under an empty model name
        that a later checkpoint behind the same URL would share."""
        if self.model:
            return
        openai, client = self.openai, self.client()
        try:
            listed = await client.models.list()
        except openai.APIStatusError as exc:
            raise JudgeUnavailable(f"{self.base_url} answered HTTP {exc.status_code} to /models: {_message(exc)}; "
                                   "set reward.judge.model") from None
        except openai.APIError as exc:
            raise JudgeUnavailable(f"{self.base_url}: {type(exc).__name__}: {exc}") from None
        if not listed.data:
            raise JudgeUnavailable(f"{self.base_url} lists no model; set reward.judge.model", permanent=True)
        self.model = listed.data[0].id

    async def complete(self, messages: list[Message], max_tokens: int, *, temperature: float = 0.0,
                       seed: int | None = None) -> str:
        await self.ready()
        openai, client = self.openai, self.client()
        try:
            response = await client.chat.completions.create(
                model=self.model, messages=[m.to_chat() for m in messages], max_tokens=max_tokens,
                temperature=temperature, **({} if seed is None else {"seed": seed}))
        except openai.APIStatusError as exc:
            permanent = exc.status_code < 500 and exc.status_code not in RETRYABLE_STATUS
            raise JudgeUnavailable(f"{self.base_url} answered HTTP {exc.status_code}: {_message(exc)}",
                                   permanent=permanent) from None
        except openai.APIError as exc:  # no answer: the connection, or the client's own timeout
            raise JudgeUnavailable(f"{self.base_url}: {type(exc).__name__}: {exc}") from None
        if not response.choices:
            raise JudgeUnavailable(f"{self.base_url} answered with no choice")
        return response.choices[0].message.content or ""


def _message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:300]
    return str(exc)[:300]


class LocalBackend:
    """A model loaded in this process (module docstring)."""

    def __init__(self, name: str, *, device: str = "cpu", dtype: str = "float32") -> None:
        from ctxrl.chat.render import ChatRenderer
        from ctxrl.engine.hf import HFEngine
        from ctxrl.models.loader import generation_end_ids, load_model, load_tokenizer

        self.name = name
        self.fingerprint = weights_fingerprint(name)
        tokenizer = load_tokenizer(name)
        self.renderer = ChatRenderer(tokenizer, template_name=name, end_ids=generation_end_ids(name))
        model = load_model(name, dtype=dtype, device=device).eval()
        self.engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, decode=self.renderer.decode)

    @property
    def identity(self) -> dict[str, str]:
        return {"local": self.name, "weights": self.fingerprint}

    async def ready(self) -> None:
        """Nothing to ask: the model is loaded."""

    async def aclose(self) -> None:
        """Nothing to close: the engine stays loaded for the next request."""

    async def complete(self, messages: list[Message], max_tokens: int, *, temperature: float = 0.0,
                       seed: int | None = None) -> str:
        from ctxrl.engine.base import SamplingParams

        ids = self.renderer.prompt_ids(messages, None)
        room = self.engine.max_total_tokens - len(ids)
        if room <= 0:
            raise JudgeUnavailable(f"the judge's prompt ({len(ids)} tokens) fills the context of {self.name!r} "
                                   f"({self.engine.max_total_tokens}); judge the answer (reward.judge.input=answer) "
                                   "or a shorter rubric", permanent=True)
        params = SamplingParams(temperature=temperature, max_new_tokens=min(max_tokens, room),
                                stop_ids=tuple(self.renderer.end_ids), seed=seed)
        completion = await self.engine.generate(ids, params)
        return self.renderer.decode(completion.token_ids[:-1] if completion.closed else completion.token_ids)


def weights_fingerprint(name: str) -> str:
    """What a local judge's cache keys name besides ``name``: the resolved directory's absolute path and the size and
    modification time of each of its files, so a relative path in another project, or a checkpoint written again
    under the same name, never meets verdicts another model gave."""
    from ctxrl.models.loader import resolve

    try:
        directory = Path(resolve(name)).resolve()
    except Exception:  # noqa: BLE001 - a hub name the loader finds later: the name is all there is to key on
        return name
    if not directory.exists():  # (a hub name the loader fetches: its name is its identity)
        return name
    files = sorted(f for f in directory.iterdir() if f.is_file()) if directory.is_dir() else [directory]
    stamp = ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    return f"{directory}|{hashlib.sha256(stamp.encode()).hexdigest()[:16]}"
