"""``ctxrl serve`` against a live uvicorn server, driven by the official ``openai`` client.

One uvicorn server (a background thread, port 0) serves several ``Server`` objects over the one tiny
calculator model, each mounted under its own prefix so they share one event loop (the HF engine binds
its worker to the loop it first runs in):

- ``/``: the main server (no key, default limits);
- ``/keyed``: ``api_key="k"``;
- ``/small``: ``max_body_bytes=300``;
- ``/one``: ``max_concurrency=1`` over an engine that waits 0.5 s before sampling;
- ``/ttl``: ``session_timeout_s=0.2``.

The engine is only ever called through HTTP; test-side token counts use a second renderer built from
the same spec (the server's tokenizer is never touched from the test thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Mount  # noqa: E402

from ctxrl.envs.calculator import CalculatorEnv  # noqa: E402
from ctxrl.serve.server import Server  # noqa: E402
from ctxrl.tools.calculator import calculator_tool  # noqa: E402
from ctxrl.types import Message  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
TOOLS = [calculator_tool().schema()]
SYSTEM = CalculatorEnv.system_prompt
MAX_TOTAL = 512


# -- fixtures ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack():
    """The tiny calculator model's renderer and HF engine (as ``ctxrl serve`` builds them), plus a
    second renderer for the test thread's own token counting."""
    from ctxrl.config import load_config
    from ctxrl.models.loader import load_model
    from ctxrl.rollout.spec import RolloutSpec, spec_engine
    from ctxrl.rollout.worker import spec_renderer

    cfg = load_config(str(ROOT / "examples" / "calculator_tiny.toml"), ["model.device=cpu"])
    spec = RolloutSpec.from_config(cfg)
    renderer = spec_renderer(spec)
    model = load_model(spec.model.name, dtype="float32", device="cpu")
    model.eval()
    engine = spec_engine(spec, model, renderer)
    yield SimpleNamespace(renderer=renderer, engine=engine, ref=spec_renderer(spec))
    engine.close()


class SlowEngine:
    """The real engine, waiting ``delay`` seconds before each request (keeps a request in flight)."""

    def __init__(self, engine, delay: float) -> None:
        self.engine, self.delay = engine, delay

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, prompt_ids, params):
        await asyncio.sleep(self.delay)
        return await self.engine.generate(prompt_ids, params)


@pytest.fixture(scope="module")
def live(stack):
    def server(engine=stack.engine, **kw) -> Server:
        return Server(engine, stack.renderer, model_name=MODEL, max_total_tokens=MAX_TOTAL, max_new_tokens=32, **kw)

    servers = {
        "keyed": server(api_key="k"),
        "small": server(max_body_bytes=300),
        "one": server(SlowEngine(stack.engine, 0.5), max_concurrency=1),
        "ttl": server(session_timeout_s=0.2),
        "main": server(aliases=("tiny-alias",)),
    }
    routes = [Mount(f"/{name}", app=s.app()) for name, s in servers.items() if name != "main"]
    app = Starlette(routes=[*routes, Mount("", app=servers["main"].app())])
    with serving(app, "ctxrl-serve-test") as port:
        base = f"http://127.0.0.1:{port}"
        http = httpx.Client(base_url=base, timeout=60)
        yield SimpleNamespace(base=base, http=http, **servers)
        http.close()


@contextlib.contextmanager
def serving(app, name: str):
    """``app`` served by uvicorn on a free loopback port in a thread; yields the port, stops it after."""
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield uv.servers[0].sockets[0].getsockname()[1]
    finally:
        uv.should_exit = True
        thread.join(timeout=15)
    assert not thread.is_alive()


def client(live, prefix: str = "", *, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base}{prefix}/v1", api_key=api_key, max_retries=0, timeout=60)


def session_client(live, sid: str, prefix: str = "") -> openai.OpenAI:
    return client(live, f"{prefix}/sessions/{sid}")


def episode(live, sid: str, prefix: str = "") -> dict:
    r = live.http.get(f"{prefix}/sessions/{sid}/episode")
    assert r.status_code == 200, r.text
    return r.json()


def assert_invariants(ep: dict) -> None:
    for seq in [ep, *ep["segments"]]:
        n = len(seq["input_ids"])
        assert n == len(seq["loss_mask"]) == len(seq["behavior_logprobs"]) == len(seq["turn_index"])
        assert set(seq["loss_mask"]) <= {0, 1}
        assert all(lp == 0.0 for lp, m in zip(seq["behavior_logprobs"], seq["loss_mask"]) if not m)
        assert all(lp <= 0.0 for lp in seq["behavior_logprobs"])
        assert all(t >= 0 for t, m in zip(seq["turn_index"], seq["loss_mask"]) if m)


