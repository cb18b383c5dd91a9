"""Lone surrogates: code points U+D800-U+DFFF on their own, which are not text.

JSON can write one (``"\\ud800"``) and Python keeps it in a ``str``, but UTF-8 cannot encode it and a
tokenizer refuses it: one in a tool call's arguments, a message or a tool's description used to stop a
training run, answer a ``ctxrl serve`` client with a 500, or refuse a task file with a traceback. Where
ctxrl reads such JSON it does one of two things:

- what someone can fix is refused, naming where the surrogate is (``find_surrogate``): a ``ctxrl serve``
  request is a 400 naming the field, a task file a one-line error naming its line and field;
- what is data of a run (a policy's tool call, an MCP server's description or result) keeps going, each lone
  surrogate replaced with U+FFFD, the replacement character (``replace_surrogates``,
  ``without_surrogates``); ``ChatRenderer.encode`` does the same as the last guard before the tokenizer.

A surrogate *pair* (``"\\ud83d\\ude00"``) is one character once JSON decodes it, and is left alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"
"""What replaces a lone surrogate: U+FFFD, as a UTF-8 decoder's ``errors="replace"`` writes an invalid byte."""


def replace_surrogates(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD (``text`` itself when it has none)."""
    return LONE_SURROGATE.sub(REPLACEMENT, text) if LONE_SURROGATE.search(text) else text


def find_surrogate(value: Any, path: str = "") -> str | None:
    """Where the first lone surrogate of a JSON value is (``messages[0].content``; ``path`` names the value itself),
    or None. Walked without recursion: a value as deep as ``json.loads`` reads is walked too."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if LONE_SURROGATE.search(item):
                return where or "the value"
            continue
        if isinstance(item, dict):
            children = []
            for key, child in item.items():
                inner = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and LONE_SURROGATE.search(key):
                    return f"a key of {where or 'the value'}"
                children.append((child, inner))
        elif isinstance(item, (list, tuple)):
            children = [(child, f"{where}[{i}]") for i, child in enumerate(item)]
        else:
            continue
        stack.extend(reversed(children))  # (the first in document order is found first)
    return None


def without_surrogates(value: Any) -> Any:
    """A JSON value with every lone surrogate in its strings (keys too) replaced by U+FFFD; ``value`` itself when it
    has none."""
    if find_surrogate(value) is None:
        return value
    return json.loads(replace_surrogates(json.dumps(value, ensure_ascii=False)))
