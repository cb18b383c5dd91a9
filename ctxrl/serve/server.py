"""``ctxrl serve``: an OpenAI-compatible Chat Completions endpoint over a ctxrl engine, recording sessions.

Routes (the URL scheme is the contract):

- ``POST /v1/chat/completions`` and ``GET /v1/models``: plain calls, not recorded;
- ``POST /sessions/<id>/v1/chat/completions`` and ``GET /sessions/<id>/v1/models``: a client built
  with ``base_url=http://HOST:PORT/sessions/<id>/v1`` has every call recorded into session ``<id>``'s
  episode (``ctxrl.serve.sessions``), with no custom header;
- ``POST /sessions/<id>/reward`` ``{"reward": r, "turn_rewards": [...]}``: the episode's reward;
- ``POST /sessions/<id>/finish`` ``{"reward": r}``: the reward, and the session is done (a harness
  in another process says so; ``Server.finished`` hands it to whoever trains);
- ``GET /sessions/<id>/episode``: the recorded episode as JSON (ctxrl's plain-data form).

Safe by default: ``ctxrl serve`` binds 127.0.0.1; a request on a loopback address must name a loopback
``Host`` (or one of ``allowed_hosts``) and, if it sends one, a loopback ``Origin`` (or one of
``allowed_origins``): a web page cannot reach the server through DNS rebinding; ``api_key`` makes every
route ask for ``Authorization: Bearer <key>`` (compared in constant time); a body over ``max_body_bytes``
gets 413 as soon as it passes the limit, and one not all in within ``read_timeout_s`` 408; more than
``max_concurrency`` requests at work get 429 (a request takes its slot once its body is read, and
``/health`` none); a session idle past ``session_timeout_s`` is closed and counted
(``store.expired``); a reward past ``max_abs_reward`` either way is a 400 (1e308 is a float64, but
infinite in the learner's float32). A lone surrogate (``"\\ud800"``) anywhere in a request is a 400
naming the field. Errors have OpenAI's body and 4xx codes; they are counted, the last few kept as text
(``errors``, shown by ``/health``), and the connection they came on stays open. One session's bad
request never touches another's. Rendering, tokenising and decoding run on one worker thread
(``render``), off the event loop, each client's work in turn (``limits.RenderQueue``): a huge message
delays another client's call by one render at most, never ``/health``, rewards or the replies being
sent; and a message past the context is refused having tokenised little more than the context holds
(``exceeds``). (One thread, not several: a Hugging Face fast tokenizer switches shared state,
``split_special_tokens``, on every call.) ``ctxrl.serve.limits`` holds these guards.

Needs the ``serve`` extra (FastAPI, uvicorn): ``pip install -e '.[serve]'``.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import math
import queue
import re
import socket
from collections.abc import Callable, Hashable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError as TemplateRefused
from starlette.exceptions import HTTPException as StarletteHTTPException

from ctxrl.chat.surrogates import find_surrogate
from ctxrl.engine.base import SamplingParams
from ctxrl.errors import ConfigError
from ctxrl.plain import to_json
from ctxrl.rollout.recorder import Rerendered
from ctxrl.seeds import derive_seed
from ctxrl.serve.limits import ErrorLog, Guard, RenderQueue, Slots, host_check, read_body
from ctxrl.serve.protocol import (
    APIError,
    ChatRequest,
    Choice,
    bad,
    completion_json,
    new_id,
    parse_request,
    stream_chunks,
    view,
)
from ctxrl.serve.sessions import Session, SessionStore
from ctxrl.types import MAX_ABS_REWARD

MAX_DEPTH = 64
"""How deeply a request's JSON may nest (a tool's parameter schema is the deepest part of a real request)."""
MAX_SESSION_ID = 256
"""The longest session id a client may open (ids are kept while the session lives)."""
SESSION_ID = re.compile(rf"[!-~]{{1,{MAX_SESSION_ID}}}")
"""A session id: visible ASCII characters (it is echoed in a header, which takes no control character)."""
MAX_BODY_BYTES = 4 << 20
"""The largest request body ``Server`` reads (a larger one is a 413)."""
MAX_SESSIONS = 4096
"""Sessions ``Server`` keeps open at once."""
RENDERS_PER_CLIENT = 4
"""The default renders one client (one connection) may have waiting or running (``Server.renders_per_client``)."""
RENDER = RenderQueue()
"""The one thread every server of this process renders, tokenises and decodes on (see the module docstring)."""


async def render(client: Hashable, limit: int, fn: Callable, *args):
    """``fn(*args)`` on the render thread in ``client``'s turn (at most ``limit`` of its renders at once), the event
    loop free meanwhile; a chat template's own refusal of the messages (Jinja's ``raise_exception``: roles that do
    not alternate, say) is the client's 400."""
    try:
        return await asyncio.wrap_future(RENDER.submit(client, functools.partial(fn, *args), limit))
    except TemplateRefused as exc:
        raise bad(f"the model's chat template refused these messages: {exc}", "messages") from None


