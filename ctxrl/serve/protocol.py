"""The OpenAI Chat Completions wire format: requests in, responses and stream chunks out, errors.

Only what ctxrl can honour is accepted; everything else is a 400 that names the field, so a
harness never silently gets something other than what it asked for:

- ``messages`` with roles ``system``, ``user``, ``assistant`` (text and/or ``tool_calls``) and
  ``tool``; content as a string or a list of ``text`` parts;
- ``tools`` of ``type: function``; ``tool_choice`` ``auto`` (the default) or ``none`` (the reply's
  calls are left in its text); a forced tool choice needs constrained decoding, which ctxrl does
  not do;
- ``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``n``,
  ``seed``, ``logprobs`` (``top_logprobs`` 0: the engine reports the sampled token's alone),
  ``stream`` with ``stream_options.include_usage``.

Every field ctxrl reads is checked for its type and range here, before anything is rendered, so
that a client's mistake is its own 400 and never an error inside ctxrl: an id that is an object,
a ``max_tokens`` past the model's context, a seed past 64 bits. (Fields ctxrl does not read, such
as ``user`` or ``metadata``, are left alone; NaN and infinite numbers never get this far:
``ctxrl.serve.server.parse_body`` refuses them.)
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ctxrl.chat.surrogates import find_surrogate
from ctxrl.tools.base import TOOL_NAME
from ctxrl.types import Message, ToolCall

ROLES = ("system", "user", "assistant", "tool", "developer")


class APIError(Exception):
    """An OpenAI-style error: HTTP ``status`` and the body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body."""

    model: str
    messages: list[Message]
    views: list[tuple]
    """Each message as the client sent it, normalised (``view``): what a session compares its history with."""
    tools: list[dict] | None
    tool_choice: str = "auto"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k cut (Chat Completions has none; Anthropic's Messages may ask for one)."""
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}.content[{i}]: only text parts are supported, got {kind!r}", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _tool_calls(raw: Any, where: str) -> list[ToolCall]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    calls = []
    for i, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{where}.tool_calls[{i}] needs function.name, a string", f"{where}.tool_calls")
        if call.get("type", "function") != "function":
            raise bad(f"{where}.tool_calls[{i}].type must be 'function'", f"{where}.tool_calls")
        _string_or_none(call.get("id"), f"{where}.tool_calls[{i}].id")
        args, field = fn.get("arguments", "{}"), f"{where}.tool_calls[{i}].function.arguments"
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as exc:
            raise bad(f"{field} is not JSON: {exc}", f"{where}.tool_calls") from None
        except RecursionError:
            raise bad(f"{field} nests too deeply to read", f"{where}.tool_calls") from None
        if not isinstance(parsed, dict):
            raise bad(f"{field} must be a JSON object", f"{where}.tool_calls")
        if find_surrogate(parsed) is not None:  # (an escape inside the arguments' own JSON text)
            raise bad(f"{field} holds a lone surrogate (a \\ud800-\\udfff escape without its pair), which is not "
                      "text; send valid Unicode", field)
        calls.append(ToolCall(fn["name"], parsed, call.get("id")))
    return calls


def _string_or_none(value: Any, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise bad(f"{where} must be a string, got {type(value).__name__}", where)
    return value


def view(role: str, content: str, calls: list[ToolCall], tool_call_id: str | None) -> tuple:
    """A message as compared across calls: what the client sees (ids of calls ignored: clients may rewrite them)."""
    return (role, content, tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in calls),
            tool_call_id if role == "tool" else None)


def parse_messages(raw: Any) -> tuple[list[Message], list[tuple]]:
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list", "messages")
    messages, views, names = [], [], {}
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        role = "system" if role == "developer" else role
        content = _text(m.get("content"), where)
        calls = _tool_calls(m.get("tool_calls"), where) if role == "assistant" else []
        for call in calls:
            if call.id:
                names[call.id] = call.name
        tool_call_id = _string_or_none(m.get("tool_call_id"), f"{where}.tool_call_id") if role == "tool" else None
        name = _string_or_none(m.get("name"), f"{where}.name")
        name = name or (names.get(tool_call_id) if tool_call_id else None) if role == "tool" else None
        messages.append(Message(role, content, tool_calls=calls, name=name, tool_call_id=tool_call_id))
        views.append(view(role, content, calls, tool_call_id))
    return messages, views


def parse_tools(raw: Any) -> list[dict] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad("tools must be a list", "tools")
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict) \
                or not isinstance(tool["function"].get("name"), str) or not tool["function"]["name"]:
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        fn = tool["function"]
        if not TOOL_NAME.match(fn["name"]):  # (a name is written into the prompt: no special tokens, no markup)
            raise bad(f"tools[{i}].function.name {fn['name'][:80]!r} must be 1-64 letters, digits, _ or -",
                      f"tools[{i}].function.name")
        _string_or_none(fn.get("description"), f"tools[{i}].function.description")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters")
    return raw


SEED_RANGE = (-(1 << 63), (1 << 63) - 1)


