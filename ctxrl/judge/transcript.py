"""What a judge reads of an episode: its whole transcript, or its final answer, as plain text.

The transcript lists every message the episode's sequences rendered, in order, one block per message headed by its
role (``ASSISTANT``, ``TOOL (calculator)``, ...). An episode cut into segments (a summary, a window) starts each
segment again from its opening; the messages a segment repeats verbatim from the first one's opening (the system
prompt, the task) are written once, so the judge reads what happened rather than what the context manager showed
the policy again (a summary's restart, whose task message carries the summary, is shown). The answer is the text
of the last assistant message, as sampled. Neither holds the task's reference answer: the rubric shows it only
where the run asks (``reward.judge.reference``).
"""

from __future__ import annotations

from ctxrl.types import Episode, Message

INPUTS = ("transcript", "answer")
"""What the judge may read (``reward.judge.input``)."""


def transcript(episode: Episode) -> str:
    """Every message of every sequence, the openings that segments repeat written once."""
    blocks: list[str] = []
    opening: list[tuple[str, str]] = []
    for k, sequence in enumerate(episode.sequences()):
        messages = sequence.messages
        if k == 0:
            opening = [(m.role, m.content) for m in messages if m.role in ("system", "user")][:2]
        else:
            while messages and opening and (messages[0].role, messages[0].content) in opening:
                messages = messages[1:]
        blocks += [block(m) for m in messages]
    return "\n\n".join(blocks)


def block(message: Message) -> str:
    head = message.role.upper() + (f" ({message.name})" if message.name else "")
    return f"{head}:\n{message.content}"


def final_answer(episode: Episode) -> str:
    """The text of the episode's last assistant message ("" when it wrote none)."""
    for sequence in reversed(episode.sequences()):
        for message in reversed(sequence.messages):
            if message.role == "assistant":
                return message.content
    return ""


def judge_input(episode: Episode, kind: str) -> str:
    """What the judge grades: ``transcript`` or ``answer`` (``INPUTS``)."""
    if kind not in INPUTS:
        raise ValueError(f"reward.judge.input must be one of {', '.join(INPUTS)}, got {kind!r}")
    return transcript(episode) if kind == "transcript" else final_answer(episode)
