"""``ctxrl serve`` under valid sessions and hostile clients at once: memory, latency, episodes lost.

Starts the real ``ctxrl serve`` (a subprocess, on loopback, a key from ``CTXRL_API_KEY``) over a
tiny model, then for ``--seconds`` runs ``--clients`` honest clients, each playing whole episodes in
sessions of its own (a call with tools, the reply and a tool result or user turn sent back, a second
call, the reward with one reward per turn, the recorded episode read back and checked), beside
``--hostile`` clients that send, in turn: bodies that are not JSON, NaN numbers, NaN rewards, wrong
keys, 8 MiB bodies (declared, and chunked), bodies that trickle in and stall, malformed fields,
1 MB messages to tokenise, and issue 51's mixes: a lone surrogate (``"\ud800"``) in a message, a
tool's description or a call's arguments, a reward of 1e308, a ``Host`` of another name (DNS
rebinding), a session id ``a%00b``; beside ``--huge`` clients (2) that each send 3.9 MB messages
one after another, at once (before issue 51 each took 12 s to tokenise on the one render thread,
and honest calls waited behind them). It prints the server's RSS as it goes, then:

- RSS at the start (after warm-up), its peak and at the end (flat under hostile requests: nothing is kept
  per request; it rises slowly with the honest episodes, because a finished session is kept, for
  ``GET /sessions/<id>/episode``, until it has been idle ``--session-timeout`` seconds);
- p50 / p95 latency of the honest clients' chat calls;
- episodes played, lost (a request of an honest client that failed, or an episode not found) and
  corrupted (ids, mask, log-probs or turns that disagree with what the client was told): both 0;
- the hostile requests by the status they got (every one a 4xx; a 5xx, reset or hang is counted
  as unexpected).

    python benchmarks/serve_soak.py                   # 60 s
    python benchmarks/serve_soak.py --seconds 300 --clients 8 --hostile 4
    python benchmarks/serve_soak.py --session-timeout 3   # finished sessions dropped: RSS flat
    python benchmarks/serve_soak.py --smoke           # a few seconds: does it run?
    python benchmarks/serve_soak.py --huge 0          # without the two 3.9 MB clients
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
KEY = "soak-key"
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(args, port: int) -> subprocess.Popen:
    env = {**os.environ, "CTXRL_API_KEY": KEY, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "ctxrl", "serve", args.config, "--port", str(port),
               "--read-timeout", str(args.read_timeout), "--session-timeout", str(args.session_timeout),
               "--model-name", MODEL, "model.device=cpu", *args.overrides]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_until_up(server: subprocess.Popen, port: int, timeout_s: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"ctxrl serve exited ({server.returncode}): {server.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", headers=auth(), timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("ctxrl serve did not start")


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


# -- honest clients ----------------------------------------------------------------------------------------

def check_episode(episode: dict, replies: list[dict], turn_rewards: list[float], reward: float) -> str | None:
    """What is wrong with a recorded episode given what the client was told, or None."""
    seq = episode
    n = len(seq["input_ids"])
    if not n == len(seq["loss_mask"]) == len(seq["behavior_logprobs"]) == len(seq["turn_index"]):
        return "sequence lengths differ"
    if set(seq["loss_mask"]) - {0, 1} or any(lp != 0.0 for lp, m in zip(seq["behavior_logprobs"], seq["loss_mask"])
                                               if not m):
        return "mask or log-probs malformed"
    if episode["segments"]:
        return "an unedited conversation was split into segments"
    if sum(seq["loss_mask"]) != sum(r["usage"]["completion_tokens"] for r in replies):
        return "sampled tokens differ from the completion tokens reported"
    if [t["prompt_tokens"] for t in episode["turns"]] != [r["usage"]["prompt_tokens"] for r in replies]:
        return "prompt tokens differ from those reported"
    if episode["reward"] != reward or [t["reward"] for t in episode["turns"]] != turn_rewards:
        return "rewards differ from those sent"
    first_of_turn_1 = next(k for k, (m, t) in enumerate(zip(seq["loss_mask"], seq["turn_index"])) if m and t == 1)
    if first_of_turn_1 != replies[1]["usage"]["prompt_tokens"]:
        return "the second call's prompt is not the recorded sequence before its reply"
    return None


async def honest_client(base: str, index: int, stop_at: float, stats: dict) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=base, headers=auth(), timeout=120) as http:
        episode_index = 0
        while time.monotonic() < stop_at:
            sid = f"soak-{index}-{episode_index}"
            episode_index += 1
            try:
                messages = [{"role": "system", "content": "Use the calculator tool for arithmetic."},
                            {"role": "user", "content": f"What is {index} plus {episode_index}?"}]
                replies = []
                for _ in range(2):  # two calls: the second sends the reply back
                    start = time.perf_counter()
                    r = await http.post(f"/sessions/{sid}/v1/chat/completions",
                                        json={"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 16,
                                              "seed": episode_index})
                    stats["latency"].append(time.perf_counter() - start)
                    r.raise_for_status()
                    replies.append(r.json())
                    message = replies[-1]["choices"][0]["message"]
                    messages.append({k: v for k, v in message.items() if v is not None and k != "refusal"})
                    calls = message.get("tool_calls") or []
                    messages += [{"role": "tool", "tool_call_id": c["id"], "content": str(index + episode_index)}
                                 for c in calls] or [{"role": "user", "content": "Go on."}]
                reward, turn_rewards = float(episode_index % 2), [0.25, 0.75]
                r = await http.post(f"/sessions/{sid}/finish", json={"reward": reward, "turn_rewards": turn_rewards})
                r.raise_for_status()
                r = await http.get(f"/sessions/{sid}/episode")
                r.raise_for_status()
                problem = check_episode(r.json(), replies, turn_rewards, reward)
            except (httpx.HTTPError, KeyError, StopIteration, ValueError) as exc:
                stats["lost"] += 1
                stats["problems"].append(f"{sid}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            if problem:
                stats["corrupted"] += 1
                stats["problems"].append(f"{sid}: {problem}")
            else:
                stats["episodes"] += 1


# -- hostile clients ---------------------------------------------------------------------------------------

def _request(path: str, body: bytes, *, key: str = KEY, chunked: bool = False, length: int | None = None,
             host: str = "127.0.0.1") -> bytes:
    head = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json", f"Authorization: Bearer {key}"]
    head.append("Transfer-Encoding: chunked" if chunked else
                f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (b"" if chunked else body)


async def _status(reader: asyncio.StreamReader, timeout_s: float) -> int:
    """The status of the response on ``reader`` (its body read and dropped)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await asyncio.wait_for(reader.readexactly(length), timeout_s)
    return int(head.split(b" ")[1])


