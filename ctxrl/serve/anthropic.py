"""Anthropic's Messages API on ``ctxrl serve``: ``POST /v1/messages`` and ``POST /sessions/<id>/v1/messages``.

An agent written with the ``anthropic`` SDK (``Anthropic(base_url="http://HOST:PORT/sessions/<id>")``) is served
and recorded exactly as a Chat Completions client is: a request is translated into the same ``ChatRequest``
(``ctxrl.serve.protocol``), the same ``Server.complete`` renders, samples and records it into the session's
token-faithful episode, and the replies are translated back. Nothing here touches ids.

How the Messages shapes map:

- ``system`` (a string or text blocks) is the system message; ``messages`` alternate ``user`` and ``assistant``,
  their ``content`` a string or blocks;
- an assistant's ``text`` blocks are its content and its ``tool_use`` blocks (``id``, ``name``, ``input``) its tool
  calls; a user message's ``tool_result`` blocks (``tool_use_id``, ``content`` as a string or text blocks) are tool
  messages, in order, followed by the message's text, if any, as a user message;
- ``tools`` (``name``, ``description``, ``input_schema``) are function tools; ``tool_choice`` ``auto`` or ``none``;
- ``max_tokens`` (required), ``temperature`` in [0, 1], ``top_p``, ``top_k``, ``stop_sequences`` (up to four),
  ``stream``, ``metadata`` (read by no one);
- a reply is one ``text`` block (the text without the tool-call markup, when there are calls) and a ``tool_use``
  block per call, ``stop_reason`` ``tool_use``, ``max_tokens``, ``stop_sequence`` (with the sequence) or
  ``end_turn``, and ``usage`` counting the prompt's and the reply's tokens exactly. A streamed reply is the same,
  as Anthropic's events (``message_start``, a ``content_block_start`` / ``_delta`` / ``_stop`` run per block, a
  text block's deltas one sampled token each, ``message_delta``, ``message_stop``), sent once sampled.

Refused with a 400 naming the field (``error.param``, and the field in the message): images, documents and other
non-text blocks, ``thinking`` (the model writes no signed reasoning blocks), server tools (``bash_...``,
``web_search_...``: ctxrl runs no tools of its own here), a forced ``tool_choice`` (``any``, ``tool``: that needs
constrained decoding), and every field of the wrong type or out of range. Errors have Anthropic's body
(``{"type": "error", "error": {"type", "message"}}``, with ``param`` added).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ctxrl.serve.protocol import SEED_RANGE, ChatRequest, Choice, bad, view
from ctxrl.tools.base import TOOL_NAME
from ctxrl.types import Message, ToolCall

MAX_STOPS = 4
"""The most stop sequences a request may name (as for Chat Completions: each is searched in every reply)."""


def _string(value: Any, where: str, *, required: bool = False) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise bad(f"{where} must be a string, got {type(value).__name__}", where)
    return value


def _text_blocks(content: Any, where: str) -> str:
    """A string, or a list of ``text`` blocks, as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of text blocks", where)
    parts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad(f"{where}[{i}]: only text blocks are supported here, got {kind!r}", f"{where}[{i}].type")
        parts.append(_string(block.get("text"), f"{where}[{i}].text", required=True))
    return "".join(parts)


def _assistant(content: Any, where: str) -> Message:
    """An assistant turn: its text blocks joined, its ``tool_use`` blocks as calls."""
    if isinstance(content, str):
        return Message("assistant", content)
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of blocks", where)
    texts, calls = [], []
    for i, block in enumerate(content):
        at = f"{where}[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_string(block.get("text"), f"{at}.text", required=True))
        elif kind == "tool_use":
            _string(block.get("id"), f"{at}.id", required=True)
            name = _string(block.get("name"), f"{at}.name", required=True)
            if not isinstance(block.get("input"), dict):
                raise bad(f"{at}.input must be a JSON object (the call's arguments)", f"{at}.input")
            calls.append(ToolCall(name, block["input"], block["id"]))
        else:
            shown = kind if isinstance(block, dict) else type(block).__name__
            raise bad(f"{at}: an assistant's blocks are text and tool_use here, got {shown!r}", f"{at}.type")
    return Message("assistant", "".join(texts), tool_calls=calls)


