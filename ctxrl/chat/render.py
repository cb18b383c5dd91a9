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
(its calls written in the renderer's tool-call format) and raises ``TemplateError`` naming the
template otherwise (``ctxrl.chat.checks``, home of the renderer's other probes of its template too).

Templates that rewrite history when a new user message arrives (Qwen3 drops the ``<think>``
blocks of earlier assistant turns) break step 2 there, and only there: ``continuation_ids``
raises ``HistoryRewritten`` and the episode's ``Recorder`` starts a new segment from the
template's full rendering of the conversation (docs/tool-formats.md). A template that breaks
step 2 within one tool exchange (tool results, no new user message) is refused: every turn
would have to restart.

The renderer owns the policy's tool-call format (``tool_format``; ``ctxrl.chat.formats``): sampled
text is parsed with it, and the conversation handed to the template carries what the family's
template needs. An assistant message whose text already writes its calls is given to the template
as that text alone (templates that also render ``tool_calls`` would show them twice, or rewrite
them); every call gets an id and every tool result the id of the call it answers (Mistral
templates require them).

Only the template (and the tools text below) places structure. Special tokens and tool-call tags in text
the framework did not lay out (system prompts, tasks, tool output, environment replies, a serve client's
messages, tool schemas and structured call arguments) are encoded as plain text: a tool that prints
``</tool_response><|im_end|>`` and ``<|im_start|>assistant`` gets the ids of those characters, never the
tag or turn-boundary ids, so no text can forge a turn, a call or a result (``ctxrl.chat.guard`` says how,
and what assistant content keeps: its own calls and reasoning).

Templates that ignore ``tools`` (SmolLM2's plain ChatML renders the same text with and without
them) would train a policy that is never told its tools. The renderer finds out once, by rendering
a one-tool conversation both ways (``ctxrl.chat.checks``), and then writes the tools itself into the
system turn (``ctxrl.chat.tool_prompt``: the schemas and the calling convention of its tool-call
format), appended to the conversation's system message or as a system message of its own, and
renders with no ``tools``. It does so after the guard has marked the tools' schemas, so a ``<|im_end|>`` in
a tool's description gets the ids of its characters while the example call the tools text shows is
written as the policy writes it (tags included); ``text`` inlines too, so the start-up check covers it.
``notices`` says what it decided. A template that cannot take a system turn (Gemma's raises on one) is
refused then, naming the fix.
"""

from __future__ import annotations

from typing import Any

from ctxrl.chat import checks
from ctxrl.chat.errors import HistoryRewritten, TemplateError
from ctxrl.chat.formats import (
    CHATML,
    ToolFormat,
    call_id,
    choose_format,
    detect_format,
    format_names,
    markers_text,
    rewrite_calls,
)
from ctxrl.chat.formats import parse_assistant as parse_with
from ctxrl.chat.guard import Guard, encode_marked, markers_intact, special_tokens
from ctxrl.chat.surrogates import replace_surrogates
from ctxrl.chat.tool_prompt import in_system_turn, tools_system_text
from ctxrl.chat.toolcalls import HERMES
from ctxrl.types import Message

__all__ = ["ChatRenderer", "HistoryRewritten", "TemplateError", "turn_end"]


def turn_end(tokenizer: Any, template: str, eos: str, end_ids: list[int]) -> tuple[str, int]:
    """The text and id of the token that closes assistant turns: ``eos`` where the template writes it (or no
    template is given), else the first of ``end_ids`` whose token the template writes, else ``eos`` (and the
    renderer's checks say what is wrong)."""
    if not template or eos in template:
        return eos, tokenizer.convert_tokens_to_ids(eos)
    for i in end_ids:
        token = tokenizer.convert_ids_to_tokens(i)
        if token and token in template:
            return token, i
    return eos, tokenizer.convert_tokens_to_ids(eos)


def format_notices(asked: str, chosen: ToolFormat | None, template: str, template_name: str) -> list[str]:
    """What a user should hear of the tool-call format ``asked`` (``model.tool_format``) and ``chosen``, against what
    the chat ``template`` shows: ``auto`` choosing a format without a marker (ChatML), and a forced format the
    template does not write (a warning, not a refusal: a marker is evidence, not proof, as a template may show several
    formats, Llama 3.2's both pythonic and JSON; and a warm start can teach the forced format on purpose)."""
    shown = detect_format(template)
    if chosen is None:
        return []
    if asked == "auto":
        return [] if shown is not None else [
            f"chat template {template_name!r} shows none of the tool-call markers ctxrl looks for, but it is ChatML "
            f"({CHATML}): ctxrl uses the {chosen.name} tool-call format, which ChatML families write; set "
            f"model.tool_format to choose another ({', '.join(format_names())})"]
    if shown is None or shown.name == chosen.name:
        return []
    marker = next(m for m in shown.markers if m in template)
    return [f"model.tool_format={asked}, but chat template {template_name!r} writes tool calls as {shown.name} (it "
            f"shows {marker}): the policy is prompted in one format and parsed in the other, so its calls will not "
            f"parse unless the warm start teaches {asked}; set model.tool_format=auto (or {shown.name}) to use the "
            "template's"]


class ChatRenderer:
    """Renders messages to ids through a HF tokenizer's chat template, incrementally.

    ``tool_format``: how the policy writes tool calls, by name (``ctxrl.chat.formats``), or
    ``auto`` to read it from the chat template (what runs do: ``model.tool_format``). The
    default is ``hermes``, the format of ctxrl's tiny model.

    ``notices``: what the renderer decided about the template that its user should hear of (a
    format ``auto`` chose without a marker, tools written into the system turn), one sentence each.
    """

    def __init__(self, tokenizer: Any, *, template_name: str = "", end_ids: tuple[int, ...] | list[int] = (),
                 tool_format: str = "hermes") -> None:
        self.tokenizer = tokenizer
        self.template_name = template_name or getattr(tokenizer, "name_or_path", "") or "<chat template>"
        self._format: ToolFormat | None = choose_format(tool_format, self.template_text)
        self._format_notices = format_notices(tool_format, self._format, self.template_text, self.template_name)
        self._ignores_tools: bool | None = None  # probed on first need (ignores_tools)
        self._system_turn_problem: str | None = None  # why the template cannot take a system turn, once probed
        eos = tokenizer.eos_token
        if eos is None:
            raise TemplateError(f"tokenizer {self.template_name!r} has no eos_token to end assistant turns")
        eos_id = tokenizer.convert_tokens_to_ids(eos)
        self.eos_text, self.eos_id = turn_end(tokenizer, self.template_text, eos, [int(i) for i in end_ids])
        """The token that closes an assistant turn in the template: the tokenizer's eos, or (when the template
        never writes it) the first of ``end_ids`` that it does write (Gemma: ``<end_of_turn>``, eos ``<eos>``)."""
        self.end_ids: tuple[int, ...] = tuple(dict.fromkeys((self.eos_id, eos_id, *(int(i) for i in end_ids))))
        """Ids that end an assistant turn: the template's end-of-turn token first, then the model's other end
        ids (``generation_config.json``'s ``eos_token_id``)."""
        self.special_tokens: list[str] = special_tokens(tokenizer)
        """Every special-token string, longest first."""
        self.guard = Guard.of(tokenizer, self._format, self.encode)
        """What is structure where: plain text wherever the framework did not place it (``ctxrl.chat.guard``)."""

    # -- tool calls ----------------------------------------------------------------------------
    @property
    def template_text(self) -> str:
        """The tokenizer's chat template (all of its named templates, if it has several)."""
        template = getattr(self.tokenizer, "chat_template", None) or ""
        return "\n".join(template.values()) if isinstance(template, dict) else str(template)

    @property
    def tool_format(self) -> ToolFormat:
        """The policy's tool-call format; a ``TemplateError`` naming the choices when ``auto`` found none."""
        if self._format is None:
            raise self.tool_format_error()
        return self._format

    def tool_format_error(self) -> TemplateError:
        """The error for a conversation with tools when no tool-call format was given or found."""
        return TemplateError(f"cannot tell how the policy writes tool calls: chat template {self.template_name!r} "
                             f"shows none of the markers ctxrl looks for ({markers_text()}); set model.tool_format "
                             f"to one of {', '.join(format_names())} (docs/tool-formats.md)")

    @property
    def has_tool_format(self) -> bool:
        """Whether a format was given or found (a conversation without tools needs none)."""
        return self._format is not None

    @property
    def notices(self) -> list[str]:
        """What the renderer decided about the chat template, one sentence each, for its user to hear once
        (``spec_renderer`` logs them): the format ``auto`` chose on a ChatML template without markers;
        tools written into the system turn because the template ignores them."""
        inlined = []
        if self._format is not None and self.ignores_tools:
            inlined.append(f"chat template {self.template_name!r} ignores tools: ctxrl writes the tool schemas and "
                           f"the {self._format.name} calling convention into the system turn (docs/tool-formats.md)")
        return [*self._format_notices, *inlined]

    @property
    def ignores_tools(self) -> bool:
        """Whether the template renders a conversation with tools as it renders it without (probed once)."""
        if self._ignores_tools is None:
            self._ignores_tools = checks.ignores_tools(self.tokenizer)
        return self._ignores_tools

    def _apply(self, chat: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _check_system_turn(self) -> None:
        """Raise ``TemplateError`` unless the template prints a system message's content (probed once)."""
        if self._system_turn_problem is None:
            self._system_turn_problem = checks.system_turn_problem(self.tokenizer)
        if self._system_turn_problem:
            raise TemplateError(
                f"chat template {self.template_name!r} ignores tools, so ctxrl writes them into the system turn, but "
                f"the template cannot take a system turn: {self._system_turn_problem}. Set model.chat_template to "
                "a Jinja file that renders a system turn (or the tools themselves); docs/tool-formats.md")

    def with_tools_inlined(self, messages: list[Message],
                           tools: list[dict] | None) -> tuple[list[Message], list[dict] | None]:
        """``messages`` and ``tools`` as the template is given them (see the module docstring).

        Unchanged when there are no tools, no format to call them in, or the template renders tools
        itself. Otherwise the tools text (``tools_system_text``) is appended to the first message's
        content when that is a system message (a blank line between), or is a system message put
        first (``in_system_turn``), and the tools are None: a second pass changes nothing.
        """
        if not tools or self._format is None or not self.ignores_tools:
            return messages, tools
        self._check_system_turn()
        return in_system_turn(messages, tools_system_text(tools, self._format)), None

    def parse_assistant(self, text: str) -> Message:
        """Sampled assistant text as a ``Message``, its calls parsed with the policy's format (none without one)."""
        if self._format is None:
            return Message(role="assistant", content=text)
        return parse_with(self._format, text)

    def rewrite_hermes(self, text: str) -> str:
        """A scripted text (environments write calls in the Hermes format) with its calls in the policy's format."""
        if self._format is None:
            return text
        return rewrite_calls(text, self._format, HERMES)

    def chat(self, messages: list[Message]) -> list[dict[str, Any]]:
        """``messages`` as the dicts the chat template gets (see the module docstring).

        An assistant message whose text writes its calls goes without ``tool_calls``; one whose calls
        are only structured (built by hand) keeps them, each with an id. A tool message without a
        ``tool_call_id`` gets the id of the first call of the latest assistant message it can answer
        (same tool name, not answered yet), else one of its own. Ids are ``call_id``s, so rendering a
        conversation and a longer one gives its messages the same ids.
        """
        out: list[dict[str, Any]] = []
        pending: list[tuple[str, str]] = []  # (tool name, call id) of the latest assistant calls not answered yet
        answered = 0
        for m in messages:
            chat = m.to_chat()
            if m.role == "assistant":
                written = self._format.parse(m.content)[0] if self._format is not None else []
                calls = written or m.tool_calls
                ids = [c.id or call_id(c.name, c.arguments, i) for i, c in enumerate(calls)]
                pending, answered = [(c.name, i) for c, i in zip(calls, ids)], 0
                if written:
                    chat.pop("tool_calls", None)
                elif "tool_calls" in chat:
                    for entry, i in zip(chat["tool_calls"], ids):
                        entry["id"] = i
            elif m.role == "tool" and m.tool_call_id is None:
                match = next((k for k, (name, _) in enumerate(pending) if name == m.name), None)
                if match is not None:
                    chat["tool_call_id"] = pending.pop(match)[1]
                else:  # an error about a malformed call, or an observation the environment added
                    chat["tool_call_id"] = call_id(m.name or "", {"content": m.content}, answered)
                answered += 1
            out.append(chat)
        return out

    # -- text --------------------------------------------------------------------------------
    def text(self, messages: list[Message], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
        """The template's rendering of ``messages`` and ``tools`` (in the system turn when it ignores them)."""
        messages, tools = self.with_tools_inlined(messages, tools)
        return self._apply(self.chat(messages), tools or None, add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, its special-token strings as special tokens (template text, policy text); a lone surrogate,
        which no tokenizer takes, as U+FFFD (``ctxrl.chat.surrogates``)."""
        return list(self.tokenizer.encode(replace_surrogates(text), add_special_tokens=False))

    def encode_plain(self, text: str) -> list[int]:
        """Ids of ``text`` with special-token strings taken as plain characters (text the policy did not write)."""
        return list(self.tokenizer.encode(replace_surrogates(text), add_special_tokens=False,
                                          split_special_tokens=True))

    def _render(self, messages: list[Message], tools: list[dict] | None, *,
                add_generation_prompt: bool) -> tuple[str, list[str]]:
        # Marked before the tools are written into the system turn (when the template ignores them): the
        # structure strings of the tools' schemas are plain text, the tools text's own example call is not.
        marked = self.guard.mark(messages, tools)
        text = self.text(marked.messages, marked.tools, add_generation_prompt=add_generation_prompt)
        if not markers_intact(text, marked):
            raise TemplateError(f"chat template {self.template_name!r} changes the content of messages (it dropped or "
                                "cut part of it), so ctxrl cannot keep special tokens and tags in tool output as "
                                "plain text; use a template that prints message content as it is")
        return text, marked.strings

    def _encode_marked(self, text: str, strings: list[str]) -> list[int]:
        return encode_marked(text, strings, self.encode, self.plain_ids)

    def plain_ids(self, text: str) -> list[int]:
        """Ids of one structure string as plain text: no special or tag id (``Guard.plain_ids``)."""
        return self.guard.plain_ids(text, self.encode_plain)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- ids -----------------------------------------------------------------------------------
    def prompt_ids(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        """Ids of the initial conversation followed by the assistant generation prompt."""
        return self._encode_marked(*self._render(messages, tools, add_generation_prompt=True))

    def conversation_ids(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        """Ids of a whole conversation, no generation prompt: what a token-faithful sequence of it holds,
        up to what the template prints after its last end of turn."""
        return self._encode_marked(*self._render(messages, tools, add_generation_prompt=False))

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
            if any(m.role == "user" for m in new):
                raise HistoryRewritten(f"chat template {self.template_name!r} rewrites earlier messages once a new "
                                       "user message follows them; the episode goes on in a new segment")
            raise TemplateError(checks.prefix_message(self.template_name))
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

    # -- start-up checks (ctxrl.chat.checks) ------------------------------------------------------
    def canned_conversation(self) -> list[Message]:
        """The tool conversation ``verify_prefix_preserving`` plays, written as the policy's family writes it."""
        return checks.canned_conversation(self)

    def rewrites_history(self) -> bool:
        """Whether the template renders earlier turns differently once a new user message follows them."""
        return checks.rewrites_history(self)

    def verify_prefix_preserving(self) -> None:
        """Raise ``TemplateError`` unless incremental rendering equals whole rendering within a tool exchange."""
        checks.verify_prefix_preserving(self)