def parse_request(body: Any, *, max_total_tokens: int) -> ChatRequest:
    """``body`` checked field by field; ``max_tokens`` may not pass ``max_total_tokens`` (the model's context)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required", "model")
    messages, views = parse_messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise bad("tool_choice must be 'auto' or 'none': a forced tool call needs constrained decoding, "
                  "which ctxrl does not do", "tool_choice", "unsupported_value")

    def number(key: str, default, kind, low, high, why: str = ""):
        value = body.get(key)
        if value is None:
            return default
        wrong_kind = kind is int and not isinstance(value, int)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or wrong_kind:
            raise bad(f"{key} must be a{'n integer' if kind is int else ' number'}, got {type(value).__name__}", key)
        if not low <= value <= high:  # (an integer too large for a float is compared exactly, never converted)
            shown = value if len(str(value)) <= 40 else f"{str(value)[:20]}... ({len(str(value))} digits)"
            raise bad(f"{key} must be in [{low}, {high}]{why}, got {shown}", key)
        return kind(value)

    def flag(key: str) -> bool:
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            raise bad(f"{key} must be true or false, got {type(value).__name__}", key)
        return bool(value)

    temperature = number("temperature", 1.0, float, 0.0, 2.0)
    top_p = number("top_p", 1.0, float, 0.0, 1.0)
    if top_p == 0.0:
        raise bad("top_p must be > 0", "top_p")
    context = f" (this model's context is {max_total_tokens} tokens)"
    max_tokens = (number("max_completion_tokens", None, int, 1, max_total_tokens, context)
                  or number("max_tokens", None, int, 1, max_total_tokens, context))
    n = number("n", 1, int, 1, 16)
    seed = number("seed", None, int, *SEED_RANGE)
    stop = body.get("stop")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else (
        tuple(stop) if isinstance(stop, list) else None)
    if stops is None or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise bad("stop must be a non-empty string or a list of up to 4 of them", "stop")
    top_logprobs = body.get("top_logprobs")
    if top_logprobs not in (None, 0):
        raise bad("top_logprobs is not supported: the engine reports the sampled token's log-prob alone",
                  "top_logprobs", "unsupported_value")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    include_usage = (options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad("stream_options.include_usage must be true or false", "stream_options.include_usage")
    return ChatRequest(model=model, messages=messages, views=views, tools=tools, tool_choice=choice or "auto",
                       temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop=stops, n=n, seed=seed,
                       logprobs=flag("logprobs"), stream=flag("stream"), include_usage=bool(include_usage))


# -- responses ------------------------------------------------------------------------------------------
@dataclass
class Choice:
    """One sampled reply, ready to send."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    token_texts: list[str]
    logprobs: list[float]
    completion_tokens: int
    stop_sequence: str | None = None
    """The client's stop string that ended the reply (its text ends before it), if one did."""


def call_json(calls: list[ToolCall], prefix: str) -> list[dict]:
    return [{"id": c.id or f"call_{prefix}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for i, c in enumerate(calls)]


def _logprobs(choice: Choice) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(choice.token_texts, choice.logprobs)], "refusal": None}


def completion_json(request: ChatRequest, model: str, choices: list[Choice], prompt_tokens: int,
                    response_id: str) -> dict:
    out = []
    for index, choice in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": choice.content, "refusal": None}
        if choice.tool_calls:
            message["tool_calls"] = call_json(choice.tool_calls, f"{response_id[-8:]}_{index}")
        out.append({"index": index, "message": message, "finish_reason": choice.finish_reason,
                    "logprobs": _logprobs(choice) if request.logprobs else None})
    completion_tokens = sum(c.completion_tokens for c in choices)
    return {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                      "total_tokens": prompt_tokens + completion_tokens},
            "system_fingerprint": None}


def stream_chunks(request: ChatRequest, model: str, choices: list[Choice], prompt_tokens: int,
                  response_id: str) -> list[dict]:
    """The chunks of a streamed reply: a role delta, one delta per sampled token, the calls, the finish."""
    created, chunks = int(time.time()), []

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": None,
                "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

    for index, choice in enumerate(choices):
        chunks.append(chunk(index, {"role": "assistant", "content": ""}))
        if choice.content:
            if choice.tool_calls or not choice.token_texts:
                chunks.append(chunk(index, {"content": choice.content}))
            else:  # token by token, as sampled (the end-of-turn token is not text)
                for text, lp in zip(choice.token_texts, choice.logprobs):
                    if not text:
                        continue
                    lps = {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode()),
                                        "top_logprobs": []}], "refusal": None} if request.logprobs else None
                    chunks.append(chunk(index, {"content": text}, logprobs=lps))
        for i, call in enumerate(call_json(choice.tool_calls, f"{response_id[-8:]}_{index}")):
            chunks.append(chunk(index, {"tool_calls": [{"index": i, **call}]}))
        chunks.append(chunk(index, {}, choice.finish_reason))
    if request.include_usage:
        completion_tokens = sum(c.completion_tokens for c in choices)
        chunks.append({"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                                "total_tokens": prompt_tokens + completion_tokens}})
    return chunks


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"
