"""``ctxrl serve`` under a hostile or unlucky client, against a live loopback server (raw HTTP and the official client).

Each test is one finding of the attack pass (issue 33): what used to be a 500 and a reset connection,
and is now a 4xx with OpenAI's body that names the field, on a connection that stays open. Counts and
sizes are bounded so that each test takes about a second on the tiny calculator model.

One uvicorn server (port 0, a background thread) serves several ``Server`` objects over one engine,
each under its own prefix:

- ``/main``: default limits.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Mount  # noqa: E402
from test_serve import MODEL, TOOLS, calc_messages, error_of, stack  # noqa: E402, F401 (stack: a fixture)

from ctxrl.serve.server import Server  # noqa: E402

MAX_TOTAL = 512
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def live(stack):  # noqa: F811 (the fixture imported from test_serve)
    def server(engine=stack.engine, **kw) -> Server:
        return Server(engine, stack.renderer, model_name=MODEL, max_total_tokens=MAX_TOTAL, max_new_tokens=8, **kw)

    servers = {"main": server()}
    app = Starlette(routes=[Mount(f"/{name}", app=s.app()) for name, s in servers.items()])
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, name="ctxrl-serve-attacks", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = uv.servers[0].sockets[0].getsockname()[1]
    yield SimpleNamespace(port=port, base=f"http://127.0.0.1:{port}", **servers)
    uv.should_exit = True
    thread.join(timeout=15)


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


