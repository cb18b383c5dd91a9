"""MCP tools (``env.mcp_servers``) against real servers: a test server started over stdio and over HTTP on loopback,
driven by the agent loop with a scripted policy; ctxrl's own tools served over MCP; what ``ctxrl tools`` lists.

The test server (tests/fixtures/mcp/server.py) is written with the SDK's ``MCPServer``: ``add``, ``note`` /
``notes`` (state in the server), ``slow`` (past the deadline), ``fail`` (an error result), ``crash`` (the process
exits mid-call), ``files.read`` (a name the policy sees as ``files_read``) and ``pick`` (a schema that is not flat).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.config import load_config
from ctxrl.engine.scripted import ScriptedEngine
from ctxrl.envs.base import EnvError
from ctxrl.envs.mcp import start_tools, with_mcp_tools
from ctxrl.envs.registry import configured_env_class
from ctxrl.rollout.agent import run_episodes
from ctxrl.rollout.spec import RolloutSpec
from ctxrl.sections import EnvConfig
from ctxrl.tools.base import ToolFailed
from ctxrl.tools.mcp import McpError, McpHub, close_hub, mcp_hub, parse_server
from ctxrl.tools.mcp_content import clean_schema, exposed_name, result_text

pytest.importorskip("mcp")

ROOT = Path(__file__).resolve().parents[1]
SERVER = f"python {ROOT}/tests/fixtures/mcp/server.py"


def tasks_file(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"split": "train", **row}) + "\n" for row in rows))
    return str(path)


def mcp_env(data: str, settings: EnvConfig, tools: str = "") -> type:
    return with_mcp_tools(configured_env_class("jsonl_tools", data=data, tools=tools, verifier="exact"), settings)


def play(env_cls: type, texts: list[str], renderer, task=None, max_turns: int = 8):
    """One episode of ``env_cls``'s first train task (or ``task``) with a policy that writes ``texts``."""
    limits = dataclasses.replace(RolloutSpec.from_config(load_config(None, [])).train, max_turns=max_turns,
                                 max_total_tokens=4096, max_new_tokens=256, temperature=1.0)
    task = task or env_cls.tasks["train"][0]
    engine = ScriptedEngine(texts, renderer)
    [episode] = asyncio.run(run_episodes(env_cls, [task], engine, renderer, limits, seed=1))
    return episode, engine


def observations(episode) -> list[str]:
    return [m.content for m in episode.messages if m.role == "tool"]


