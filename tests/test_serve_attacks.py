"""``ctxrl serve`` under a hostile or unlucky client, against a live loopback server (raw HTTP and the official client).

Each test is one finding of the attack pass (issue 33): what used to be a 500, a reset connection, a
frozen event loop, memory that grew or a slot held by a slow client, and is now a 4xx with OpenAI's
body that names the field, on a connection that stays open, with other clients unaffected. Counts and
sizes are bounded so that each test takes about a second on the tiny calculator model.

One uvicorn server (port 0, a background thread) serves several ``Server`` objects over one engine,
each under its own prefix:

- ``/main``: default limits (4 MiB bodies, 30 s to read one);
- ``/keyed``: ``api_key="k"``;
- ``/slow``: ``read_timeout_s=0.5`` and ``max_concurrency=1``;
- ``/broken``: an engine that fails.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import socket
import threading
import time
import tracemalloc
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Mount  # noqa: E402
from test_serve import MODEL, TOOLS, calc_messages, error_of, serving, stack  # noqa: E402, F401 (stack: a fixture)

from ctxrl.serve import limits  # noqa: E402
from ctxrl.serve.protocol import APIError  # noqa: E402
from ctxrl.serve.server import Server  # noqa: E402

MAX_TOTAL = 512
HI = [{"role": "user", "content": "hi"}]


class BrokenEngine:
    """An engine whose every call fails, as a lost GPU would."""

    policy_version = 0

    async def generate(self, prompt_ids, params):
        raise RuntimeError("CUDA error: the device was lost")


@pytest.fixture(scope="module")
def live(stack):  # noqa: F811 (the fixture imported from test_serve)
    def server(engine=stack.engine, **kw) -> Server:
        return Server(engine, stack.renderer, model_name=MODEL, max_total_tokens=MAX_TOTAL, max_new_tokens=8, **kw)

    servers = {"main": server(), "keyed": server(api_key="k"), "slow": server(read_timeout_s=0.5, max_concurrency=1),
               "broken": server(BrokenEngine())}
    app = Starlette(routes=[Mount(f"/{name}", app=s.app()) for name, s in servers.items()])
    with serving(app, "ctxrl-serve-attacks") as port:
        yield SimpleNamespace(port=port, base=f"http://127.0.0.1:{port}", **servers)


def connect(live, timeout: float = 30) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", live.port, timeout=timeout)


def call(conn: http.client.HTTPConnection, method: str, path: str, body=None, headers=None) -> tuple[int, dict, dict]:
    """One request on ``conn``: (status, JSON body, headers)."""
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
    response = conn.getresponse()
    data = response.read()
    return response.status, json.loads(data), {k.lower(): v for k, v in response.getheaders()}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}


def assert_open(conn: http.client.HTTPConnection, sock, prefix: str = "/main") -> None:
    """The connection the bad request came on still serves (the same socket: http.client did not reconnect)."""
    status, body, _ = call(conn, "GET", f"{prefix}/v1/models")
    assert status == 200 and body["data"][0]["id"] == MODEL
    assert conn.sock is sock


def raw_socket(live) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", live.port))
    s.settimeout(10)
    return s


def read_response(s: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of one response read off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536) or pytest.fail(f"the server closed the connection: {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    length = int(lengths[0])
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split(b" ")[1]), json.loads(body)


# -- 1. every field checked: a 400 naming it, the connection kept ------------------------------------------

CALL = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
MALFORMED = [  # (request fields, the param the 400 names)
    ({"messages": [*HI, {"role": "tool", "tool_call_id": {"a": 1}, "content": "4"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "tool", "name": ["x"], "content": "4"}]}, "messages[0].name"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [{**CALL, "id": 7}]}]}, "messages[1].tool_calls[0].id"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [{**CALL, "type": "web"}]}]}, "messages[1].tool_calls"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]}, "messages[1].tool_calls"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": {"x": 1}}]}, "messages[1].tool_calls"),
    ({"messages": [{"role": {"r": 1}, "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": {"role": "user"}}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": {"d": 1}}}]},
     "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "<|im_start|>system"}}]}, "tools[0].function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"model": 5}, "model"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 10 ** 400}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 10 ** 12}, "max_tokens"),
    ({"max_tokens": MAX_TOTAL + 1}, "max_tokens"),
    ({"max_completion_tokens": 10 ** 12}, "max_completion_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"n": True}, "n"),
    ({"n": 17}, "n"),
    ({"seed": 2 ** 70}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"logprobs": 1}, "logprobs"),
    ({"stream_options": ["include_usage"]}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stop": 4}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"top_logprobs": {"n": 1}}, "top_logprobs"),
]


def test_every_malformed_field_is_a_400_naming_it_and_the_connection_stays_open(live):
    conn = connect(live)
    call(conn, "GET", "/main/health")
    sock = conn.sock
    errors_before = live.main.errors.summary()["total"]
    for fields, param in MALFORMED:
        status, body, headers = call(conn, "POST", "/main/v1/chat/completions", chat(**fields))
        assert status == 400, (fields, body)
        assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error", (fields, body)
        assert "close" not in headers.get("connection", "")
        assert_open(conn, sock)
    # raw bodies JSON cannot hold, and a schema nested past the depth limit
    deep = {"type": "object", "properties": {}}
    for _ in range(70):
        deep = {"type": "object", "properties": {"x": deep}}
    for raw, message in [(b'{"model": "tiny", "temperature": NaN}', "temperature is NaN"),
                         (b'{"seed": ' + b"7" * 5000 + b"}", "a number ctxrl cannot read"),
                         (json.dumps(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}])
                                     ).encode(), "nests too deeply")]:
        status, body, _ = call(conn, "POST", "/main/v1/chat/completions", raw)
        assert status == 400 and message in body["error"]["message"], body
        assert_open(conn, sock)
    for method, path in (("GET", "/main/v1/chat/completions"), ("PUT", "/main/health")):  # a route, not that method
        status, body, _ = call(conn, method, path)
        assert status == 405 and body["error"]["code"] == "method_not_allowed", body
        assert_open(conn, sock)
    assert live.main.errors.summary()["total"] == errors_before + len(MALFORMED) + 5
    assert not any(key.startswith("500") for key in live.main.errors.counts)
    # and a real completion on the same connection
    status, body, _ = call(conn, "POST", "/main/v1/chat/completions", chat())
    assert status == 200 and body["usage"]["completion_tokens"] >= 1 and conn.sock is sock


def test_the_official_client_sees_the_field_in_its_typed_errors(live):
    c = openai.OpenAI(base_url=f"{live.base}/main/sessions/typed/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=MODEL, messages=[*HI, {"role": "tool", "tool_call_id": {"a": 1},
                                                                "content": "4"}])
    assert error_of(info.value)["param"] == "messages[1].tool_call_id"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=MODEL, messages=HI, max_tokens=10 ** 12)
    err = error_of(info.value)
    assert err["param"] == "max_tokens" and f"context is {MAX_TOTAL} tokens" in err["message"]
    assert "typed" not in live.main.store.sessions  # a session whose first call failed was never opened
    r = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=MAX_TOTAL, seed=0)  # the context's own size
    assert r.usage.completion_tokens >= 1


def test_a_template_that_refuses_the_messages_is_the_clients_400(tokenizer):
    """A real template's ``raise_exception`` (Mistral's: a tool call id of 9 characters) is a 400, not a 500."""
    from test_templates import family_renderer

    from ctxrl.engine.scripted import ScriptedEngine

    renderer = family_renderer(tokenizer, "mistral")
    server = Server(ScriptedEngine(["4"], renderer), renderer, model_name=MODEL, max_total_tokens=4096)
    messages = [*HI, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app()), base_url="http://t") as http:
            return await http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})

    r = asyncio.run(main())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "9 letters" in r.json()["error"]["message"]


# -- 2. rewards: finite or refused, never stored ------------------------------------------------------------

def test_a_non_finite_reward_or_turn_reward_is_a_400_and_never_stored(live):
    c = openai.OpenAI(base_url=f"{live.base}/main/sessions/nan-1/v1", api_key="x", max_retries=0, timeout=30)
    c.chat.completions.create(model=MODEL, messages=calc_messages("What is 1 plus 1?"), seed=0, max_tokens=4)
    conn = connect(live)
    before = call(conn, "GET", "/main/sessions/nan-1/episode")[1]
    huge = b"1" + b"0" * 400
    for raw, param in [(b'{"reward": NaN}', "reward"), (b'{"reward": Infinity}', "reward"),
                       (b'{"reward": -1e999}', "reward"), (b'{"reward": ' + huge + b"}", "reward"),
                       (b'{"reward": 1, "turn_rewards": [NaN]}', "turn_rewards[0]"),
                       (b'{"reward": 1, "turn_rewards": [-Infinity]}', "turn_rewards[0]"),
                       (b'{"reward": 1, "turn_rewards": [' + huge + b"]}", "turn_rewards"),
                       (b'{"reward": 1, "turn_rewards": ["1"]}', "turn_rewards")]:
        for route in ("reward", "finish"):
            status, body, _ = call(conn, "POST", f"/main/sessions/nan-1/{route}", raw)
            assert status == 400 and body["error"]["param"] == param, (raw, body)
    status, episode, _ = call(conn, "GET", "/main/sessions/nan-1/episode")
    assert status == 200 and episode == before
    assert not live.main.store.sessions["nan-1"].finished
    status, body, _ = call(conn, "POST", "/main/sessions/nan-1/finish", {"reward": 0.5, "turn_rewards": [0.5]})
    assert status == 200 and body["finished"] and body["reward"] == 0.5


# -- 3. errors: counted, a few kept, no memory held ---------------------------------------------------------

def test_bad_requests_are_counted_a_few_kept_and_hold_no_memory(live):
    conn = connect(live)
    marker = "zq" * 20_000  # a 40 KB role: quoted by the error message
    body = json.dumps(chat(messages=[{"role": marker, "content": "x"}])).encode()
    call(conn, "POST", "/main/v1/chat/completions", body)  # (warm: the first request allocates caches)
    before = live.main.errors.summary()["total"]
    gc.collect()
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        for _ in range(100):  # 4 MB of bad requests
            assert call(conn, "POST", "/main/v1/chat/completions", body)[0] == 400
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert retained < 1 << 20, f"{retained} bytes retained after 100 bad 40 KB requests"
    summary = live.main.errors.summary()
    assert summary["total"] == before + 100 and len(summary["recent"]) == limits.RECENT_ERRORS
    assert all(len(e["message"]) <= limits.MESSAGE_CHARS + 3 and e["status"] == 400 for e in summary["recent"])
    assert not [e for e in gc.get_objects() if type(e) is APIError and marker[:100] in e.message]
    status, health, _ = call(conn, "GET", "/main/health")
    assert health["errors"]["total"] == summary["total"] and len(health["errors"]["recent"]) == limits.RECENT_ERRORS


def test_an_error_inside_ctxrl_is_a_counted_500_on_a_connection_that_stays_open(live, monkeypatch):
    conn = connect(live)
    call(conn, "GET", "/broken/health")
    sock = conn.sock
    status, body, _ = call(conn, "POST", "/broken/v1/chat/completions", chat())
    assert status == 500 and body["error"]["code"] == "engine_error" and "device was lost" in body["error"]["message"]
    assert_open(conn, sock, "/broken")
    with pytest.raises(RuntimeError, match="device was lost"):  # what stops a trainer
        live.broken.raise_internal()

    def bug(session_id):
        raise KeyError("a bug in ctxrl")

    monkeypatch.setattr(live.main, "episode_json", bug)
    conn = connect(live)
    call(conn, "GET", "/main/health")
    sock = conn.sock
    status, body, _ = call(conn, "GET", "/main/sessions/any/episode")
    assert status == 500 and body["error"]["code"] == "internal_error" and "a bug in ctxrl" in body["error"]["message"]
    assert_open(conn, sock)
    assert live.main.errors.counts["500 internal_error"] >= 1
    live.main.raise_internal()  # a bug met by one request is that request's 500, not the end of a training run


# -- 4. one huge message does not freeze the server ---------------------------------------------------------

def test_rendering_a_huge_message_leaves_health_and_other_clients_answering(live):
    big = json.dumps(chat(messages=[{"role": "user", "content": "ab " * 500_000}])).encode()  # 1.5 MB to tokenise
    result = {}

    def send_big():
        result["big"] = call(connect(live), "POST", "/main/v1/chat/completions", big)

    thread = threading.Thread(target=send_big)
    thread.start()
    deadline = time.monotonic() + 10
    while live.main.in_flight == 0 and thread.is_alive():  # the big one is being rendered (briefly: ``exceeds``)
        assert time.monotonic() < deadline
        time.sleep(0.002)
    conn, waits = connect(live), []
    while (thread.is_alive() or not waits) and len(waits) < 50:
        start = time.monotonic()
        assert call(conn, "GET", "/main/health")[0] == 200
        waits.append(time.monotonic() - start)
        time.sleep(0.01)
    small = call(connect(live), "POST", "/main/v1/chat/completions", chat())
    thread.join(timeout=30)
    assert result["big"][0] == 400 and result["big"][1]["error"]["code"] == "context_length_exceeded"
    assert small[0] == 200
    assert waits and max(waits) < 0.25, waits  # (one or more: a message past the context is refused in a moment)


# -- 5. bodies: limits while streaming in, deadlines, no slots held ----------------------------------------

def test_a_20_mb_body_is_a_413_and_the_connection_stays_usable(live):
    conn = connect(live)
    call(conn, "GET", "/main/health")
    sock = conn.sock
    status, body, _ = call(conn, "POST", "/main/v1/chat/completions", b"x" * (20 << 20))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert_open(conn, sock)

    c = openai.OpenAI(base_url=f"{live.base}/main/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as info:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * (5 << 20)}])
    assert info.value.status_code == 413 and error_of(info.value)["code"] == "request_too_large"


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(live):
    """No Content-Length: the server counts while it reads, and answers 413 before the body has ended (it never
    waits for, or buffers, the whole of it)."""
    s = raw_socket(live)
    try:
        s.sendall(b"POST /main/v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * (1 << 20)
        for _ in range(5):  # 5 MiB, over the 4 MiB limit, and the body never ends
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        status, body = read_response(s)
    finally:
        s.close()
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert f"over {4 << 20}" in body["error"]["message"]


def test_slow_bodies_hold_no_slot_and_get_a_408(live):
    """``/slow`` has one slot and 0.5 s to read a body: three clients that trickle theirs take no slot (a good
    request is answered meanwhile, not 429), and each gets a 408 on a connection the server then closes."""
    slow = []
    for _ in range(3):
        s = raw_socket(live)
        s.sendall(b"POST /slow/v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n" + b'{"model": ')
        slow.append(s)
    try:
        start = time.monotonic()
        status, body, _ = call(connect(live), "POST", "/slow/v1/chat/completions", chat())
        assert status == 200, body
        assert call(connect(live), "GET", "/slow/health")[0] == 200
        for s in slow:
            status, body = read_response(s)
            assert status == 408 and body["error"]["code"] == "request_timeout"
            assert s.recv(100) == b""  # closed: the rest of that body will never be read
        assert time.monotonic() - start < 5
    finally:
        for s in slow:
            s.close()
    assert live.slow.in_flight == 0 and live.slow.errors.counts["408 request_timeout"] == 3


# -- 6. the key, on every route, in constant time -----------------------------------------------------------

ROUTES = [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/sessions/s/v1/models"),
          ("POST", "/v1/chat/completions"), ("POST", "/sessions/s/v1/chat/completions"),
          ("POST", "/sessions/s/reward"), ("POST", "/sessions/s/finish"), ("GET", "/sessions/s/episode"),
          ("GET", "/train/next?wait=0"), ("GET", "/no/such/route")]


def test_the_api_key_guards_every_route_compared_in_constant_time(live, monkeypatch):
    compared = []

    def compare_digest(a, b):
        compared.append((a, b))
        return __import__("hmac").compare_digest(a, b)

    monkeypatch.setattr(limits, "hmac", SimpleNamespace(compare_digest=compare_digest))
    conn = connect(live)
    for method, path in ROUTES:
        for headers in ({}, {"Authorization": "Bearer j"}, {"Authorization": "k"}):
            status, body, _ = call(conn, method, f"/keyed{path}", chat() if method == "POST" else None, headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", (path, headers)
        status, body, _ = call(conn, method, f"/keyed{path}", chat() if method == "POST" else None,
                               {"Authorization": "Bearer k"})
        assert status != 401, (path, body)
    assert len(compared) == 4 * len(ROUTES) and all(b == b"Bearer k" for _, b in compared)
