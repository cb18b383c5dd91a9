"""``ctxrl serve`` under the attacks of issue 51, against a live loopback server (raw HTTP and raw sockets).

Each test is one finding: a lone surrogate in a message, a tool's description or a call's arguments (a 500)
is a 400 naming the field; a reward of 1e308 (finite in float64, inf in float32, every loss NaN) is a 400; a
Host or Origin that is neither loopback nor configured (DNS rebinding: a web page reading episodes or posting
rewards) is refused, as ``ctxrl mcp-serve`` refuses it; the session id ``a%00b`` gets a 400, not a closed
connection; a port past 65535, a busy port, a NaN read timeout and a negative concurrency are one-line errors;
and two clients sending 4 MB messages at once no longer stall every honest call behind their tokenisation.

One uvicorn server (port 0, a background thread) serves several ``Server`` objects over the tiny model:

- ``/main``: default limits;
- ``/strict``: ``max_abs_reward=10``, ``allowed_hosts`` and ``allowed_origins`` configured.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("mcp")

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Mount  # noqa: E402
from test_serve import MODEL, serving, stack  # noqa: E402, F401 (stack: a fixture)

from ctxrl.errors import ConfigError  # noqa: E402
from ctxrl.serve.limits import RenderQueue  # noqa: E402
from ctxrl.serve.protocol import APIError  # noqa: E402
from ctxrl.serve.server import Server, bind  # noqa: E402

MAX_TOTAL = 512
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "calculator", "description": "Evaluate.",
                                         "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def live(stack):  # noqa: F811 (the fixture imported from test_serve)
    def server(**kw) -> Server:
        return Server(stack.engine, stack.renderer, model_name=MODEL, max_total_tokens=MAX_TOTAL, max_new_tokens=4,
                      **kw)

    servers = {"main": server(), "strict": server(max_abs_reward=10.0, allowed_hosts=("ctxrl.example:*",),
                                                  allowed_origins=("https://app.example",))}
    app = Starlette(routes=[Mount(f"/{name}", app=s.app()) for name, s in servers.items()])
    with serving(app, "ctxrl-attacks-serve") as port:
        yield SimpleNamespace(port=port, **servers)


def call(live, method: str, path: str, body=None, headers=None, conn=None) -> tuple[int, dict]:
    conn = conn or http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}


def open_session(live, sid: str, prefix: str = "/main") -> None:
    status, body = call(live, "POST", f"{prefix}/sessions/{sid}/v1/chat/completions", chat())
    assert status == 200, body


# -- 1. lone surrogates: a 400 naming the field, never a 500 ---------------------------------------------------
ARGS = json.dumps({"x": "\ud800"})  # (json.dumps writes the lone surrogate as the escape \ud800)
SURROGATES = [  # (request fields, the param the 400 names)
    ({"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content"),
    ({"tools": [{**TOOL, "function": {**TOOL["function"], "description": "Evaluate \udfff."}}]},
     "tools[0].function.description"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": ARGS}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("fields, param", SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_the_field(live, fields, param):
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    status, body = call(live, "POST", "/main/v1/chat/completions", chat(**fields), conn=conn)
    assert status == 400, body
    assert body["error"]["param"] == param and "lone surrogate" in body["error"]["message"]
    assert call(live, "GET", "/main/health", conn=conn)[0] == 200  # the connection stays open
    deep = '{"x": ' + "[" * 5000 + "]" * 5000 + "}"  # (arguments nested past what JSON reads: a 400 too)
    deep_call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": deep}}
    status, body = call(live, "POST", "/main/v1/chat/completions",
                        chat(messages=[*HI, {"role": "assistant", "tool_calls": [deep_call]}]))
    assert status == 400 and "nest" in body["error"]["message"], body


# -- 2. rewards past a finite range: a 400, the default and a configured limit -----------------------------------
@pytest.mark.parametrize("prefix, reward, ok", [("/main", 1e308, False), ("/main", -2e6, False), ("/main", 1e6, True),
                                                ("/strict", 11.0, False), ("/strict", -10.0, True)])
def test_a_reward_outside_the_servers_range_is_a_400_and_never_stored(live, prefix, reward, ok):
    sid = f"reward-{prefix[1:]}-{reward:g}"
    open_session(live, sid, prefix)
    status, body = call(live, "POST", f"{prefix}/sessions/{sid}/reward", {"reward": reward})
    assert (status == 200) == ok, body
    if not ok:
        assert body["error"]["param"] == "reward" and "max_abs_reward" in body["error"]["message"]
        status, body = call(live, "POST", f"{prefix}/sessions/{sid}/reward", {"reward": 0.5,
                                                                               "turn_rewards": [reward]})
        assert status == 400 and body["error"]["param"] == "turn_rewards"
        assert call(live, "GET", f"{prefix}/sessions/{sid}/episode")[1]["reward"] == 0.0  # nothing stored


# -- 3. Host and Origin: loopback or configured, else refused (DNS rebinding) -----------------------------------
@pytest.mark.parametrize("prefix, headers, status", [
    ("/main", {"host": "attacker.example:{port}"}, 421),
    ("/main", {"origin": "http://attacker.example:{port}"}, 403),
    ("/main", {"host": "localhost:{port}", "origin": "http://localhost:{port}"}, 200),
    ("/main", {"host": "[::1]:{port}"}, 200),
    ("/strict", {"host": "ctxrl.example:{port}", "origin": "https://app.example"}, 200),
    ("/strict", {"origin": "https://other.example"}, 403),
])
def test_a_host_or_origin_neither_loopback_nor_configured_is_refused(live, prefix, headers, status):
    headers = {k: v.format(port=live.port) for k, v in headers.items()}
    got, body = call(live, "GET", f"{prefix}/health", headers=headers)
    assert got == status, body
    if status != 200:
        assert body["error"]["code"] in ("invalid_host", "invalid_origin") and "allowed_" in body["error"]["message"]
        sid = "rebound"  # a rebinding page can post rewards into no session either
        got, _ = call(live, "POST", f"{prefix}/sessions/{sid}/reward", {"reward": 1.0}, headers=headers)
        assert got == status


# -- 4. a session id with a NUL: a 400 with a body ------------------------------------------------------------
@pytest.mark.parametrize("sid", ["a%00b", "a%20b", "%C3%A9"])
def test_a_session_id_that_cannot_be_echoed_is_a_400_with_a_body(live, sid):
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
        body = json.dumps(chat()).encode()
        s.sendall(f"POST /main/sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{live.port}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536) or pytest.fail(f"the server closed the connection: {data!r}")
        head, _, rest = data.partition(b"\r\n\r\n")
        lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
        length = int(lengths[0])
        while len(rest) < length:
            rest += s.recv(65536)
    status, error = int(head.split(b" ")[1]), json.loads(rest)["error"]
    assert status == 400 and error["param"] == "session" or status == 404 and error["code"] == "unknown_url", error


# -- 5. settings and ports: one line each, before anything serves ----------------------------------------------
@pytest.mark.parametrize("setting, value", [("read_timeout_s", math.nan), ("max_concurrency", -1),
                                            ("session_timeout_s", math.nan), ("max_body_bytes", 0),
                                            ("read_timeout_s", math.inf), ("max_abs_reward", math.inf)])
def test_a_setting_out_of_range_is_a_config_error(stack, setting, value):  # noqa: F811
    with pytest.raises(ConfigError, match=setting) as caught:
        Server(stack.engine, stack.renderer, model_name=MODEL, max_total_tokens=MAX_TOTAL, **{setting: value})
    assert "\n" not in str(caught.value)


def test_a_port_past_65535_or_in_use_is_a_config_error_and_the_training_server_prints_nothing(stack, capsys):  # noqa: F811
    with pytest.raises(ConfigError, match="99999 is not a port"):
        bind("127.0.0.1", 99999)
    taken = bind("127.0.0.1", 0)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port} is in use"):
            bind("127.0.0.1", port)
        from ctxrl.serve.harness import Remote

        limits = SimpleNamespace(max_total_tokens=MAX_TOTAL, max_new_tokens=4, stop_ids=(), stop_strings=())
        with pytest.raises(ConfigError, match="is in use"):
            Remote(stack.engine, stack.renderer, limits, port)
        assert "harnesses take episodes" not in capsys.readouterr().err  # no false "serving" line
    finally:
        taken.close()


# -- 6. huge messages from two clients at once: honest calls answered within 2 s ----------------------------------
def test_two_clients_sending_4_mb_messages_do_not_stall_honest_calls(live):
    huge = json.dumps(chat(messages=[{"role": "user", "content": "ab " * 1_300_000}])).encode()  # 3.9 MB
    assert len(huge) < 4 << 20
    results = []

    def hostile():
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=120)
        for _ in range(3):
            results.append(call(live, "POST", "/main/v1/chat/completions", huge, conn=conn)[0])

    threads = [threading.Thread(target=hostile) for _ in range(2)]
    for t in threads:
        t.start()
    waits, conn = [], http.client.HTTPConnection("127.0.0.1", live.port, timeout=120)
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline or len(waits) < 3:
        start = time.monotonic()
        assert call(live, "POST", "/main/v1/chat/completions", chat(), conn=conn)[0] == 200
        waits.append(time.monotonic() - start)
    for t in threads:
        t.join(timeout=120)
    assert results == [400] * 6
    assert max(waits) < 2.0, waits


def test_the_render_queue_takes_clients_in_turn_and_bounds_each(monkeypatch):
    queue, order, gate = RenderQueue(per_client=2), [], threading.Event()
    first = queue.submit("a", lambda: gate.wait(10) and order.append("a0"))
    a1 = queue.submit("a", lambda: order.append("a1"))
    with pytest.raises(APIError) as caught:  # a third from client a, while two wait or run: 429
        queue.submit("a", lambda: None)
    assert caught.value.status == 429
    b0 = queue.submit("b", lambda: order.append("b0"))
    a2_after = None
    gate.set()
    first.result(10)
    a2_after = queue.submit("a", lambda: order.append("a2"))
    for future in (a1, b0, a2_after):
        future.result(10)
    assert order.index("b0") < order.index("a2")  # b's turn comes before a's next


def test_the_in_process_training_server_bounds_no_episode_by_the_per_client_queue(stack):  # noqa: F811
    """In process every harness episode comes through one ASGI transport, one "client": the trainer bounds them."""
    from ctxrl.serve.harness import training_server

    limits = SimpleNamespace(max_total_tokens=MAX_TOTAL, max_new_tokens=4, stop_ids=(), stop_strings=())
    assert training_server(stack.engine, stack.renderer, limits).renders_per_client >= 1 << 20