def call(name: str, **arguments) -> str:
    return format_tool_call(name, arguments)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def processes_with(variable: bytes) -> list[int]:
    """The processes whose environment holds ``variable`` (``NAME=value``)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and variable in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- a server over stdio, driven by the agent loop --------------------------------------------------------------
def test_a_stdio_server_in_the_agent_loop_deadline_errors_crash_and_restart(tmp_path, renderer):
    settings = EnvConfig(mcp_servers=[f"PID_FILE={tmp_path}/pid {SERVER}"], mcp_timeout_s=1.5, mcp_restarts=1)
    env_cls = mcp_env(tasks_file(tmp_path, [{"prompt": "Add 2 and 3.", "answer": "5"}]), settings)
    try:
        assert [t.name for t in start_tools(env_cls)] == ["add", "note", "notes", "slow", "fail", "crash",
                                                          "files_read", "pick"]
        episode, engine = play(env_cls, [call("add", a=2, b=3), call("slow", seconds=30), call("fail", reason="no"),
                                         call("files_read", path="a.txt"),
                                         call("pick", color="red", window={"start": 1, "end": 4}),
                                         "<answer>5</answer>"], renderer)
        assert observations(episode) == [
            "5", "Error: tool slow timed out after 1.5s",
            "Error: tool fail failed: Error executing tool fail: cannot do that: no", "contents of a.txt", "red 1-4"]
        assert episode.reward == 1.0 and episode.success and episode.truncation is None
        assert [t.tool_errors for t in episode.turns] == [0, 1, 1, 0, 0, 0]
        prompt = renderer.decode(engine.prompts[0])  # the policy saw the servers' schemas, less pydantic's titles
        assert '"name": "files_read"' in prompt and '"$ref": "#/$defs/Window"' in prompt
        assert "addArguments" not in prompt

        state, _ = play(env_cls, [call("note", text="first"), call("notes"), "<answer>5</answer>"], renderer)
        assert observations(state) == ["1 notes", "first"]
        first_pid = int((tmp_path / "pid").read_text())
        crashed, _ = play(env_cls, [call("note", text="x"), call("crash"), "<answer>5</answer>"], renderer)
        assert crashed.truncation == "error" and crashed.info["error_kind"] == "tool_server"
        assert "died during a call to crash" in crashed.info["error"]
        assert "crashing on purpose" in crashed.info["error"]  # (the end of its stderr)
        assert "it is being started again for the next calls" in crashed.info["error"]

        after, _ = play(env_cls, [call("notes"), "<answer>5</answer>"], renderer)  # a new process: its notes are gone
        assert observations(after) == ["none"] and after.reward == 1.0 and mcp_hub(settings).restarts() == [1]
        assert int((tmp_path / "pid").read_text()) != first_pid and not is_running(first_pid)

        again, _ = play(env_cls, [call("crash")], renderer)  # (env.mcp_restarts = 1: spent)
        assert again.info["error_kind"] == "tool_server" and "no restarts are left" in again.info["error"]
        down, _ = play(env_cls, [call("add", a=1, b=1)], renderer)
        assert down.info["error_kind"] == "tool_server" and "env.mcp_restarts = 1" in down.info["error"]
    finally:
        close_hub(settings)


def test_a_wrong_argument_for_a_nested_schema_is_the_servers_error_observation(tmp_path, renderer):
    settings = EnvConfig(mcp_servers=[SERVER], mcp_tools="pick,add", mcp_timeout_s=10)
    env_cls = mcp_env(tasks_file(tmp_path, [{"prompt": "Pick.", "answer": "ok", "tools": ["pick"]}]), settings)
    try:
        episode, engine = play(env_cls, [call("pick", color="green", window={"start": 1}), call("add", a=1, b=2),
                                         "<answer>ok</answer>"], renderer)
        picked, unknown = observations(episode)
        assert picked.startswith("Error: tool pick failed:") and "color" in picked and "window.end" in picked
        assert unknown == "Error: unknown tool 'add'; available tools: pick"  # (this task offers pick alone)
        assert '"name": "add"' not in renderer.decode(engine.prompts[0])
        assert [t.name for t in start_tools(env_cls)] == ["add", "pick"]  # env.mcp_tools: these two, in listing order
        with pytest.raises(EnvError, match=r"tasks.jsonl:2: the task names tool 'notes', which this run does not "
                                           r"offer; it offers add, pick"):
            mcp_env(tasks_file(tmp_path, [{"prompt": "a", "answer": "yes"},
                                          {"prompt": "c", "answer": "no", "tools": ["notes"]}]), settings)()
    finally:
        close_hub(settings)


# -- a server over streamable HTTP on loopback ------------------------------------------------------------------
def test_an_http_server_on_loopback_and_a_reconnection_after_it_died(tmp_path, renderer):
    port = free_port()
    command = [sys.executable, str(ROOT / "tests/fixtures/mcp/server.py"), "--http", str(port)]
    settings = EnvConfig(mcp_servers=[f"http://127.0.0.1:{port}/mcp"], mcp_timeout_s=10, mcp_restarts=3)
    env_cls = mcp_env(tasks_file(tmp_path, [{"prompt": "Add 2 and 3.", "answer": "5"}]), settings)
    server = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        episode, _ = play(env_cls, [call("add", a=2, b=3), call("note", text="kept"), call("notes"),
                                    "<answer>5</answer>"], renderer)
        assert observations(episode) == ["5", "1 notes", "kept"] and episode.reward == 1.0
        crashed, _ = play(env_cls, [call("crash")], renderer)
        assert crashed.info["error_kind"] == "tool_server" and "died during a call to crash" in crashed.info["error"]
        server.wait(30)
        server = subprocess.Popen(command, stderr=subprocess.DEVNULL)  # (someone starts it again)
        wait_for_port(port)
        after, _ = play(env_cls, [call("notes"), "<answer>5</answer>"], renderer)
        assert observations(after) == ["none"] and after.reward == 1.0
    finally:
        close_hub(settings)
        server.kill()
        server.wait(30)


def test_a_server_down_for_a_moment_costs_one_restart_not_all_of_them(tmp_path, renderer):
    """An HTTP server that is gone between calls and back 1.5 s later (a redeploy). The call that finds it gone
    errors its episode (the session ended under it) and starts a restart, whose tries back off for seconds
    (RESTART_DELAYS_S); the next episode waits for that restart and plays. Before, the restarts were spent in a
    tenth of a second and every later call failed."""
    import threading

    port = free_port()
    command = [sys.executable, str(ROOT / "tests/fixtures/mcp/server.py"), "--http", str(port)]
    settings = EnvConfig(mcp_servers=[f"http://127.0.0.1:{port}/mcp"], mcp_timeout_s=15, mcp_restarts=2)
    env_cls = mcp_env(tasks_file(tmp_path, [{"prompt": "Add 2 and 3.", "answer": "5"}]), settings)
    servers = [subprocess.Popen(command, stderr=subprocess.DEVNULL)]
    try:
        wait_for_port(port)
        first, _ = play(env_cls, [call("add", a=2, b=3), "<answer>5</answer>"], renderer)
        assert first.reward == 1.0
        servers[0].kill()
        servers[0].wait(30)
        later = threading.Timer(1.5, lambda: servers.append(subprocess.Popen(command, stderr=subprocess.DEVNULL)))
        later.start()
        lost, _ = play(env_cls, [call("add", a=2, b=3), "<answer>5</answer>"], renderer)
        assert lost.info["error_kind"] == "tool_server" and "started again for the next calls" in lost.info["error"]
        after, _ = play(env_cls, [call("add", a=2, b=3), "<answer>5</answer>"], renderer)
        later.join()
        assert observations(after) == ["5"], after.info
        assert after.reward == 1.0 and mcp_hub(settings).restarts() == [1]
    finally:
        close_hub(settings)
        for server in servers:
            server.kill()
            server.wait(30)


# -- the other direction, and the same episode either way --------------------------------------------------------
def test_ctxrl_mcp_serve_over_stdio_and_http_serves_the_builtin_tools_as_ctxrl_runs_them(tmp_path, renderer):
    from ctxrl.tools.builtin import builtin_tool

    port = free_port()
    http = subprocess.Popen([sys.executable, "-m", "ctxrl", "mcp-serve", "--tools", "python", "--port", str(port)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    stdio = f"PYTHONPATH={ROOT} python -m ctxrl mcp-serve --tools calculator"  # (the checkout's ctxrl)
    settings = EnvConfig(mcp_servers=[stdio, f"http://127.0.0.1:{port}/mcp"], mcp_timeout_s=30)
    env_cls = mcp_env(tasks_file(tmp_path, [{"prompt": "What is 6 times 7?", "answer": "42"}]), settings)
    try:
        wait_for_port(port)
        tools = start_tools(env_cls)
        assert [t.schema() for t in tools] == [builtin_tool("calculator").schema(), builtin_tool("python").schema()]
        episode, _ = play(env_cls, [call("calculator", expression="6 * 7"), call("calculator", expression="1 / 0"),
                                    call("python", code="print(6 * 7)"), call("calculator", expr="6"),
                                    "<answer>42</answer>"], renderer)
        assert observations(episode) == [
            "42", "Error: tool calculator failed: tool calculator raised CalculatorError: division by zero", "42",
            "Error: tool calculator failed: invalid arguments for tool calculator: missing required argument "
            "'expression'"]
        with pytest.raises(EnvError, match="MCP tool 'calculator' has the name of one of jsonl_tools's own tools"):
            mcp_env(env_cls.sources[0][0].rsplit(":", 1)[0], settings, tools="calculator")()
    finally:
        close_hub(settings)
        http.terminate()
        http.wait(30)


def test_the_calculator_over_mcp_is_the_builtin_calculator_token_for_token(renderer):
    """The example server's tool and the built-in one: the same prompts, ids, masks and rewards."""
    data = str(ROOT / "examples/mcp/tasks.jsonl")
    builtin = configured_env_class("jsonl_tools", data=data, tools="calculator", verifier="numeric")
    settings = EnvConfig(mcp_servers=[f"python {ROOT}/examples/mcp/calculator_server.py"])
    over_mcp = with_mcp_tools(configured_env_class("jsonl_tools", data=data, verifier="numeric"), settings)
    try:
        for task in builtin.sample_tasks("train", 2, seed=0) + builtin.sample_tasks("ood", 1, seed=0):
            texts = builtin.solve(task)
            mine, mine_engine = play(builtin, texts, renderer, task)
            theirs, their_engine = play(over_mcp, texts, renderer, task)
            assert mine.reward == theirs.reward == 1.0 and mine.turns[0].tool_calls == 1
            assert their_engine.prompts == mine_engine.prompts
            assert theirs.input_ids == mine.input_ids and theirs.loss_mask == mine.loss_mask
    finally:
        close_hub(settings)


