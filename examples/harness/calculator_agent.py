"""An agent written against the plain OpenAI SDK, trained by ctxrl without rewriting it.

It solves the calculator task with a function tool, in the loop any OpenAI-style agent uses:
ask, run the tool calls it gets back, answer. Nothing in it knows about ctxrl: ``client`` is an
``openai.AsyncOpenAI``, and the number it returns is the reward.

    .venv/bin/ctxrl train examples/harness/calculator.toml          # train it (docs/serve.md)
"""

from __future__ import annotations

import ast
import json
import operator
import re

SYSTEM = "Use the calculator tool for arithmetic. Reply with <answer>N</answer>."
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> str:
    """The tool: + - * over integers, nothing else."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unsupported expression: {expression!r}")

    try:
        return str(value(ast.parse(expression[:256], mode="eval").body))
    except (SyntaxError, ValueError) as exc:
        return f"error: {exc}"


async def rollout(client, task, max_turns: int = 4) -> float:
    """Play one task; 1.0 for the right answer, else 0.0."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=48)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                try:
                    result = evaluate(json.loads(call.function.arguments).get("expression", ""))
                except (json.JSONDecodeError, AttributeError):
                    result = "error: the arguments are not a JSON object"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            continue
        found = re.search(r"<answer>\s*([-+]?\d+)\s*</answer>", message.content or "")
        return 1.0 if found and int(found.group(1)) == int(task.answer) else 0.0
    return 0.0
