"""Two coding agents as people write them, trained by ctxrl on ``repo_tasks`` without rewriting them.

- ``anthropic_agent``: the Anthropic SDK's tool loop (Messages API: ``tool_use`` blocks in, ``tool_result`` blocks
  back), the shape of a Claude Code-style harness;
- ``responses_agent``: OpenAI's Responses API (``function_call`` items in, ``function_call_output`` items back,
  each turn chained to the last with ``previous_response_id``), the shape of a Codex-style harness.

Neither knows about ctxrl's training: ``client`` is the SDK's own async client, bound by ctxrl to the episode's
session of ``ctxrl serve`` (``anthropic_agent.client = "anthropic"`` asks for an ``AsyncAnthropic``), and the number
returned is the reward. The tools run where a coding agent runs them: in a checkout of the task's repository, here
ctxrl's sandboxed tree (``RepoTasksEnv``'s tools), and the task's tests grade the result. The prompt and tool
schemas are the environment's, so ``repo_tasks``' scripted solutions warm-start them (docs/serve.md).

    .venv/bin/ctxrl train examples/harness/repo_anthropic.toml       # or repo_responses.toml
"""

from __future__ import annotations

import json

from ctxrl.envs.repo_tasks import RepoTasksEnv
from ctxrl.tools.base import execute_tool_calls
from ctxrl.types import Message, ToolCall

MAX_TURNS = 6


async def _tool(env: RepoTasksEnv, name: str, arguments: dict) -> str:
    """Run one tool call in the task's sandboxed checkout: its observation, an error included."""
    call = Message("assistant", "", tool_calls=[ToolCall(name, arguments)])
    [observation], _ = await execute_tool_calls(env.tools, call)
    return observation.content


async def anthropic_agent(client, task, max_turns: int = MAX_TURNS) -> float:
    """The Messages tool loop: ask, run every ``tool_use``, send the results, until a reply has no tool use."""
    env = RepoTasksEnv()
    messages = env.reset(task)
    system, history = messages[0].content, [{"role": "user", "content": messages[1].content}]
    tools = [{"name": t.name, "description": t.description, "input_schema": t.parameters} for t in env.tools]
    try:
        for _ in range(max_turns):
            reply = await client.messages.create(model="policy", max_tokens=512, system=system, messages=history,
                                                 tools=tools)
            history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if reply.stop_reason != "tool_use" or not uses:
                break
            history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": await _tool(env, b.name, b.input)}
                for b in uses]})
        passed, total, ok = await env.grade()
        return 1.0 if ok else 0.0
    finally:
        env.close()


anthropic_agent.client = "anthropic"


async def responses_agent(client, task, max_turns: int = MAX_TURNS) -> float:
    """The Responses loop: each turn sends only the new items, chained to the last response."""
    env = RepoTasksEnv()
    messages = env.reset(task)
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}
             for t in env.tools]
    items, previous = [{"role": "user", "content": messages[1].content}], None
    try:
        for _ in range(max_turns):
            response = await client.responses.create(model="policy", instructions=messages[0].content, input=items,
                                                     tools=tools, previous_response_id=previous,
                                                     max_output_tokens=512)
            previous = response.id
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                break
            items = []
            for call in calls:
                try:
                    arguments = json.loads(call.arguments)
                except json.JSONDecodeError:
                    arguments = None
                output = await _tool(env, call.name, arguments) if isinstance(arguments, dict) else (
                    "Error: the arguments are not a JSON object")
                items.append({"type": "function_call_output", "call_id": call.call_id, "output": output})
        passed, total, ok = await env.grade()
        return 1.0 if ok else 0.0
    finally:
        env.close()