# -- what `ctxrl tools` lists ---------------------------------------------------------------------------------------
def test_ctxrl_tools_lists_what_the_policy_will_see(tmp_path, capsys):
    from ctxrl.cli import main

    data = tasks_file(tmp_path, [{"prompt": "p", "answer": "yes"}])
    server = f"PID_FILE={tmp_path}/pid {SERVER}"
    args = ["tools", str(ROOT / "examples/calculator_tiny.toml"), "env.name=jsonl_tools", f'env.data="{data}"',
            "env.jsonl_tools.tools=calculator", f"env.mcp_servers=[{json.dumps(server)}]",
            "env.mcp_tools=files.read,pick",
            "context.manager=fold"]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["calculator  (environment jsonl_tools)", "  Evaluate an arithmetic expression.",
                       "    expression (string, required)"]
    assert out[3:6] == [f"files_read  (MCP server env.mcp_servers[0] ({server!r}) as 'files.read')",
                        "  Read a file (a pretend one).", "    path (string, required)"]
    assert out[7:11] == ["  Pick a color for a window.", "    color (string, required)",
                         '    window ({"$ref": "#/$defs/Window"}, required)',
                         '    title ({"anyOf": [{"type": "string"}, {"type": "null"}], "default": null})']
    assert out[11:] == ["branch  (context manager fold)",
                        "  Work on a sub-task in a fresh context; you get back only its result.",
                        "    goal (string, required)", "return  (context manager fold)",
                        "  End the current sub-task and hand its result to the main task.",
                        "    result (string, required)"]
    assert not is_running(int((tmp_path / "pid").read_text()))  # (listed, then shut down)
    assert main([*args, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [t["function"]["name"] for t in listed] == ["calculator", "files_read", "pick", "branch", "return"]
    assert listed[1] == {"source": f"MCP server env.mcp_servers[0] ({server!r}) as 'files.read'", "type": "function",
                         "function": {"name": "files_read", "description": "Read a file (a pretend one).",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}}


# -- what is refused, and how it is said ------------------------------------------------------------------------------
def test_server_entries_are_parsed_or_refused_with_the_fix():
    entry = parse_server("DB=/tmp/x.db LEVEL='a b' python -u server.py --fast")
    assert entry.argv == (sys.executable, "-u", "server.py", "--fast") and entry.env == (("DB", "/tmp/x.db"),
                                                                                         ("LEVEL", "a b"))
    assert parse_server(" https://tools.example.org/mcp ").url == "https://tools.example.org/mcp"
    for text, message in [("", "an empty entry"), ("ftp://host/x", "not an http"), ("http:///mcp", "not an http"),
                          ("python 'unclosed", "not a command line"), ("A=1 B=2", "names no command"),
                          ("no-such-program-36 --x", "no program 'no-such-program-36' on PATH")]:
        with pytest.raises(ValueError, match=message):
            parse_server(text)


def test_configuration_errors_are_one_line_naming_the_fix(tmp_path, monkeypatch):
    from ctxrl.envs.harness import HarnessEnv

    data = tasks_file(tmp_path, [{"prompt": "p", "answer": "yes"}])
    jsonl = configured_env_class("jsonl_tools", data=data)
    with pytest.raises(EnvError, match=r"env.mcp_tools = 'add' names MCP tools, but env.mcp_servers is empty"):
        with_mcp_tools(jsonl, EnvConfig(mcp_tools="add"))
    assert with_mcp_tools(jsonl, EnvConfig()) is jsonl
    with pytest.raises(EnvError, match=r"^env.mcp_servers\[1\]: 'nope-36': no program 'nope-36' on PATH"):
        with_mcp_tools(jsonl, EnvConfig(mcp_servers=[SERVER, "nope-36"]))
    with pytest.raises(EnvError, match="HarnessEnv answers them another way"):
        with_mcp_tools(HarnessEnv, EnvConfig(mcp_servers=[SERVER]))
    with pytest.raises(EnvError, match="harness"):  # (the same through the config, as `ctxrl config` reports it)
        from ctxrl.train.preflight import preflight

        preflight(load_config(None, ["env.name=harness",
                                     'env.harness.agent="examples/harness/calculator_agent.py:rollout"',
                                     'env.data="env:calculator"', f"env.mcp_servers=[{json.dumps(SERVER)}]"]))
    import ctxrl.tools.mcp as mcp_module

    real = mcp_module.importlib.util.find_spec
    monkeypatch.setattr(mcp_module.importlib.util, "find_spec", lambda name, *a: None if name == "mcp" else real(name))
    with pytest.raises(EnvError, match=r"^env.mcp_servers needs the mcp package, which is not installed: "
                                       r"pip install -e '.\[mcp\]'$"):
        with_mcp_tools(jsonl, EnvConfig(mcp_servers=[SERVER]))


def test_a_server_that_cannot_start_says_what_it_wrote():
    settings = EnvConfig(mcp_servers=["python -c \"import sys; sys.exit('no database at /nowhere')\""])
    try:
        with pytest.raises(McpError, match=r"env.mcp_servers\[0\] .* could not be started: .*; it wrote to stderr: "
                                           r"no database at /nowhere"):
            mcp_hub(settings).tools()
        assert mcp_hub(settings).closed is False  # (a failed start leaves nothing running, and may be tried again)
    finally:
        close_hub(settings)


def test_tool_names_clashes_and_the_allow_list_are_checked_on_the_listings():
    listed = [SimpleNamespace(name=n, description=f"the {n}", input_schema={"type": "object"}) for n in ("a", "b.c")]
    hub = McpHub(EnvConfig(mcp_servers=[SERVER, SERVER], mcp_tools="b.c"))
    hub._servers = [SimpleNamespace(label="one"), SimpleNamespace(label="two")]
    with pytest.raises(McpError, match="two MCP tools are named 'b_c': one of one and one of two; leave one out"):
        hub._make_tools([listed, listed])
    hub = McpHub(EnvConfig(mcp_servers=[SERVER], mcp_tools="a,zzz"))
    hub._servers = [SimpleNamespace(label="one")]
    with pytest.raises(McpError, match="env.mcp_tools names zzz, which no MCP server offers; they offer a, b_c"):
        hub._make_tools([listed])
    hub = McpHub(EnvConfig(mcp_servers=[SERVER], mcp_tools="b_c"))
    hub._servers = [SimpleNamespace(label="one")]
    [tool] = hub._make_tools([listed])
    assert tool.name == "b_c" and hub.sources == {"b_c": ("one", "b.c")} and tool.checks_arguments


def test_schemas_lose_titles_not_properties_named_title_and_names_are_made_writable():
    schema = {"title": "pickArguments", "type": "object", "required": ["title"],
              "properties": {"title": {"title": "Title", "type": "string"},
                             "w": {"anyOf": [{"$ref": "#/$defs/W"}, {"type": "null"}], "title": "W"}},
              "$defs": {"W": {"title": "W", "type": "object", "properties": {"n": {"title": "N", "type": "integer"}},
                              "items": [{"title": "x"}]}}}
    assert clean_schema(schema) == {
        "type": "object", "required": ["title"],
        "properties": {"title": {"type": "string"}, "w": {"anyOf": [{"$ref": "#/$defs/W"}, {"type": "null"}]}},
        "$defs": {"W": {"type": "object", "properties": {"n": {"type": "integer"}}, "items": [{}]}}}
    assert [exposed_name(n) for n in ("files.read", "a/b c", "ok-name_1", "x" * 80, "...")] == [
        "files_read", "a_b_c", "ok-name_1", "x" * 64, "___"]


def test_results_become_one_observation_text():
    def text(value: str):
        return SimpleNamespace(type="text", text=value)

    blocks = [text("first"), SimpleNamespace(type="image", mime_type="image/png", data="A" * 400),
              SimpleNamespace(type="resource", resource=SimpleNamespace(uri="file:///a", text="inline text")),
              SimpleNamespace(type="resource", resource=SimpleNamespace(uri="file:///b", blob="AAAA",
                                                                        mime_type="application/pdf")),
              SimpleNamespace(type="resource_link", uri="file:///c"), text("")]
    assert result_text(SimpleNamespace(content=blocks, structured_content={"x": 1}, is_error=False)).splitlines() == [
        "first", "[image image/png, 300 bytes, not shown]", "inline text",
        "[resource file:///b (application/pdf), not shown]", "[resource file:///c]"]
    assert result_text(SimpleNamespace(content=[], structured_content={"result": [1, 2]}, is_error=False)) == (
        '{"result": [1, 2]}')
    assert result_text(SimpleNamespace(content=[], structured_content=None, is_error=False)) == "[no output]"
    assert result_text(SimpleNamespace(content=[text("abcdefghij")], is_error=False), limit=4) == (
        "abcd\n[output cut at 4 of 10 characters]")
    with pytest.raises(ToolFailed, match="^no such file$"):
        result_text(SimpleNamespace(content=[text("no such file")], is_error=True))


# -- a whole run, and the example's task file --------------------------------------------------------------------
def test_a_run_warm_starts_trains_and_evaluates_with_an_mcp_tool_and_shuts_its_server_down(tmp_path):
    from ctxrl.train.trainer import train

    mark = f"CTXRL_TEST_MARK={tmp_path.name}"
    server = f"{mark} python {ROOT}/examples/mcp/calculator_server.py"
    config = load_config(str(ROOT / "examples/mcp/calculator.toml"), [
        f'env.data="{ROOT}/examples/mcp/tasks.jsonl"', f"env.mcp_servers=[{json.dumps(server)}]",
        "model.name=tiny:pretrain_steps=0", "sft.demos=6", "sft.epochs=1", "sft.batch_size=3", "eval.tasks=2",
        "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=24", "run.progress=false",
        "train.steps=1", "train.eval_every=0"])
    summary = train(config, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sft = next(r for r in rows if r["phase"] == "sft")
    [rl] = [r for r in rows if r["phase"] == "rl"]
    assert summary["steps"] == 1 and sft["demos"] == 6 and rl["tokens"] > 0 and rl["errors_tool_server"] == 0
    samples = (tmp_path / "run" / "samples.jsonl").read_text()
    assert '\\"name\\": \\"calculator\\"' in samples or '"name": "calculator"' in samples  # (the tool was offered)
    assert not processes_with(mark.encode())  # (the run shut its server down)


def test_the_example_task_file_is_what_its_script_writes():
    import runpy

    rows = runpy.run_path(str(ROOT / "examples/mcp/make_tasks.py"))["rows"]()
    assert (ROOT / "examples/mcp/tasks.jsonl").read_text() == "".join(json.dumps(row) + "\n" for row in rows)
    assert {row["split"] for row in rows} == {"train", "heldout", "ood"}


def test_the_spec_carries_the_servers_to_a_worker_in_another_process():
    from ctxrl.plain import from_json, to_json

    config = load_config(str(ROOT / "examples/mcp/calculator.toml"), ["env.mcp_tools=calculator"])
    spec = RolloutSpec.from_config(config)
    assert spec.env == config.env == dataclasses.replace(  # (the [env] section crosses as it is)
        config.env, mcp_servers=["python examples/mcp/calculator_server.py"], mcp_tools="calculator",
        mcp_timeout_s=10.0, mcp_restarts=3)
    assert from_json(RolloutSpec, to_json(spec)) == spec
