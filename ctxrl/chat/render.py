"""Incremental chat rendering: turn k+1's ids are turn k's ids plus the new messages' ids.

ctxrl never decodes sampled tokens and re-tokenizes them. After the model samples an assistant
turn (ending with its end-of-turn token), the next prompt is built by appending the ids of
*only the newly added messages*, rendered through the tokenizer's own chat template:

1. render the history (through the last assistant message) as text, and the history plus the
   new messages (with the generation prompt) as text;
2. the second must start with the first (the template is prefix-preserving), and the extra
   text is the delta;
3. the template prints something after the end-of-turn token that closes the assistant turn
   (ChatML prints ``"\\n"``); the model stopped at the end-of-turn token, so that tail is
   prepended to the delta;
4. the delta is tokenized on its own. Because it starts right after a special token, its ids
   are exactly those the whole text would get.

``verify_prefix_preserving`` checks all of this once at start-up on a canned tool conversation
and raises ``TemplateError`` naming the template otherwise (e.g. templates that strip earlier
reasoning from history are not prefix-preserving).

Text the policy did not write (system prompts, tasks, tool output, environment replies) is
encoded with its special tokens as plain text: a tool that prints ``<|im_end|>`` and
``<|im_start|>assistant`` gets the ids of those characters, never the turn-boundary ids, so
model-written code cannot forge a turn. The template's own special tokens stay special. How:
before rendering, every special-token string inside such a message is replaced by a marker; the
rendered text is encoded piece by piece, each marker as the plain-text ids of the string it
stands for. Text without special-token strings (nearly all of it) renders and encodes exactly as
before. Assistant messages keep theirs: what the policy sampled is its own.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ctxrl.chat.toolcalls import format_tool_call
from ctxrl.errors import CtxrlError
from ctxrl.types import Message

_MARKER_START = "\ue000"
_MARKER = _MARKER_START + "ctxrl-{}\ue001"
_MARKERS = re.compile("\ue000ctxrl-(\\d+)\ue001")


class TemplateError(CtxrlError, RuntimeError):
    """The chat template cannot be rendered incrementally."""

    kind = "chat template error"


class ChatRenderer:
    """Renders messages to ids through a HF tokenizer's chat template, incrementally."""

    def __init__(self, tokenizer: Any, *, template_name: str = "") -> None:
        self.tokenizer = tokenizer
        self.template_name = template_name or getattr(tokenizer, "name_or_path", "") or "<chat template>"
        eos = tokenizer.eos_token
        if eos is None:
            raise TemplateError(f"tokenizer {self.template_name!r} has no eos_token to end assistant turns")
        self.eos_text: str = eos
        self.eos_id: int = tokenizer.convert_tokens_to_ids(eos)
        # Every special token: the named ones (all_special_tokens) and added tokens marked special that no
        # name lists (Llama 3's <|start_header_id|> kind). Longest first, so that one that contains another
        # is replaced whole.
        specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
        specials |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
                     if getattr(t, "special", False)}
        self.special_tokens: list[str] = sorted(specials, key=len, reverse=True)

    # -- text --------------------------------------------------------------------------------
    def text(self, messages: list[Message], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [m.to_chat() for m in messages], tools=tools or None, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, its special-token strings as special tokens (template text, policy text)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_plain(self, text: str) -> list[int]:
        """Ids of ``text`` with special-token strings taken as plain characters (text the policy did not write)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def _guarded(self, messages: list[Message]) -> tuple[list[Message], list[str]]:
        """``messages`` with every special-token string in a non-assistant message replaced by a marker.

        Returns the messages and the strings the markers stand for (marker ``i`` for ``strings[i]``),
        numbered in message order, so that renderings of a conversation and of a longer one agree.
        The marker's own first character is replaced too, in every message, so that no text can
        pass for a marker.
        """
        strings: list[str] = []
        if not self.special_tokens:
            return messages, strings
        others = re.compile("|".join(re.escape(t) for t in [*self.special_tokens, _MARKER_START]))
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

    def _encode_marked(self, text: str, strings: list[str]) -> list[int]:
        """Encode rendered text: markers as their strings' plain-text ids, the rest as ``encode`` does."""
        if not strings:
            return self.encode(text)
        ids: list[int] = []
        last = 0
        for match in _MARKERS.finditer(text):
            ids += self.encode(text[last:match.start()])
            ids += self.encode_plain(strings[int(match.group(1))])
            last = match.end()
        return ids + self.encode(text[last:])

    def _render(self, messages: list[Message], tools: list[dict] | None, *,
                add_generation_prompt: bool) -> tuple[str, list[str]]:
        guarded, strings = self._guarded(messages)
        text = self.text(guarded, tools, add_generation_prompt=add_generation_prompt)
        if strings and len(_MARKERS.findall(text)) != len(strings):
            raise TemplateError(f"chat template {self.template_name!r} changes the content of messages (it dropped or "
                                "repeated part of it), so ctxrl cannot keep special tokens in tool output as plain "
                                "text; use a template that prints message content as it is")
        return text, strings

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- ids -----------------------------------------------------------------------------------
    def prompt_ids(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        """Ids of the initial conversation followed by the assistant generation prompt."""
        return self._encode_marked(*self._render(messages, tools, add_generation_prompt=True))

    def continuation_ids(self, history: list[Message], new: list[Message], tools: list[dict] | None,
                         *, closed: bool = True) -> list[int]:
        """Ids to append after the sampled ids of ``history[-1]`` (an assistant message).

        ``closed`` says whether the sampled ids already end with the end-of-turn token; when the
        model was cut off (max new tokens) the end-of-turn token is added here, as context.
        """
        if not history or history[-1].role != "assistant":
            raise ValueError("continuation_ids expects the history to end with an assistant message")
        before, _ = self._render(history, tools, add_generation_prompt=False)
        after, strings = self._render(history + new, tools, add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError(self._prefix_message())
        end = before.rfind(self.eos_text)
        if end < 0:
            raise TemplateError(f"chat template {self.template_name!r} does not close assistant turns "
                                f"with the eos token {self.eos_text!r}")
        tail = before[end + len(self.eos_text):]
        delta = (self.eos_text if not closed else "") + tail + after[len(before):]
        return self._encode_marked(delta, strings)

    def assistant_ids(self, text: str) -> list[int]:
        """Ids of an assistant turn as if sampled: the text's ids plus the end-of-turn token."""
        return self.encode(text) + [self.eos_id]

    def _prefix_message(self) -> str:
        return (f"chat template {self.template_name!r} is not prefix-preserving for tool conversations: "
                "rendering more messages changes the text of earlier ones, so ctxrl cannot append "
                "new turns without re-tokenizing. Use a template that renders history verbatim "
                "(set model.chat_template to a Jinja file).")

    # -- start-up check --------------------------------------------------------------------------
    def verify_prefix_preserving(self) -> None:
        """Raise ``TemplateError`` unless incremental rendering equals whole rendering."""
        tools = [{"type": "function", "function": {
            "name": "lookup", "description": "Look a key up.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
        convo = [
            Message("system", "You are a careful agent."),
            Message("user", "Find the value of key a."),
            Message("assistant", "Looking it up.\n" + format_tool_call("lookup", {"key": "a"})),
            Message("tool", "b", name="lookup"),
            Message("assistant", format_tool_call("lookup", {"key": "b"})),
            Message("tool", "42", name="lookup"),
            Message("assistant", "The value is 42."),
        ]
        ids = self.prompt_ids(convo[:2], tools)
        for k, message in enumerate(convo[2:], start=2):
            if message.role == "assistant":
                ids += self.assistant_ids(message.content)
                history_end = k + 1
                new = []
                for later in convo[history_end:]:
                    if later.role == "assistant":
                        break
                    new.append(later)
                if new:
                    ids += self.continuation_ids(convo[:history_end], new, tools)
        whole = self.encode(self.text(convo, tools, add_generation_prompt=False))
        # The whole rendering ends with the template's tail after the last eos (e.g. "\n").
        if ids != whole[: len(ids)]:
            raise TemplateError(self._prefix_message() + f" (first mismatch at token {_first_diff(ids, whole)})")
        trailing = self.decode(whole[len(ids):])
        if trailing.strip():
            raise TemplateError(self._prefix_message() + f" (unexpected trailing text {trailing!r})")


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