def sampled(ep: dict, turn: int) -> tuple[list[int], list[float]]:
    """Ids and log-probs the episode's live sequence holds as sampled (mask 1) for ``turn``."""
    rows = [(i, lp) for i, lp, m, t in zip(ep["input_ids"], ep["behavior_logprobs"], ep["loss_mask"],
                                          ep["turn_index"]) if m and t == turn]
    return [i for i, _ in rows], [lp for _, lp in rows]


def first_sampled(ep: dict, turn: int) -> int:
    return next(k for k, (m, t) in enumerate(zip(ep["loss_mask"], ep["turn_index"])) if m and t == turn)


def calc_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def as_messages(raw: list[dict]) -> list[Message]:
    return [Message(m["role"], m["content"]) for m in raw]


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# -- 1. plain completions --------------------------------------------------------------------------

def test_plain_completion_usage_determinism_and_models(live, stack):
    c = client(live)
    messages = [{"role": "user", "content": "What is 3 plus 4?"}]
    r = c.chat.completions.create(model=MODEL, messages=messages, seed=7, max_tokens=24)
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 1
    choice = r.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs is None  # not asked for
    assert r.usage.prompt_tokens == len(stack.ref.prompt_ids(as_messages(messages), None))
    assert 1 <= r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 24

    again = c.chat.completions.create(model=MODEL, messages=messages, seed=7, max_tokens=24)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage == r.usage and again.id != r.id

    # the raw response names no session
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages, seed=7, max_tokens=24)
    assert raw.headers["x-ctxrl-session"] == "none"
    assert raw.parse().choices[0].message.content == choice.message.content

    # an alias is served too, and echoed back
    alias = c.chat.completions.create(model="tiny-alias", messages=messages, seed=7, max_tokens=24)
    assert alias.model == "tiny-alias" and alias.choices[0].message.content == choice.message.content

    ids = [m.id for m in c.models.list()]
    assert ids == [MODEL, "tiny-alias"]
    assert [m.id for m in session_client(live, "models-only").models.list()] == [MODEL, "tiny-alias"]
    health = live.http.get("/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL
    # listing models in a session's URL opens no session
    assert live.http.get("/sessions/models-only/episode").status_code == 404


def test_stop_sequence_is_not_in_the_content(live):
    c = client(live)
    messages = [{"role": "user", "content": "What is 3 plus 4?"}]
    full = c.chat.completions.create(model=MODEL, messages=messages, seed=7, max_tokens=24).choices[0].message.content
    assert len(full) >= 6
    stop = full[3:5]
    r = c.chat.completions.create(model=MODEL, messages=messages, seed=7, max_tokens=24, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    content = r.choices[0].message.content
    assert stop not in content and full.startswith(content)


def test_unknown_route_is_an_openai_404(live):
    r = live.http.post("/v2/chat/completions", json={})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "unknown_url"


# -- 2. streaming ---------------------------------------------------------------------------------

def test_streaming_matches_the_plain_reply(live):
    c = client(live)
    messages = [{"role": "user", "content": "Compute 21 minus 9."}]
    plain = c.chat.completions.create(model=MODEL, messages=messages, seed=11, max_tokens=24, logprobs=True)
    stream = c.chat.completions.create(model=MODEL, messages=messages, seed=11, max_tokens=24, stream=True,
                                       stream_options={"include_usage": True}, logprobs=True)
    chunks = list(stream)
    assert chunks and all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage == plain.usage
    assert all(ch.usage is None for ch in chunks[:-1])
    # the streamed log-probs are the plain reply's (the end-of-turn token carries no text and no delta)
    streamed = [t.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    expected = [t.logprob for t in plain.choices[0].logprobs.content if t.token]
    assert streamed == pytest.approx(expected, abs=1e-6)

    # without include_usage no usage chunk is sent
    bare = list(c.chat.completions.create(model=MODEL, messages=messages, seed=11, max_tokens=24, stream=True))
    assert all(ch.usage is None for ch in bare) and bare[-1].choices[0].finish_reason is not None


# -- 3. a tool-call round trip in a session --------------------------------------------------------

def find_tool_call_seed(live, messages: list[dict]) -> int:
    c = client(live)
    for seed in range(31):
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, seed=seed, max_tokens=32)
        if r.choices[0].finish_reason == "tool_calls":
            return seed
    pytest.fail("the tiny model wrote no tool call for seeds 0..30")


def test_tool_call_round_trip_is_recorded_token_faithfully(live, stack):
    first = calc_messages("What is 12 plus 30?")
    seed = find_tool_call_seed(live, first)
    c = session_client(live, "tools-1")
    r1 = c.chat.completions.create(model=MODEL, messages=first, tools=TOOLS, seed=seed, max_tokens=32, logprobs=True)
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "calculator"
    assert isinstance(json.loads(call.function.arguments)["expression"], str)
    assert call.id
    first_prompt = stack.ref.prompt_ids(as_messages(first), TOOLS)
    assert r1.usage.prompt_tokens == len(first_prompt)

    messages = [*first, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    r2 = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, seed=seed, max_tokens=32)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.completion_tokens >= 1

    ep = episode(live, "tools-1")
    assert_invariants(ep)
    assert ep["segments"] == [] and "edited" not in ep["info"]
    ids, mask, turns = ep["input_ids"], ep["loss_mask"], ep["turn_index"]
    assert sum(mask) == r1.usage.completion_tokens + r2.usage.completion_tokens
    # the first prompt, rendered whole, opens the sequence
    assert ids[:len(first_prompt)] == first_prompt
    assert mask[:len(first_prompt)] == [0] * len(first_prompt) and turns[:len(first_prompt)] == [-1] * len(first_prompt)
    # then what the first call sampled, exactly: its log-probs and tokens are the response's
    ids0, lps0 = sampled(ep, 0)
    assert first_sampled(ep, 0) == len(first_prompt)
    assert len(ids0) == r1.usage.completion_tokens == len(choice.logprobs.content)
    assert lps0 == pytest.approx([t.logprob for t in choice.logprobs.content], abs=1e-6)
    ref = stack.ref
    assert [t.token for t in choice.logprobs.content][:-1] == [ref.decode([i]) for i in ids0[:-1]]
    assert ids0[-1] in ref.end_ids and choice.logprobs.content[-1].token == ""  # closed by its end-of-turn token
    # then the tool result (context, turn 0), then the second reply (turn 1): the second call's prompt is the
    # whole sequence before its reply, so every earlier id is exactly where the model saw it
    start1 = first_sampled(ep, 1)
    assert r2.usage.prompt_tokens == start1
    observation = ids[len(first_prompt) + len(ids0):start1]
    assert mask[len(first_prompt) + len(ids0):start1] == [0] * len(observation)
    assert turns[len(first_prompt) + len(ids0):start1] == [0] * len(observation)
    assert "42" in ref.decode(observation)
    assert len(sampled(ep, 1)[0]) == r2.usage.completion_tokens == len(ids) - start1
    # the episode's bookkeeping
    assert [t["prompt_tokens"] for t in ep["turns"]] == [r1.usage.prompt_tokens, r2.usage.prompt_tokens]
    assert [t["sampled_tokens"] for t in ep["turns"]] == [r1.usage.completion_tokens, r2.usage.completion_tokens]
    assert ep["turns"][0]["tool_calls"] == 1
    assert [m["role"] for m in ep["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert ep["messages"][2]["tool_calls"][0]["name"] == "calculator"


# -- 4. an edited history starts a new segment ----------------------------------------------------

def test_edited_history_starts_a_segment(live, stack):
    c = session_client(live, "edit-1")
    first = calc_messages("Compute 5 times 6.")
    r1 = c.chat.completions.create(model=MODEL, messages=first, tools=TOOLS, seed=3, max_tokens=16)
    # a retry: the same messages again (the last assistant message dropped)
    r2 = c.chat.completions.create(model=MODEL, messages=first, tools=TOOLS, seed=4, max_tokens=16)
    ep = episode(live, "edit-1")
    assert_invariants(ep)
    assert len(ep["segments"]) == 1 and ep["segments"][0]["ended_by"] == "edited"
    assert ep["info"]["edited"] == 1
    closed = ep["segments"][0]
    prompt = stack.ref.prompt_ids(as_messages(first), TOOLS)
    assert closed["input_ids"][:len(prompt)] == prompt and sum(closed["loss_mask"]) == r1.usage.completion_tokens
    assert ep["input_ids"][:len(prompt)] == prompt and sum(ep["loss_mask"]) == r2.usage.completion_tokens
    assert r2.usage.prompt_tokens == len(prompt)
    assert ep["turn_index"][:len(prompt)] == [-1] * len(prompt)

    # an earlier user message changed: another segment
    changed = calc_messages("Compute 7 times 8.")
    reply = {"role": "assistant", "content": r2.choices[0].message.content or "",
             **({"tool_calls": [t.model_dump() for t in r2.choices[0].message.tool_calls]}
                if r2.choices[0].message.tool_calls else {})}
    r3 = c.chat.completions.create(model=MODEL, messages=[*changed, reply, {"role": "user", "content": "go on"}],
                                   tools=TOOLS, seed=5, max_tokens=16)
    ep = episode(live, "edit-1")
    assert_invariants(ep)
    assert [s["ended_by"] for s in ep["segments"]] == ["edited", "edited"] and ep["info"]["edited"] == 2
    total = sum(ep["loss_mask"]) + sum(sum(s["loss_mask"]) for s in ep["segments"])
    assert total == r1.usage.completion_tokens + r2.usage.completion_tokens + r3.usage.completion_tokens
    assert len(ep["turns"]) == 3


# -- 5. rewards, finish, 409, 404 ------------------------------------------------------------------

def test_rewards_finish_and_session_errors(live):
    c = session_client(live, "reward-1")
    c.chat.completions.create(model=MODEL, messages=calc_messages("What is 1 plus 1?"), tools=TOOLS, seed=1,
                              max_tokens=8)
    r = live.http.post("/sessions/reward-1/reward", json={"reward": 1.0})
    assert r.status_code == 200
    assert r.json() == {"session": "reward-1", "reward": 1.0, "turns": 1, "finished": False}
    ep = episode(live, "reward-1")
    assert ep["reward"] == 1.0 and ep["success"] is True

    for body in ({"reward": 1.0, "turn_rewards": [1.0, 2.0]}, {"reward": 1.0, "turn_rewards": "x"},
                 {"reward": "1"}, {"reward": True}, {}, [1.0]):
        r = live.http.post("/sessions/reward-1/reward", json=body)
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert live.http.post("/sessions/reward-1/reward", json={"reward": 1.0, "turn_rewards": [1, 2]}
                          ).json()["error"]["param"] == "turn_rewards"
    r = live.http.post("/sessions/reward-1/reward", content=b"{not json")
    assert r.status_code == 400

    r = live.http.post("/sessions/reward-1/reward", json={"reward": 0.0, "turn_rewards": [0.5]})
    assert r.status_code == 200
    ep = episode(live, "reward-1")
    assert ep["reward"] == 0.0 and ep["success"] is False and ep["turns"][0]["reward"] == 0.5

    r = live.http.post("/sessions/reward-1/finish", json={"reward": 2.0, "success": True})
    assert r.status_code == 200 and r.json()["finished"] is True and r.json()["reward"] == 2.0
    ep = episode(live, "reward-1")
    assert ep["reward"] == 2.0 and ep["success"] is True
    assert live.main.store.sessions["reward-1"].finished

    with pytest.raises(openai.ConflictError) as info:
        c.chat.completions.create(model=MODEL, messages=calc_messages("What is 1 plus 1?"), tools=TOOLS,
                                  max_tokens=8)
    assert info.value.status_code == 409 and error_of(info.value)["code"] == "session_finished"
    assert len(episode(live, "reward-1")["turns"]) == 1
    before = live.main.errors.summary()["total"]
    retrying = openai.OpenAI(base_url=c.base_url, api_key="x", timeout=60)  # the SDK's default: 2 retries
    with pytest.raises(openai.ConflictError):
        retrying.chat.completions.create(model=MODEL, messages=calc_messages("What is 1 plus 1?"), max_tokens=8)
    assert live.main.errors.summary()["total"] == before + 1  # asked once: a finished session is not retried

    for path in ("/sessions/no-such/episode",):
        r = live.http.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = live.http.post("/sessions/no-such/reward", json={"reward": 1.0})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = live.http.post("/sessions/no-such/finish", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert "no-such" not in live.main.store.sessions


def test_rejected_reward_changes_nothing(live):
    c = session_client(live, "reward-2")
    c.chat.completions.create(model=MODEL, messages=calc_messages("What is 2 plus 2?"), tools=TOOLS, seed=1,
                              max_tokens=8)
    assert live.http.post("/sessions/reward-2/reward", json={"reward": 1.0}).status_code == 200
    r = live.http.post("/sessions/reward-2/reward", json={"reward": -1.0, "turn_rewards": [1.0, 2.0, 3.0]})
    assert r.status_code == 400
    ep = episode(live, "reward-2")
    assert ep["reward"] == 1.0 and ep["success"] is True


# -- 6. bad requests: OpenAI errors, other sessions untouched --------------------------------------

def test_bad_requests_leave_sessions_intact(live, stack):
    good = session_client(live, "good-1")
    history = calc_messages("What is 9 plus 8?")
    r = good.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, seed=2, max_tokens=16)
    reply = r.choices[0].message.model_dump(exclude_none=True)
    history = [*history, reply]
    before = episode(live, "good-1")

    for sid in ("bad-1", "good-1"):  # in another session, and in the good one itself
        bad = session_client(live, sid)
        with pytest.raises(openai.NotFoundError) as info:
            bad.chat.completions.create(model="gpt-4o", messages=history, tools=TOOLS, max_tokens=8)
        err = error_of(info.value)
        assert err["code"] == "model_not_found" and err["param"] == "model" and info.value.code == "model_not_found"

        malformed = [
            [{"role": "robot", "content": "hi"}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
            [*history[:2], {"role": "assistant", "content": "",
                            "tool_calls": [{"id": "c1", "type": "function",
                                            "function": {"name": "calculator", "arguments": "{oops"}}]}],
            [],
        ]
        for messages in malformed:
            with pytest.raises(openai.BadRequestError) as info:
                bad.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
            assert error_of(info.value)["type"] == "invalid_request_error"

        with pytest.raises(openai.BadRequestError) as info:  # far beyond max_total_tokens
            bad.chat.completions.create(model=MODEL, messages=[*history, {"role": "user", "content": "seven " * 600}],
                                        tools=TOOLS, max_tokens=8)
        assert error_of(info.value)["code"] == "context_length_exceeded"

        with pytest.raises(openai.BadRequestError) as info:
            bad.chat.completions.create(model=MODEL, messages=history, n=2, max_tokens=8)
        assert error_of(info.value)["param"] == "n"

        with pytest.raises(openai.BadRequestError) as info:
            bad.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="required",
                                        max_tokens=8)
        assert error_of(info.value)["param"] == "tool_choice"

        for kw in ({"temperature": 3.0}, {"top_p": 0.0}, {"top_logprobs": 2, "logprobs": True}, {"max_tokens": 0}):
            with pytest.raises(openai.BadRequestError):
                bad.chat.completions.create(model=MODEL, messages=history, **kw)

    # outside a session n=2 is fine: two choices, seeds seed and seed + 1
    plain = client(live)
    two = plain.chat.completions.create(model=MODEL, messages=history[:2], n=2, seed=40, max_tokens=12)
    assert [ch.index for ch in two.choices] == [0, 1]
    one = [plain.chat.completions.create(model=MODEL, messages=history[:2], seed=s, max_tokens=12) for s in (40, 41)]
    assert [ch.message.content for ch in two.choices] == [o.choices[0].message.content for o in one]
    assert two.usage.completion_tokens == sum(o.usage.completion_tokens for o in one)
    assert two.usage.prompt_tokens == one[0].usage.prompt_tokens

    # a context-too-long plain call
    with pytest.raises(openai.BadRequestError) as info:
        plain.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "seven " * 600}])
    assert error_of(info.value)["code"] == "context_length_exceeded"

    # the good session is exactly as it was, and goes on from where it was
    assert episode(live, "good-1") == before
    r2 = good.chat.completions.create(model=MODEL, messages=[*history, {"role": "user", "content": "and then?"}],
                                      tools=TOOLS, seed=3, max_tokens=16)
    ep = episode(live, "good-1")
    assert_invariants(ep)
    assert ep["segments"] == [] and len(ep["turns"]) == 2
    assert ep["input_ids"][:len(before["input_ids"])] == before["input_ids"]
    assert r2.usage.prompt_tokens == first_sampled(ep, 1)
    assert sum(ep["loss_mask"]) == r.usage.completion_tokens + r2.usage.completion_tokens
    # the bad session recorded nothing (its failed calls may have opened it, empty)
    if "bad-1" in live.main.store.sessions:
        bad_ep = episode(live, "bad-1")
        assert bad_ep["input_ids"] == [] and bad_ep["turns"] == [] and bad_ep["segments"] == []


# -- 7. API key, body size, concurrency -------------------------------------------------------------

def test_api_key(live):
    messages = [{"role": "user", "content": "hi"}]
    for key in ("wrong", ""):
        with pytest.raises(openai.AuthenticationError) as info:
            client(live, "/keyed", api_key=key or "nope").chat.completions.create(model=MODEL, messages=messages)
        err = error_of(info.value)
        assert info.value.status_code == 401 and err["code"] == "invalid_api_key"
        assert err["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(live, "/keyed", api_key="wrong").models.list()
    assert live.http.get("/keyed/v1/models").status_code == 401  # no header at all
    assert live.http.get("/keyed/sessions/s/episode").status_code == 401

    good = client(live, "/keyed", api_key="k")
    r = good.chat.completions.create(model=MODEL, messages=messages, seed=0, max_tokens=8)
    assert isinstance(r.choices[0].message.content, str)
    assert [m.id for m in good.models.list()] == [MODEL]
    s = openai.OpenAI(base_url=f"{live.base}/keyed/sessions/k1/v1", api_key="k", max_retries=0)
    s.chat.completions.create(model=MODEL, messages=messages, seed=0, max_tokens=8)
    r = live.http.get("/keyed/sessions/k1/episode", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and len(r.json()["turns"]) == 1


def test_body_too_large(live):
    big = [{"role": "user", "content": "x" * 1000}]
    with pytest.raises(openai.APIStatusError) as info:
        client(live, "/small").chat.completions.create(model=MODEL, messages=big)
    assert info.value.status_code == 413 and error_of(info.value)["code"] == "request_too_large"

    def chunks():  # no content-length: the body is measured as it is read
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        yield b"x" * 1000
        yield b'"}]}'

    r = live.http.post("/small/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = client(live, "/small").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=4, seed=0)
    assert r.usage.completion_tokens >= 1


def test_concurrency_limit(live):
    messages = [{"role": "user", "content": "hi"}]

    async def main():
        c = openai.AsyncOpenAI(base_url=f"{live.base}/one/v1", api_key="x", max_retries=0, timeout=60)
        try:
            first = asyncio.ensure_future(c.chat.completions.create(model=MODEL, messages=messages, seed=0,
                                                                     max_tokens=4))
            deadline = time.monotonic() + 10
            while live.one.in_flight < 1:  # the first request is in the server (its engine waits 0.5 s)
                assert time.monotonic() < deadline and not first.done()
                await asyncio.sleep(0.005)
            with pytest.raises(openai.RateLimitError) as info:
                await c.chat.completions.create(model=MODEL, messages=messages, seed=0, max_tokens=4)
            ok = await first
            after = await c.chat.completions.create(model=MODEL, messages=messages, seed=0, max_tokens=4)
            return info.value, ok, after
        finally:
            await c.close()

    exc, ok, after = asyncio.run(main())
    assert exc.status_code == 429
    err = error_of(exc)
    assert err["type"] == "rate_limit_error" and err["code"] == "too_many_requests" and err["param"] is None
    assert ok.choices[0].message.content == after.choices[0].message.content
    assert live.one.in_flight == 0


# -- 8. many concurrent sessions --------------------------------------------------------------------

def test_concurrent_sessions_do_not_cross(live, stack):
    n = 32

    async def play(http: httpx.AsyncClient, i: int):
        sid = f"many-{i:02d}"
        c = openai.AsyncOpenAI(base_url=f"{live.base}/sessions/{sid}/v1", api_key="x", http_client=http,
                               max_retries=0)
        marker = f"zebra{i:02d}"
        messages = calc_messages(f"Note {marker}. What is {i} plus {i + 1}?")
        r1 = await c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, seed=i, max_tokens=16)
        m = r1.choices[0].message
        messages.append(m.model_dump(exclude_none=True))
        if m.tool_calls:
            messages += [{"role": "tool", "tool_call_id": t.id, "content": str(2 * i + 1)} for t in m.tool_calls]
        else:
            messages.append({"role": "user", "content": f"Again {marker}."})
        r2 = await c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, seed=i, max_tokens=16)
        return sid, marker, r1, r2

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(play(http, i) for i in range(n)))

    results = asyncio.run(main())
    assert len({sid for sid, *_ in results}) == n
    markers = [marker for _, marker, *_ in results]
    for sid, marker, r1, r2 in results:
        ep = episode(live, sid)
        assert_invariants(ep)
        assert len(ep["turns"]) == 2 and ep["segments"] == [] and "edited" not in ep["info"], sid
        text = stack.ref.decode(ep["input_ids"])
        assert marker in text and not any(m in text for m in markers if m != marker), sid
        assert sum(ep["loss_mask"]) == r1.usage.completion_tokens + r2.usage.completion_tokens
        assert r2.usage.prompt_tokens == first_sampled(ep, 1)
        assert [t["prompt_tokens"] for t in ep["turns"]] == [r1.usage.prompt_tokens, r2.usage.prompt_tokens]
        assert ep["task"]["id"] == sid


# -- 9. idle sessions expire -------------------------------------------------------------------------

def test_idle_session_expires(live):
    ttl = live.ttl
    session_client(live, "old", "/ttl").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], seed=0, max_tokens=2)
    assert "old" in ttl.store.sessions and ttl.store.expired == 0
    time.sleep(0.3)
    session_client(live, "new", "/ttl").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], seed=0, max_tokens=2)
    assert "old" not in ttl.store.sessions and ttl.store.expired == 1
    r = live.http.get("/ttl/sessions/old/episode")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert live.http.get("/ttl/health").json()["expired_sessions"] >= 1


