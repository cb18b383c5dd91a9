"""The picture in docs/trajectories.md: one scripted calculator episode with the tiny tokenizer, its tokens coloured
by loss mask (``ctxrl.report.episode_figure.draw_episode``): a first, malformed tool call, then the solution.

    .venv/bin/python benchmarks/episode_figure.py docs/img/episode.png
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path


def scripted_example():
    """(the episode, the renderer's decode) of one scripted heldout calculator task."""
    from ctxrl.chat.render import ChatRenderer
    from ctxrl.engine.scripted import ScriptedEngine
    from ctxrl.envs.calculator import CalculatorEnv
    from ctxrl.models.loader import load_tokenizer
    from ctxrl.rollout.agent import run_episode
    from ctxrl.rollout.spec import RolloutLimits
    from ctxrl.train.tiny import ensure_model

    renderer = ChatRenderer(load_tokenizer(ensure_model("tiny")), template_name="tiny")
    task = CalculatorEnv.sample_tasks("heldout", 1, 3)[0]
    texts = ["<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expr\": 1}}\n</tool_call>",
             *CalculatorEnv.solve(task)]
    episode = asyncio.run(run_episode(CalculatorEnv(), task, ScriptedEngine(texts, renderer), renderer,
                                      RolloutLimits(max_turns=4, max_new_tokens=256)))
    return episode, renderer.decode


def main(argv: list[str] | None = None) -> Path:
    from ctxrl.report.episode_figure import draw_episode

    argv = sys.argv[1:] if argv is None else argv
    episode, decode = scripted_example()
    path = draw_episode(episode, decode, argv[0] if argv else "episode.png")
    print(path)
    return path


if __name__ == "__main__":
    main()