def _user(content: Any, where: str, names: dict[str, str]) -> list[Message]:
    """A user turn: a tool message per ``tool_result`` block, then its text (if any) as a user message."""
    if isinstance(content, str):
        return [Message("user", content)]
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of blocks", where)
    results, texts = [], []
    for i, block in enumerate(content):
        at = f"{where}[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_string(block.get("text"), f"{at}.text", required=True))
        elif kind == "tool_result":
            call_id = _string(block.get("tool_use_id"), f"{at}.tool_use_id", required=True)
            result = block.get("content", "")
            text = _text_blocks(result, f"{at}.content")
            if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
                raise bad(f"{at}.is_error must be true or false", f"{at}.is_error")
            results.append(Message("tool", text, name=names.get(call_id), tool_call_id=call_id))
        else:
            shown = kind if isinstance(block, dict) else type(block).__name__
            raise bad(f"{at}: only text and tool_result blocks are supported in a user turn, got {shown!r}",
                      f"{at}.type")
    return results + ([Message("user", "".join(texts))] if texts or not results else [])


def _tools(raw: Any) -> list[dict] | None:
    """Anthropic's tools as Chat Completions' function tools (what the renderer and the session compare)."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad("tools must be a list", "tools")
    tools = []
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"{at} must be an object", at)
        if tool.get("type") not in (None, "custom"):
            raise bad(f"{at}.type {str(tool['type'])[:60]!r} is a server tool, which ctxrl does not run; declare a "
                      "client tool (name, description, input_schema)", f"{at}.type")
        name = _string(tool.get("name"), f"{at}.name", required=True)
        if not TOOL_NAME.match(name):  # (a name is written into the prompt: no special tokens, no markup)
            raise bad(f"{at}.name {name[:80]!r} must be 1-64 letters, digits, _ or -", f"{at}.name")
        description = _string(tool.get("description"), f"{at}.description")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad(f"{at}.input_schema must be a JSON schema object", f"{at}.input_schema")
        # (the order Tool.schema() writes: a chat template renders the tools as JSON, so it shows in the prompt)
        function = {"name": name, **({"description": description} if description is not None else {}),
                    "parameters": schema}
        tools.append({"type": "function", "function": function})
    return tools


def parse_request(body: Any, *, max_total_tokens: int) -> ChatRequest:
    """A Messages request checked field by field, as a ``ChatRequest`` (see the module docstring)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required (a string)", "model")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise bad("max_tokens is required: a whole number of tokens", "max_tokens")
    if not 1 <= max_tokens <= max_total_tokens:
        raise bad(f"max_tokens must be in [1, {max_total_tokens}] (this model's context is {max_total_tokens} "
                  "tokens)", "max_tokens")
    messages: list[Message] = []
    if body.get("system") is not None:
        messages.append(Message("system", _text_blocks(body["system"], "system")))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list", "messages")
    names: dict[str, str] = {}
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            role = m.get("role") if isinstance(m, dict) else None
            raise bad(f"{where}.role must be 'user' or 'assistant', got {role!r}", f"{where}.role")
        if m["role"] == "assistant":
            message = _assistant(m.get("content"), f"{where}.content")
            names.update((c.id, c.name) for c in message.tool_calls if c.id)
            messages.append(message)
        else:
            messages.extend(_user(m.get("content"), f"{where}.content", names))
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if choice is not None and kind not in ("auto", "none"):
        raise bad("tool_choice must be {\"type\": \"auto\"} or {\"type\": \"none\"}: a forced tool call needs "
                  "constrained decoding, which ctxrl does not do", "tool_choice")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise bad("thinking is not supported: the model writes no signed thinking blocks", "thinking")
    temperature = _number(body, "temperature", 1.0, 0.0, 1.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad("top_p must be > 0", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= SEED_RANGE[1]):
        raise bad("top_k must be a whole number >= 0", "top_k")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or len(stops) > MAX_STOPS
                              or not all(isinstance(s, str) and s for s in stops)):
        raise bad(f"stop_sequences must be a list of up to {MAX_STOPS} non-empty strings", "stop_sequences")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad("metadata must be an object", "metadata")
    views = [view(m.role, m.content, m.tool_calls, m.tool_call_id) for m in messages]
    return ChatRequest(model=model, messages=messages, views=views, tools=_tools(body.get("tools")),
                       tool_choice=kind or "auto", temperature=temperature, top_p=top_p, top_k=top_k or 0,
                       max_tokens=max_tokens, stop=tuple(stops or ()), stream=bool(stream))


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"{key} must be a number, got {type(value).__name__}", key)
    if not low <= value <= high:
        raise bad(f"{key} must be in [{low}, {high}], got {str(value)[:40]}", key)
    return float(value)


