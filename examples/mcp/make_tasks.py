"""Write examples/mcp/tasks.jsonl: calculator word problems as a JSONL task file for ``jsonl_tools``.

Drawn from the built-in ``calculator`` environment (train: 1-3 digit numbers; ood: 4 digits), each with its
scripted solution (a call to the ``calculator`` tool, then the answer), so that a run can warm-start on them
and RL on them with the tool served by an MCP server (examples/mcp/calculator.toml).

    .venv/bin/python examples/mcp/make_tasks.py
"""

from __future__ import annotations

import json
from pathlib import Path

from ctxrl.envs.calculator import CalculatorEnv

COUNTS = {"train": 160, "heldout": 40, "ood": 40}


def rows() -> list[dict]:
    out = []
    for split, n in COUNTS.items():
        for task in CalculatorEnv.sample_tasks(split, n, seed=36):
            out.append({"id": task.id, "prompt": task.prompt, "answer": task.answer, "split": split,
                        "context": task.context, "solution": CalculatorEnv.solve(task)})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("tasks.jsonl")
    path.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    print(f"wrote {path} ({sum(COUNTS.values())} tasks)")
