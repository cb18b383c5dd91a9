"""MCP servers under the attacks of issue 51 (finding 7), each a real server over stdio
(tests/fixtures/mcp/hostile_server.py).

An input schema that breaks JSON Schema was a traceback; schemas larger than the context were accepted and
every episode truncated (up to 60 s and 0.5 GB each); the children a server starts, in its process group or in
a session or group of their own, outlived the run; and a warm start whose MCP server crashed during a
demonstration ended in a traceback. Now: one line naming the server and the tool, a refusal when the worker
starts, every process of the server's tree ended at shutdown, and one line naming the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from ctxrl.config import load_config  # noqa: E402
from ctxrl.envs.base import EnvError  # noqa: E402
from ctxrl.envs.mcp import with_mcp_tools  # noqa: E402
from ctxrl.envs.registry import configured_env_class  # noqa: E402
from ctxrl.sections import EnvConfig  # noqa: E402
from ctxrl.tools.mcp import McpError, close_hub, mcp_hub  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SERVER = f"python {ROOT}/tests/fixtures/mcp/hostile_server.py"
TASK = {"prompt": "What is 2 + 2?", "answer": "4", "split": "train", "tools": ["calculator"],
        "solution": ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>',
                     "<answer>4</answer>"]}


def env_with(tmp_path: Path, mode: str, **env) -> tuple[type]:
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps(TASK) + "\n")
    assignments = " ".join(f"{k}={v}" for k, v in env.items())
    settings = EnvConfig(mcp_servers=[f"{assignments} {SERVER} {mode}".strip()], mcp_restarts=0)
    cls = configured_env_class("jsonl_tools", data=str(data), tools="", verifier="exact")
    return with_mcp_tools(cls, settings), settings


def test_an_input_schema_that_breaks_json_schema_is_one_line_naming_the_server_and_tool(tmp_path):
    _, settings = env_with(tmp_path, "bad_schema")
    try:
        with pytest.raises(McpError, match=r"env.mcp_servers\[0\] .*tool 'calculator'.*input schema") as caught:
            mcp_hub(settings).tools()
    finally:
        close_hub(settings)
    assert "\n" not in str(caught.value) and "integr" in str(caught.value)


def test_schemas_larger_than_the_context_are_refused_when_the_worker_starts(tmp_path):
    env_cls, settings = env_with(tmp_path, "huge_schema")
    try:
        env_cls.check_tasks(4096)  # (no tokenizer yet, as at ctxrl config: no server is started)
        with pytest.raises(EnvError, match=r"take \d+ tokens .*calculator.*rollout.max_total_tokens = 4096") as caught:
            env_cls.check_tasks(4096, lambda text: len(text) // 2)  # (what a rollout worker calls, tokenizer in hand)
        assert "env.mcp_tools" in str(caught.value) and "\n" not in str(caught.value)
        env_cls.check_tasks(1 << 20, lambda text: len(text) // 2)  # a context that holds them: accepted
    finally:
        close_hub(settings)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # (a zombie is dead, waiting for its reaper)
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_every_process_a_server_starts_ends_at_shutdown(tmp_path):
    pids_file = tmp_path / "pids"
    _, settings = env_with(tmp_path, "children", CTXRL_TEST_PIDS=str(pids_file))
    try:
        assert [t.name for t in mcp_hub(settings).tools()] == ["calculator"]
        pids = [int(p) for p in pids_file.read_text().split()]
        assert len(pids) == 3 and all(alive(p) for p in pids)
    finally:
        close_hub(settings)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for pid in left:  # (clean up after a failure)
        os.kill(pid, 9)
    assert not left, f"processes of the MCP server outlived it: {left}"


def test_a_warm_start_whose_mcp_server_crashes_is_one_line(tmp_path):
    from ctxrl.demos.play import build_demos
    from ctxrl.rollout.spec import RolloutSpec
    from ctxrl.rollout.worker import spec_renderer

    env_cls, settings = env_with(tmp_path, "crash")
    renderer = spec_renderer(RolloutSpec.from_config(load_config(str(ROOT / "examples/calculator_tiny.toml"),
                                                                 ["model.device=cpu"])))
    try:
        with pytest.raises(McpError, match=r"env.mcp_servers\[0\].*died.*sft.enabled=false") as caught:
            asyncio.run(build_demos(env_cls, renderer, 1))
    finally:
        close_hub(settings)
    assert "\n" not in str(caught.value)