def chat_body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                       **fields}).encode()


ATTACKS = ["not_json", "nan_number", "nan_reward", "wrong_key", "huge_body", "huge_chunked", "slow_body",
           "bad_field", "huge_message", "surrogate_content", "surrogate_tool", "surrogate_arguments", "huge_reward",
           "rebinding", "nul_session"]
SURROGATE_TOOL = {"type": "function", "function": {"name": "calculator", "description": "Evaluate \ud800.",
                                                   "parameters": {"type": "object", "properties": {}}}}
SURROGATE_CALL = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"x": "\\ud800"}'}}
HUGE_MESSAGE = chat_body(messages=[{"role": "user", "content": "ab " * 1_300_000}])
"""3.9 MB: what a ``--huge`` client sends, one after another."""


async def attack(port: int, kind: str, n: int, read_timeout: float) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if kind == "not_json":
            writer.write(_request("/v1/chat/completions", b'{"model": "tiny", "messages": ['))
        elif kind == "nan_number":
            writer.write(_request("/v1/chat/completions", chat_body()[:-1] + b', "temperature": NaN}'))
        elif kind == "nan_reward":
            writer.write(_request(f"/sessions/hostile-{n}/reward", b'{"reward": NaN}'))
        elif kind == "wrong_key":
            writer.write(_request("/v1/chat/completions", chat_body(), key="guess"))
        elif kind == "huge_body":
            writer.write(_request("/v1/chat/completions", b"x" * (8 << 20)))
        elif kind == "huge_chunked":
            writer.write(_request("/v1/chat/completions", b"", chunked=True))
            chunk = b"x" * (1 << 20)
            for _ in range(8):
                writer.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        elif kind == "slow_body":
            writer.write(_request("/v1/chat/completions", chat_body()[:20], length=len(chat_body())))
        elif kind == "bad_field":
            writer.write(_request("/v1/chat/completions", chat_body(messages=[
                {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": {"x": n}, "content": "4"}])))
        elif kind == "huge_message":  # 1 MB of text to tokenise, far past the context
            writer.write(_request("/v1/chat/completions", chat_body(messages=[{"role": "user",
                                                                               "content": "ab " * 330_000}])))
        elif kind == "surrogate_content":
            writer.write(_request("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "\ud800"}])))
        elif kind == "surrogate_tool":
            writer.write(_request("/v1/chat/completions", chat_body(tools=[SURROGATE_TOOL])))
        elif kind == "surrogate_arguments":
            writer.write(_request("/v1/chat/completions", chat_body(messages=[
                {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [SURROGATE_CALL]}])))
        elif kind == "huge_reward":
            writer.write(_request(f"/sessions/hostile-{n}/reward", b'{"reward": 1e308}'))
        elif kind == "rebinding":
            writer.write(_request("/v1/chat/completions", chat_body(), host=f"attacker.example:{port}"))
        elif kind == "nul_session":
            writer.write(_request("/sessions/a%00b/v1/chat/completions", chat_body()))
        elif kind == "huge_4mb":
            writer.write(_request("/v1/chat/completions", HUGE_MESSAGE))
        await writer.drain()
        return await _status(reader, read_timeout + 30)
    finally:
        writer.close()


async def hostile_client(port: int, index: int, stop_at: float, stats: dict, read_timeout: float,
                         kinds: tuple[str, ...] = tuple(ATTACKS)) -> None:
    n = index
    while time.monotonic() < stop_at:
        kind = kinds[n % len(kinds)]
        n += 1
        try:
            status = await attack(port, kind, n, read_timeout)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, TimeoutError) as exc:
            stats["unexpected"].append(f"{kind}: {type(exc).__name__}")
            continue
        stats["hostile"][f"{kind} {status}"] += 1
        if not 400 <= status < 500:
            stats["unexpected"].append(f"{kind}: {status}")


# -- the soak --------------------------------------------------------------------------------------------

async def soak(args, port: int, pid: int) -> dict:
    stats = {"latency": [], "episodes": 0, "lost": 0, "corrupted": 0, "problems": [], "hostile": Counter(),
             "unexpected": [], "rss": []}
    base = f"http://127.0.0.1:{port}"
    warm = {"latency": [], "episodes": 0, "lost": 0, "corrupted": 0, "problems": []}
    await honest_client(base, 999, time.monotonic() + 0.1, warm)  # (one episode: caches and threads warm)
    start = time.monotonic()
    stop_at = start + args.seconds

    async def sample_rss():
        import httpx

        async with httpx.AsyncClient(base_url=base, headers=auth(), timeout=30) as http:
            while time.monotonic() < stop_at:
                stats["rss"].append((round(time.monotonic() - start, 1), round(rss_mb(pid), 1)))
                health = (await http.get("/health")).json()
                print(f"  t={stats['rss'][-1][0]:6.1f} s  rss={stats['rss'][-1][1]:7.1f} MB  "
                      f"episodes={stats['episodes']}  hostile={sum(stats['hostile'].values())}  "
                      f"sessions kept={health['sessions']}  errors counted={health['errors']['total']}", flush=True)
                await asyncio.sleep(args.sample_every)

    await asyncio.gather(sample_rss(), *(honest_client(base, i, stop_at, stats) for i in range(args.clients)),
                         *(hostile_client(port, i, stop_at, stats, args.read_timeout) for i in range(args.hostile)),
                         *(hostile_client(port, i, stop_at, stats, args.read_timeout, ("huge_4mb",))
                           for i in range(args.huge)))
    stats["rss"].append((round(time.monotonic() - start, 1), round(rss_mb(pid), 1)))
    return stats


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=4, help="honest clients, each playing episodes in turn")
    parser.add_argument("--hostile", type=int, default=3, help="hostile clients")
    parser.add_argument("--huge", type=int, default=2, help="clients sending 3.9 MB messages, one after another")
    parser.add_argument("--read-timeout", type=float, default=2.0, help="the server's --read-timeout")
    parser.add_argument("--session-timeout", type=float, default=600.0,
                        help="the server's --session-timeout: how long a finished session is kept")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads (OMP_NUM_THREADS)")
    parser.add_argument("--config", default=str(ROOT / "examples" / "calculator_tiny.toml"))
    parser.add_argument("--smoke", action="store_true", help="a few seconds, two clients of each kind")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("overrides", nargs="*", help="config overrides for the server, e.g. model.name=...")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.clients, args.hostile, args.huge, args.sample_every = 2.5, 2, 2, 1, 1.0
    port = free_port()
    server = start_server(args, port)
    try:
        wait_until_up(server, port)
        print(f"ctxrl serve (pid {server.pid}) on 127.0.0.1:{port}: {args.clients} honest, {args.hostile} hostile "
              f"and {args.huge} 3.9 MB clients for {args.seconds:g} s", flush=True)
        stats = asyncio.run(soak(args, port, server.pid))
        alive = server.poll() is None
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    latency = sorted(stats["latency"])
    rss = [mb for _, mb in stats["rss"]]
    figures = {
        "seconds": args.seconds, "clients": args.clients, "hostile_clients": args.hostile, "huge_clients": args.huge,
        "rss_start_mb": rss[0], "rss_peak_mb": max(rss), "rss_end_mb": rss[-1],
        "latency_p50_s": round(statistics.median(latency), 4) if latency else None,
        "latency_p95_s": round(latency[int(0.95 * (len(latency) - 1))], 4) if latency else None,
        "chat_calls": len(latency), "episodes": stats["episodes"], "lost": stats["lost"],
        "corrupted": stats["corrupted"], "hostile_requests": sum(stats["hostile"].values()),
        "hostile_by_status": dict(sorted(stats["hostile"].items())), "unexpected": stats["unexpected"][:20],
        "problems": stats["problems"][:20], "server_alive": alive, "rss_samples": stats["rss"],
    }
    print(f"RSS (MB): start {figures['rss_start_mb']}, peak {figures['rss_peak_mb']}, end {figures['rss_end_mb']}")
    print(f"valid chat calls: {figures['chat_calls']}, p50 {figures['latency_p50_s']} s, "
          f"p95 {figures['latency_p95_s']} s")
    print(f"episodes: {figures['episodes']} complete, {figures['lost']} lost, {figures['corrupted']} corrupted")
    print(f"hostile requests: {figures['hostile_requests']}: "
          + ", ".join(f"{k} x{v}" for k, v in figures["hostile_by_status"].items()))
    print(f"unexpected answers to hostile requests: {len(stats['unexpected'])}; server alive: {alive}")
    for problem in figures["problems"]:
        print(f"  problem: {problem}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