def exceeds(encode: Callable[[str], list[int]], text: str, limit: int) -> bool:
    """Whether ``text`` takes more than ``limit`` tokens, found by tokenising little more of it than that: prefixes
    of ``4 * limit`` characters, doubled while they hold fewer tokens, each cut before a space (where a tokenizer
    starts a token anyway). False when no prefix short of the whole text passes the limit: the full render counts."""
    size = 4 * limit
    while size < len(text):
        cut = text.rfind(" ", size // 2, size)
        if len(encode(text[:cut if cut > 0 else size])) > limit:
            return True
        size *= 2
    return False


def check_settings(*, max_total_tokens: int, max_new_tokens: int, max_concurrency: int, max_body_bytes: int,
                   read_timeout_s: float, session_timeout_s: float, max_sessions: int, max_abs_reward: float,
                   renders_per_client: int) -> None:
    """A ``ConfigError`` naming the first setting out of range (``ctxrl serve --read-timeout nan``), before anything
    is served."""
    counts = {"max_total_tokens": max_total_tokens, "max_new_tokens": max_new_tokens,
              "max_concurrency (--max-concurrency)": max_concurrency, "max_body_bytes": max_body_bytes,
              "max_sessions": max_sessions, "renders_per_client": renders_per_client}
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"ctxrl serve: {name} must be a whole number >= 1, got {value!r}")
    finite = {"read_timeout_s (--read-timeout)": read_timeout_s, "max_abs_reward": max_abs_reward}
    for name, value in {**finite, "session_timeout_s (--session-timeout)": session_timeout_s}.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (
                name in finite and math.isinf(value)):
            kind = "a finite number" if name in finite else "a number (inf: never)"
            raise ConfigError(f"ctxrl serve: {name} must be {kind} > 0, got {value!r}")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` for uvicorn (``uvicorn.Server.run(sockets=[...])``), bound before anything
    says it serves; a ``ConfigError`` for a port that is not one (1-65535, or 0: any free one) or is in use."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"ctxrl serve: {port!r} is not a port number: use 1-65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        in_use = exc.errno == errno.EADDRINUSE
        problem = "is in use (another server listens there)" if in_use else f"cannot be bound ({exc.strerror})"
        raise ConfigError(f"ctxrl serve: {host}:{port} {problem}; choose another --port or --host") from None
    return sock


class Server:
    """The endpoint's state: engine, renderer, sessions and limits; ``app()`` is the ASGI application."""

    def __init__(self, engine, renderer, *, model_name: str, max_total_tokens: int, max_new_tokens: int = 512,
                 stop_ids: tuple[int, ...] = (), api_key: str | None = None, max_concurrency: int = 256,
                 max_body_bytes: int = MAX_BODY_BYTES, read_timeout_s: float = 30.0, session_timeout_s: float = 600.0,
                 max_sessions: int = MAX_SESSIONS, aliases: tuple[str, ...] = (), client_sessions: bool = True,
                 max_abs_reward: float = MAX_ABS_REWARD, allowed_hosts: tuple[str, ...] = (),
                 allowed_origins: tuple[str, ...] = (), renders_per_client: int = RENDERS_PER_CLIENT) -> None:
        check_settings(max_total_tokens=max_total_tokens, max_new_tokens=max_new_tokens,
                       max_concurrency=max_concurrency, max_body_bytes=max_body_bytes, read_timeout_s=read_timeout_s,
                       session_timeout_s=session_timeout_s, max_sessions=max_sessions, max_abs_reward=max_abs_reward,
                       renders_per_client=renders_per_client)
        self.engine, self.renderer = engine, renderer
        self.model_name = model_name
        self.models = (model_name, *aliases)
        self.max_total_tokens, self.max_new_tokens = max_total_tokens, max_new_tokens
        self.stop_ids = tuple(dict.fromkeys((*renderer.end_ids, *stop_ids)))
        self.api_key = api_key
        self.max_body_bytes, self.read_timeout_s = max_body_bytes, read_timeout_s
        self.slots = Slots(max_concurrency)
        self.store = SessionStore(renderer, max_sessions=max_sessions, timeout_s=session_timeout_s)
        self.client_sessions = client_sessions
        """Whether a call to an unknown session opens it (a trainer's server: no, it opens its sessions itself)."""
        self.on_finish: Callable[[Session], None] | None = None
        self.stop_strings: tuple[str, ...] = ()
        self.claims: queue.Queue[Session] | None = None
        """Sessions a trainer opened for harnesses in other processes to claim (``GET /train/next``)."""
        self.errors = ErrorLog()
        """Errors answered (counted, the last few as text) and the first engine failure, for a trainer to stop on."""
        self.max_abs_reward = max_abs_reward
        """The largest reward, either way, a client may post: past it, a 400 (the learner computes in float32)."""
        self.allowed_hosts, self.allowed_origins = tuple(allowed_hosts), tuple(allowed_origins)
        """``Host`` and ``Origin`` values allowed besides loopback ones (``name:*``: any port; ``limits.Guard``)."""
        self.hosts = host_check(self.allowed_hosts, self.allowed_origins)  # (now: without mcp, one line at start)
        self.renders_per_client = renders_per_client

    @property
    def in_flight(self) -> int:
        """Requests at work (rendering or sampling) now."""
        return self.slots.in_use

    # -- the work ----------------------------------------------------------------------------------
    async def chat(self, request: ChatRequest, session_id: str | None,
                   client: Hashable = "in-process") -> tuple[dict | list[dict], int]:
        """``(response JSON or stream chunks, prompt tokens)`` for one validated request; ``client`` (its connection)
        says whose turn on the render thread it takes."""
        choices, prompt_tokens = await self.complete(request, session_id, client)
        if request.stream:
            return stream_chunks(request, request.model, choices, prompt_tokens, new_id()), prompt_tokens
        return completion_json(request, request.model, choices, prompt_tokens, new_id()), prompt_tokens

    async def complete(self, request: ChatRequest, session_id: str | None,
                       client: Hashable = "in-process") -> tuple[list[Choice], int]:
        """``(the sampled replies, prompt tokens)`` for one validated request, recorded into ``session_id``'s episode
        when given: the work of every protocol (Chat Completions here, ``ctxrl.serve.anthropic`` and
        ``ctxrl.serve.responses`` translate theirs into a ``ChatRequest`` and the replies back)."""
        if request.model not in self.models:
            raise APIError(404, f"the model {request.model!r} does not exist; this server serves "
                                f"{', '.join(map(repr, self.models))}", type="invalid_request_error",
                           param="model", code="model_not_found")
        if session_id is None:
            with self.slots.take():
                ids = await self._render(client, self._within_context, request, self.renderer.prompt_ids,
                                         request.messages, request.tools)
                self._check_length(len(ids))
                return await self._sample(request, ids, None, None, client)
        if request.n > 1:
            raise bad("n > 1 in a recorded session: one session is one episode; send n = 1, or open a "
                      "session per sample", "n")
        check_session_id(session_id)
        session = self.store.get(session_id, create=self.client_sessions)
        if session.finished:
            raise APIError(409, f"session {session_id!r} is finished", type="invalid_request_error",
                           param="session", code="session_finished")
        with self.slots.take():
            async with session.lock:
                try:
                    kind, ids = await self._render(client, self._within_context, request, session.plan,
                                                   request.messages, request.views, request.tools)
                    self._check_length(session.length_after(kind, ids))
                except APIError:
                    if not len(session.recorder) and not session.episode.segments and self.client_sessions:
                        self.store.pop(session_id)  # a first call that failed opens nothing
                    raise
                # (a template that rewrote history gives the whole conversation anew: Rerendered ids)
                extends = kind == "extend" and not isinstance(ids, Rerendered)
                prompt = session.recorder.ids + list(ids) if extends else list(ids)
                return await self._sample(request, prompt, session, (kind, ids), client)

    def _render(self, client: Hashable, fn: Callable, *args):
        return render(client, self.renders_per_client, fn, *args)

    def _within_context(self, request: ChatRequest, fn: Callable, *args):
        """``fn(*args)`` (a render), unless the request's text alone takes more than the context (``exceeds``): then
        a 400 having tokenised little more than the context holds, not the whole of a 4 MB message."""
        texts = [m.content for m in request.messages] + [json.dumps(t) for t in request.tools or ()]
        texts += [json.dumps(c.arguments) for m in request.messages for c in m.tool_calls]
        if exceeds(self.renderer.encode_plain, "\n".join(texts), self.max_total_tokens):
            raise APIError(400, f"this model's maximum context length is {self.max_total_tokens} tokens; the "
                                "messages take more", param="messages", code="context_length_exceeded")
        return fn(*args)

    def _check_length(self, length: int) -> None:
        if length >= self.max_total_tokens:
            raise APIError(400, f"this model's maximum context length is {self.max_total_tokens} tokens; the "
                                f"messages take {length}", param="messages", code="context_length_exceeded")

    async def _sample(self, request: ChatRequest, prompt: list[int], session: Session | None, plan,
                      client: Hashable):
        budget = min(request.max_tokens or self.max_new_tokens, self.max_total_tokens - len(prompt))
        temperature, top_p, top_k = request.temperature, request.top_p, request.top_k
        seed = request.seed
        if session is not None and session.sampling is not None:
            temperature, top_p, top_k = session.sampling
        if session is not None and session.seed is not None:
            seed = derive_seed(session.seed, session.turns)
        stops = tuple(dict.fromkeys((*self.stop_strings, *request.stop)))
        params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=budget,
                                 stop_ids=self.stop_ids, stop_strings=stops,
                                 seed=None if seed is None else seed + i) for i in range(request.n)]
        try:
            completions = await asyncio.gather(*(self.engine.generate(prompt, p) for p in params))
        except Exception as exc:  # noqa: BLE001 - the engine failed: kept (as text) for a trainer to stop on
            self.errors.engine_failed(exc)
            raise APIError(500, f"the engine failed: {type(exc).__name__}: {exc}"[:300], type="server_error",
                           code="engine_error") from None
        choices, parsed = await self._render(client, self._replies, request, completions, stops)
        if session is not None:
            kind, ids = plan
            session.commit(kind, ids, request.messages, request.views, request.tools)
            completion, message, text, client_view = parsed[0]
            session.reply(completion, message, text, client_view, len(prompt))
        return choices, len(prompt)

    def _replies(self, request: ChatRequest, completions: list, stops: tuple[str, ...]) -> tuple[list, list]:
        """Each completion decoded and parsed: ``(choices to send, (completion, message, text, view) to record)``."""
        choices, parsed = [], []
        for completion in completions:
            text = self.renderer.decode(completion.token_ids[:-1] if completion.closed else completion.token_ids)
            stopped_by = None
            if completion.finish_reason == "stop_string":  # OpenAI's reply ends before its stop sequence
                found = [(i, stop) for i, stop in ((text.find(stop), stop) for stop in stops) if i >= 0]
                cut, stopped_by = min(found, default=(len(text), None))
                text = text[:cut]
            message = self.renderer.parse_assistant(text)
            calls = message.tool_calls if request.tools and request.tool_choice != "none" else []
            content = self.renderer.tool_format.content_without_calls(text) if calls else text
            finish = "tool_calls" if calls else "length" if completion.truncated else "stop"
            texts = []  # each token's text: only a stream or log-probs show it
            if request.stream or request.logprobs:
                texts = [self.renderer.decode([t]) for t in completion.token_ids]
                if completion.closed:
                    texts[-1] = ""  # the end-of-turn token is not part of the reply's text
            choices.append(Choice(content or (None if calls else ""), calls, finish, texts, completion.logprobs,
                                  len(completion.token_ids), stopped_by))
            parsed.append((completion, message, text, view("assistant", content or "", calls, None)))
        return choices, parsed

    async def body(self, request: Request) -> Any:
        """The request's JSON body, read within this server's limits (what every protocol's route reads first)."""
        return await _body_of(self, request)

    @staticmethod
    def check_session_id(session_id: str) -> None:
        """A 400 for a session id no header may echo (``check_session_id``), for the other protocols' routes."""
        check_session_id(session_id)

    def raise_internal(self) -> None:
        """Raise the first engine failure met while serving (a harness saw it as a 500), if any. Other errors,
        a client's included, are answered and counted (``errors``) and never stop a trainer."""
        if self.errors.engine_failure is not None:
            raise RuntimeError(f"the engine failed while serving a session:\n{self.errors.engine_failure}")

    def set_reward(self, session_id: str, body: Any, *, finish: bool) -> dict:
        """Check the whole body first: a rejected request changes nothing."""
        check_session_id(session_id)
        session = self.store.get(session_id, create=False)
        if not isinstance(body, dict):
            raise bad("the body must be a JSON object")
        reward = body.get("reward")
        if reward is None and not finish:
            raise bad("reward is required", "reward")
        if reward is not None:
            reward = self._reward(reward, "reward")
        turn_rewards = body.get("turn_rewards")
        turns = session.episode.turns
        if turn_rewards is not None:
            if not isinstance(turn_rewards, list) or len(turn_rewards) != len(turns):
                raise bad(f"turn_rewards must be a list of {len(turns)} numbers (one per recorded turn)",
                          "turn_rewards")
            turn_rewards = [self._reward(r, f"turn_rewards[{i}]", "turn_rewards") for i, r in enumerate(turn_rewards)]
        if "success" in body and not isinstance(body["success"], bool):
            raise bad("success must be true or false", "success")
        if reward is not None:
            session.episode.reward = reward
            session.episode.success = bool(body.get("success", reward > 0))
        for turn, r in zip(turns, turn_rewards or []):
            turn.reward = r
        if finish:
            session.finished = True
            if self.on_finish is not None:
                self.on_finish(session)
        return {"session": session_id, "reward": session.episode.reward, "turns": len(session.episode.turns),
                "finished": session.finished}

    def _reward(self, value: Any, field: str, param: str | None = None) -> float:
        """``value`` as a finite float within ``max_abs_reward`` either way, or a 400 naming ``field``."""
        reward = _finite(value, field, param)
        if abs(reward) > self.max_abs_reward:
            raise bad(f"{field} is {reward:g}, past this server's max_abs_reward = {self.max_abs_reward:g} either way "
                      "(the learner computes in float32, where 1e308 is infinite): scale the reward down",
                      param or field)
        return reward

    def episode_json(self, session_id: str) -> dict:
        check_session_id(session_id)
        return json.loads(to_json(self.store.get(session_id, create=False).episode))

    # -- the ASGI app ----------------------------------------------------------------------------
    def app(self):
        """The ASGI application: the guard (key, declared body size, errors inside ctxrl), OpenAI's error bodies,
        then the routes."""
        app = FastAPI(title="ctxrl", docs_url=None, redoc_url=None, openapi_url=None)
        _add_error_handlers(app, self)
        app.add_middleware(Guard, api_key=self.api_key, max_body_bytes=self.max_body_bytes, errors=self.errors,
                           hosts=self.hosts)
        _add_openai_routes(app, self)
        from ctxrl.serve import anthropic, responses  # (the other protocols: their own modules, the same sessions)

        anthropic.add_routes(app, self)
        responses.add_routes(app, self)
        _add_session_routes(app, self)
        _add_training_routes(app, self)
        _add_health_route(app, self)
        return app


def check_session_id(session_id: str) -> None:
    """A 400 for a session id that is not 1-256 visible ASCII characters (``a%00b`` is ``a\\x00b``, which no header
    may echo)."""
    if not SESSION_ID.fullmatch(session_id):
        shown = session_id if len(session_id) <= 40 else session_id[:40] + "..."
        raise bad(f"a session id is 1-{MAX_SESSION_ID} visible ASCII characters (letters, digits, - _ . :), got "
                  f"{shown!r}", "session")


def _finite(value: Any, field: str, param: str | None = None) -> float:
    """``value`` as a finite float, or a 400 naming ``field`` (NaN and Infinity cannot come from JSON; an integer
    too large for a float can)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"{field} must be a number, got {type(value).__name__}", param or field)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise bad(f"{field} must be a finite number (it is too large for a float)", param or field)
    return number


def _add_error_handlers(app: FastAPI, server: Server) -> None:
    """Every error gets OpenAI's body and is counted (``Server.errors``); errors inside ctxrl are the guard's."""

    def answer(error: APIError, request: Request | None = None) -> JSONResponse:
        server.errors.record(error)
        body = error.body()
        if request is not None and request.url.path.endswith("/v1/messages"):  # (Anthropic's clients read theirs)
            body = {"type": "error", "error": {"type": error.type, "message": error.message, "param": error.param}}
        # (a body that never finished arriving leaves the connection unusable: close it; a finished session stays
        # finished, so the OpenAI SDK, which retries a 409 by default, is told not to)
        headers = {"connection": "close"} if error.status == 408 else {"x-should-retry": "false"} \
            if error.status == 409 else None
        return JSONResponse(body, status_code=error.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return answer(exc, request)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return answer(bad(f"invalid request: {exc.errors()[:1]}"), request)

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request, exc: StarletteHTTPException):  # (no such route, or not with this method)
        if exc.status_code == 404:
            return answer(APIError(404, f"no route {request.method} {request.url.path}", type="not_found_error",
                                   code="unknown_url"))
        return answer(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                               code="method_not_allowed" if exc.status_code == 405 else None))


async def _body_of(server: Server, request: Request) -> Any:
    """The request's JSON body (``null`` when empty), read within the limits (``read_body``) and parsed off the
    event loop."""
    raw = await read_body(request, server.max_body_bytes, server.read_timeout_s)
    return await asyncio.to_thread(parse_body, raw)


def parse_body(raw: bytes) -> Any:
    """A request body as JSON (``null`` when empty), or a 400 that says what is wrong: not UTF-8, not JSON, nested
    too deeply for the reader, or a NaN / Infinity (which JSON does not have) or a number too large for a float at
    the field it names."""
    try:
        text = (raw or b"null").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"the body is not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r}); send JSON encoded "
                  "as UTF-8") from None
    constants = []
    try:
        body = json.loads(text, parse_constant=lambda name: constants.append(name) or float(name),
                          parse_float=lambda literal: _float_literal(literal, constants))
    except json.JSONDecodeError as exc:
        raise bad(f"the body is not JSON: {exc}") from None
    except ValueError as exc:  # (an integer of more digits than Python converts: 4300)
        raise bad(f"the body holds a number ctxrl cannot read: {str(exc)[:120]}") from None
    except RecursionError:
        raise bad("the body's JSON nests too deeply to read") from None
    if constants:
        try:
            path = _non_finite(body) or "the body"
        except RecursionError:  # (nested as deep as the reader allows)
            path = "the body"
        raise bad(f"{path} is {constants[0]}: JSON numbers must be finite", param=path)
    if _deeper_than(body, MAX_DEPTH):
        raise bad(f"the body's JSON nests too deeply: more than {MAX_DEPTH} levels")
    found = find_surrogate(body) if SURROGATE_ESCAPE.search(text) else None
    if found is not None:
        raise bad(surrogate_message(found), param=found)
    return body


SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""The JSON escape of a surrogate (a body without one holds no lone surrogate: UTF-8 cannot encode one)."""


def surrogate_message(where: str) -> str:
    return (f"{where} holds a lone surrogate (a \\ud800-\\udfff escape without its pair), which is not text; "
            "send valid Unicode")


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and objects more than ``limit`` deep (without recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _float_literal(literal: str, constants: list[str]) -> float:
    """A JSON number literal as a float; one too large for a float (``1e999``) is noted as ``constants`` are."""
    value = float(literal)
    if math.isinf(value):
        constants.append(literal)
    return value


def _non_finite(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].x``) of the first NaN or infinite number in a parsed body, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key)
        if found is not None:
            return found
    return None


async def _completions(server: Server, request: Request, session_id: str | None):
    """One Chat Completions call, as JSON or as server-sent events; recorded when ``session_id`` is given."""
    body = await _body_of(server, request)
    chat = await asyncio.to_thread(parse_request, body, max_total_tokens=server.max_total_tokens)
    result, _ = await server.chat(chat, session_id, tuple(request.client) if request.client else "in-process")
    headers = {"x-ctxrl-session": session_id or "none"}
    if not chat.stream:
        return JSONResponse(result, headers=headers)

    async def events():
        for chunk in result:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _models_json(server: Server) -> dict:
    """``GET /v1/models``: the served name and its aliases."""
    return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "ctxrl"}
                                       for m in server.models]}


def _add_openai_routes(app: FastAPI, server: Server) -> None:
    """OpenAI's two routes, plain (not recorded) and under ``/sessions/<id>`` (recorded into that session)."""

    @app.get("/v1/models")
    async def list_models():
        return _models_json(server)

    @app.get("/sessions/{session_id}/v1/models")
    async def list_models_in_session(session_id: str):
        return _models_json(server)

    @app.post("/v1/chat/completions")
    async def plain(request: Request):
        return await _completions(server, request, None)

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def in_session(session_id: str, request: Request):
        return await _completions(server, request, session_id)


def _add_session_routes(app: FastAPI, server: Server) -> None:
    """A session's reward, its end, and its recorded episode."""

    @app.post("/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request):
        return server.set_reward(session_id, await _body_of(server, request), finish=False)

    @app.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        return server.set_reward(session_id, await _body_of(server, request), finish=True)

    @app.get("/sessions/{session_id}/episode")
    async def episode(session_id: str):
        return server.episode_json(session_id)


def _add_training_routes(app: FastAPI, server: Server) -> None:
    """``GET /train/next``: while a trainer runs (``ctxrl serve --train``), the sessions it opened, to claim."""

    @app.get("/train/next")
    async def next_task(wait: float = 30.0):
        """A session a trainer opened, with its task: a harness in another process plays it, then finishes it."""
        if server.claims is None:
            raise APIError(404, "this server is not training: start it with ctxrl serve --train",
                           type="not_found_error", code="not_training")
        deadline = asyncio.get_running_loop().time() + max(0.0, min(wait, 300.0))
        while True:
            try:
                session = server.claims.get_nowait()
            except queue.Empty:
                if asyncio.get_running_loop().time() >= deadline:
                    return JSONResponse({"session": None}, status_code=200)
                await asyncio.sleep(0.01)
                continue
            if session.id in server.store.sessions:  # (not given up on by the trainer meanwhile)
                task = json.loads(to_json(session.episode.task))
                return {"session": session.id, "task": task, "base_url": f"/sessions/{session.id}/v1"}


def _add_health_route(app: FastAPI, server: Server) -> None:
    """``GET /health``: up, with the sessions open and expired and the policy version being served."""

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.model_name, "sessions": len(server.store.sessions),
                "expired_sessions": server.store.expired, "policy_version": server.engine.policy_version,
                "in_flight": server.in_flight, "errors": server.errors.summary()}