# -- a chat template that rewrites history (Qwen3's layout) ------------------------------------------

THINK = "<think>\nI should greet.\n</think>\n\n"


def qwen3_renderer(tokenizer):
    from ctxrl.chat.render import ChatRenderer

    tok = copy.deepcopy(tokenizer)
    tok.eos_token = "<|im_end|>"
    tok.chat_template = (ROOT / "tests" / "fixtures" / "templates" / "qwen3.jinja").read_text()
    return ChatRenderer(tok, template_name="qwen3", tool_format="auto")


def test_history_rewrite_prompts_the_engine_with_what_is_recorded(tokenizer):
    from ctxrl.engine.scripted import ScriptedEngine

    renderer = qwen3_renderer(tokenizer)
    engine = ScriptedEngine([THINK + "Hello.", "Bye."], renderer)
    server = Server(engine, renderer, model_name=MODEL, max_total_tokens=4096)

    async def main():
        transport = httpx.ASGITransport(app=server.app())
        async with httpx.AsyncClient(transport=transport, base_url="http://ctxrl") as http:
            c = openai.AsyncOpenAI(base_url="http://ctxrl/sessions/q/v1", api_key="x", http_client=http, max_retries=0)
            messages = [{"role": "user", "content": "hi"}]
            r1 = await c.chat.completions.create(model=MODEL, messages=messages)
            messages += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
            r2 = await c.chat.completions.create(model=MODEL, messages=messages)
            return r2, (await http.get("/sessions/q/episode")).json()

    r2, ep = asyncio.run(main())
    assert ep["info"].get("template_restarts") == 1 and [s["ended_by"] for s in ep["segments"]] == ["template"]
    start = first_sampled(ep, 1)
    assert engine.prompts[1] == ep["input_ids"][:start]
    assert r2.usage.prompt_tokens == start


@pytest.mark.parametrize("raw, status, message, param", [
    (b'{"temperature": NaN}', 400, "temperature is NaN: JSON numbers must be finite", "temperature"),
    (b'{"messages": [{"role": "user", "x": -Infinity}]}', 400, "messages[0].x is -Infinity", "messages[0].x"),
    (b'{"reward": Infinity}', 400, "reward is Infinity", "reward"),
    (b'{"top_p": 1e999}', 400, "top_p is 1e999: JSON numbers must be finite", "top_p"),
    (b'{"model": "\xff"}', 400, "the body is not UTF-8 (byte 11", None),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nests too deeply", None),
    (b'{"model": ', 400, "the body is not JSON", None),
])
def test_a_body_that_is_not_plain_json_is_a_400_naming_what_is_wrong(raw, status, message, param):
    from ctxrl.serve.protocol import APIError
    from ctxrl.serve.server import parse_body

    with pytest.raises(APIError) as caught:
        parse_body(raw)
    body = caught.value.body()["error"]
    assert caught.value.status == status and message in body["message"] and body["param"] == param
    assert parse_body(b'{"a": [1.5, 2]}') == {"a": [1.5, 2]} and parse_body(b"") is None
