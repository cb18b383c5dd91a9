"""Special-token strings in text the policy did not write, kept as plain text.

Text the policy did not write (system prompts, tasks, tool output, environment replies, the tools text
written into the system turn) is encoded with its special tokens as plain text: a tool that prints
``<|im_end|>`` and ``<|im_start|>assistant`` gets the ids of those characters, never the turn-boundary
ids, so model-written code cannot forge a turn. The template's own special tokens stay special. How:
before rendering, every special-token string inside such a message is replaced by a marker (``guard``);
the rendered text is encoded piece by piece, each marker as the plain-text ids of the string it stands
for (``encode_marked``). Text without special-token strings (nearly all of it) renders and encodes
exactly as it would unguarded. Assistant messages keep theirs: what the policy sampled is its own.

What this file does not do: render (``ctxrl.chat.render`` renders the guarded messages through the
template and checks that every marker came through, ``markers_intact``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from ctxrl.types import Message

_MARKER_START = "\ue000"
_MARKER = _MARKER_START + "ctxrl-{}\ue001"
_MARKERS = re.compile("\ue000ctxrl-(\\d+)\ue001")


def special_tokens(tokenizer: Any) -> list[str]:
    """Every special token of ``tokenizer``, longest first (so that one that contains another is replaced whole).

    The named ones (``all_special_tokens``) and added tokens marked special that no name lists (Llama 3's
    ``<|start_header_id|>`` kind).
    """
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    specials |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
                 if getattr(t, "special", False)}
    return sorted(specials, key=len, reverse=True)


def guard(messages: list[Message], specials: list[str]) -> tuple[list[Message], list[str]]:
    """``messages`` with every string of ``specials`` in a non-assistant message replaced by a marker.

    Returns the messages and the strings the markers stand for (marker ``i`` for ``strings[i]``),
    numbered in message order, so that renderings of a conversation and of a longer one agree.
    The marker's own first character is replaced too, in every message, so that no text can
    pass for a marker.
    """
    strings: list[str] = []
    if not specials:
        return messages, strings
    others = re.compile("|".join(re.escape(t) for t in [*specials, _MARKER_START]))
    assistant = re.compile(re.escape(_MARKER_START))

    def mark(match: re.Match) -> str:
        strings.append(match.group(0))
        return _MARKER.format(len(strings) - 1)

    out = []
    for m in messages:
        pattern = assistant if m.role == "assistant" else others
        if pattern.search(m.content):
            m = dataclasses.replace(m, content=pattern.sub(mark, m.content))
        out.append(m)
    return out, strings


def markers_intact(text: str, strings: list[str]) -> bool:
    """Whether rendered ``text`` holds one marker per guarded string (a template that drops or repeats message
    content does not)."""
    return not strings or len(_MARKERS.findall(text)) == len(strings)


def encode_marked(text: str, strings: list[str], encode: Callable[[str], list[int]],
                  encode_plain: Callable[[str], list[int]]) -> list[int]:
    """Encode rendered text: markers as their strings' plain-text ids (``encode_plain``), the rest with ``encode``."""
    if not strings:
        return encode(text)
    ids: list[int] = []
    last = 0
    for match in _MARKERS.finditer(text):
        ids += encode(text[last:match.start()])
        ids += encode_plain(strings[int(match.group(1))])
        last = match.end()
    return ids + encode(text[last:])
