"""How well can a model transcribe calculator word problems into a tool call? (greedy, held-out tasks)

The tiny model's pre-training exists to give it this skill; the warm start and RL build on it.
For each model the script prompts with a held-out task and the start of a calculator call
(``<tool_call>\\n{"name": "calculator", "arguments": {"expression": "``) and checks that the
greedy continuation is exactly the task's expression followed by ``"``, in three formats:

- ``plain``: the pre-training format (prompt, newline, call);
- ``chat``: the chat template without a system block;
- ``chat+system``: the chat template with the environment's system prompt and tool list, as in
  RL rollouts.

Usage (each ``tiny:...`` spec is built and cached on first use, a few minutes on 2 cores)::

    python benchmarks/tiny_skills.py --model tiny --model tiny:arch=qwen2 --tasks 100
    python benchmarks/tiny_skills.py --model runs/demo-.../checkpoints/final
"""

from __future__ import annotations

import argparse
import time

import torch

from ctxrl.chat.render import ChatRenderer
from ctxrl.envs.calculator import CalculatorEnv
from ctxrl.models.loader import load_model, load_tokenizer
from ctxrl.train.tiny import ensure_model

CALL_PREFIX = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'


def prompt_ids(fmt: str, task, tokenizer, renderer: ChatRenderer, env: CalculatorEnv) -> list[int]:
    if fmt == "plain":
        return tokenizer.encode(f"{task.prompt}\n{CALL_PREFIX}", add_special_tokens=False)
    messages = env.reset(task)
    tools = [t.schema() for t in env.tools]
    if fmt == "chat":
        messages, tools = messages[1:], None
    return renderer.prompt_ids(messages, tools) + tokenizer.encode(CALL_PREFIX, add_special_tokens=False)


@torch.no_grad()
def transcription_accuracy(model, tokenizer, fmt: str, tasks, max_tokens: int = 24) -> float:
    renderer, env = ChatRenderer(tokenizer), CalculatorEnv()
    correct = 0
    for task in tasks:
        ids = prompt_ids(fmt, task, tokenizer, renderer, env)
        start = len(ids)
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
            if '"' in tokenizer.decode(ids[-1:]):
                break
        correct += tokenizer.decode(ids[start:]).startswith(task.data["expression"] + '"')
    return correct / len(tasks)


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="model name or path (repeatable; default tiny)")
    parser.add_argument("--tasks", type=int, default=100, help="held-out tasks per format")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {}
    tasks = CalculatorEnv.sample_tasks("heldout", args.tasks, args.seed)
    print(f"{'model':40s} {'plain':>7s} {'chat':>7s} {'chat+system':>12s} {'seconds':>8s}")
    for name in args.model or ["tiny"]:
        path = ensure_model(name)
        tokenizer, model = load_tokenizer(path), load_model(path)
        model.eval()
        t0 = time.perf_counter()
        scores = [transcription_accuracy(model, tokenizer, fmt, tasks) for fmt in ("plain", "chat", "chat+system")]
        print(f"{name:40s} {scores[0]:7.2f} {scores[1]:7.2f} {scores[2]:12.2f} {time.perf_counter() - t0:8.1f}")
        results[name] = scores
    return results


if __name__ == "__main__":
    main()