# -- replies -------------------------------------------------------------------------------------------------------
def stop_reason(choice: Choice) -> str:
    if choice.tool_calls:
        return "tool_use"
    if choice.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if choice.stop_sequence is not None else "end_turn"


def blocks(choice: Choice, message_id: str) -> list[dict]:
    """The reply's content blocks: its text (when it has any), then a ``tool_use`` block per call."""
    out = [{"type": "text", "text": choice.content}] if choice.content else []
    out += [{"type": "tool_use", "id": call.id or f"toolu_{message_id[-12:]}_{i}", "name": call.name,
             "input": call.arguments} for i, call in enumerate(choice.tool_calls)]
    return out


def _usage(prompt_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


def message_json(model: str, choice: Choice, prompt_tokens: int, message_id: str) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": blocks(choice, message_id), "stop_reason": stop_reason(choice),
            "stop_sequence": choice.stop_sequence, "usage": _usage(prompt_tokens, choice.completion_tokens)}


def stream_events(model: str, choice: Choice, prompt_tokens: int, message_id: str) -> list[tuple[str, dict]]:
    """``(event, data)`` pairs of a streamed reply (see the module docstring)."""
    start = {**message_json(model, choice, prompt_tokens, message_id), "content": [], "stop_reason": None,
             "stop_sequence": None, "usage": _usage(prompt_tokens, 1)}
    events = [("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(blocks(choice, message_id)):
        if block["type"] == "text":
            events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": {"type": "text", "text": ""}}))
            texts = [block["text"]] if choice.tool_calls or not choice.token_texts else [
                t for t in choice.token_texts if t]  # token by token, as sampled
            events += [("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "text_delta", "text": t}}) for t in texts]
        else:
            events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": {**block, "input": {}}}))
            events.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    events.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason(choice),
                                                                        "stop_sequence": choice.stop_sequence},
                                     "usage": {"output_tokens": choice.completion_tokens}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def sse(events: list[tuple[str, dict]]):
    """Server-sent events as Anthropic's and OpenAI's Responses clients read them (``event:`` then ``data:``)."""

    async def stream():
        for name, data in events:
            yield f"event: {name}\ndata: {json.dumps(data)}\n\n"

    return stream()


async def _messages(server, request: Request, session_id: str | None):
    body = await server.body(request)
    parsed = await asyncio.to_thread(parse_request, body, max_total_tokens=server.max_total_tokens)
    client = tuple(request.client) if request.client else "in-process"
    choices, prompt_tokens = await server.complete(parsed, session_id, client)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    headers = {"x-ctxrl-session": session_id or "none"}
    if parsed.stream:
        events = stream_events(parsed.model, choices[0], prompt_tokens, message_id)
        return StreamingResponse(sse(events), media_type="text/event-stream", headers=headers)
    return JSONResponse(message_json(parsed.model, choices[0], prompt_tokens, message_id), headers=headers)


def add_routes(app: FastAPI, server) -> None:
    """``POST /v1/messages`` (not recorded) and ``POST /sessions/<id>/v1/messages`` (recorded into that session)."""

    @app.post("/v1/messages")
    async def plain(request: Request):
        return await _messages(server, request, None)

    @app.post("/sessions/{session_id}/v1/messages")
    async def in_session(session_id: str, request: Request):
        return await _messages(server, request, session_id)
