"""OpenAI's Responses API on ``ctxrl serve``: ``POST /v1/responses`` and ``POST /sessions/<id>/v1/responses``.

An agent written against ``client.responses.create`` (Codex-style harnesses, the OpenAI Agents SDK's default model)
is served and recorded as a Chat Completions client is: the request becomes a ``ChatRequest``
(``ctxrl.serve.protocol``), ``Server.complete`` renders, samples and records it into the session's token-faithful
episode, and the reply is translated back. Nothing here touches ids.

How the Responses shapes map:

- ``instructions`` is the system message (it is not carried over from a previous response, as OpenAI's is not);
  ``input`` is a string (one user message) or a list of items: messages (``role`` ``user``, ``system``,
  ``developer`` or ``assistant``; ``content`` a string or ``input_text`` / ``output_text`` parts), ``function_call``
  items (an assistant's tool calls: consecutive ones, and the assistant message just before them, are one
  assistant turn, as the reply gave them) and ``function_call_output`` items (tool messages);
- ``previous_response_id`` continues a stored response: its input and output items come first, then this request's
  ``input``. Responses are stored (``store``, default true) per session, the last ``MAX_STORED`` of each (a
  session's are dropped with it), so one client cannot continue another session's conversation;
- ``tools`` of ``type: function`` (``name``, ``description``, ``parameters``); ``tool_choice`` ``auto`` or
  ``none``; ``temperature``, ``top_p``, ``max_output_tokens``, ``stream``, ``include`` with
  ``message.output_text.logprobs`` (the sampled token's log-prob alone; ``top_logprobs`` is refused);
- a reply's ``output`` is a ``message`` item (one ``output_text`` part: the text without the tool-call markup) when
  there is text, then a ``function_call`` item per call; ``status`` ``incomplete`` (``max_output_tokens``) when the
  reply ran out of tokens; ``usage`` counts the prompt's and the reply's tokens exactly. Streamed, it is OpenAI's
  events (``response.created`` … ``response.completed``), a text's deltas one sampled token each, sent once sampled.

Refused with a 400 naming the field (``error.param``): images and files, ``reasoning`` items and efforts, built-in
tools (web search, file search, computer use, ...: ctxrl runs none), a forced ``tool_choice`` (``required``, a named
function: that needs constrained decoding), ``text.format`` other than plain text (structured outputs need
constrained decoding), ``background``, ``conversation``, ``truncation: auto``, an unknown or another session's
``previous_response_id``, and every field of the wrong type or out of range.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ctxrl.serve.anthropic import sse
from ctxrl.serve.protocol import APIError, ChatRequest, Choice, _tool_calls, bad, view
from ctxrl.tools.base import TOOL_NAME
from ctxrl.types import Message

MAX_STORED = 256
"""How many responses a session (or the plain routes, together) keeps for ``previous_response_id``."""
LOGPROBS = "message.output_text.logprobs"


@dataclass
class Stored:
    """A stored response: the conversation it ends (without instructions), as the next request continues it."""

    messages: list[Message]


class ResponseStore:
    """Stored responses by (session, id): the last ``MAX_STORED`` of each session."""

    def __init__(self) -> None:
        self.by_session: dict[str | None, OrderedDict[str, Stored]] = {}

    def get(self, session_id: str | None, response_id: str) -> Stored:
        stored = self.by_session.get(session_id, {}).get(response_id)
        if stored is None:
            raise bad(f"no stored response {response_id[:80]!r} in this session (unknown, stored with store=false, "
                      f"or past the last {MAX_STORED})", "previous_response_id")
        return stored

    def put(self, session_id: str | None, response_id: str, stored: Stored, live: set[str]) -> None:
        for sid in [s for s in self.by_session if s is not None and s not in live]:
            del self.by_session[sid]  # (its session closed: its responses go with it)
        kept = self.by_session.setdefault(session_id, OrderedDict())
        kept[response_id] = stored
        while len(kept) > MAX_STORED:
            kept.popitem(last=False)


def _string(value: Any, where: str, *, required: bool = False) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise bad(f"{where} must be a string, got {type(value).__name__}", where)
    return value


def _parts(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content: a string, or a list of text parts of ``kinds``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of text parts", where)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            raise bad(f"{where}[{i}]: only {' and '.join(kinds)} parts are supported here, got {kind!r}",
                      f"{where}[{i}].type")
        texts.append(_string(part.get("text"), f"{where}[{i}].text", required=True))
    return "".join(texts)


def parse_input(raw: Any, names: dict[str, str]) -> list[Message]:
    """``input`` as messages (see the module docstring); ``names`` maps call ids to tool names, across requests."""
    if isinstance(raw, str):
        return [Message("user", raw)]
    if not isinstance(raw, list) or not raw:
        raise bad("input must be a string or a non-empty list of items", "input")
    messages: list[Message] = []
    joinable = False  # whether a function_call item joins the last message (an assistant turn of this input)
    for i, item in enumerate(raw):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{at} must be an object", at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{at}.role must be user, system, developer or assistant, got {str(role)[:40]!r}",
                          f"{at}.role")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = _parts(item.get("content"), f"{at}.content", kinds)
            messages.append(Message("system" if role == "developer" else role, text))
            joinable = role == "assistant"
        elif kind == "function_call":
            call_id = _string(item.get("call_id"), f"{at}.call_id", required=True)
            name = _string(item.get("name"), f"{at}.name", required=True)
            arguments = _string(item.get("arguments"), f"{at}.arguments", required=True)
            try:
                call = _tool_calls([{"id": call_id, "function": {"name": name, "arguments": arguments}}], at)[0]
            except APIError as exc:  # (named as this item's field, not Chat Completions')
                raise bad(exc.message.replace(f"{at}.tool_calls[0].function.arguments", f"{at}.arguments"),
                          f"{at}.arguments") from None
            names[call_id] = name
            if not joinable:
                messages.append(Message("assistant", ""))
            messages[-1].tool_calls.append(call)
            joinable = True
        elif kind == "function_call_output":
            call_id = _string(item.get("call_id"), f"{at}.call_id", required=True)
            output = _parts(item.get("output"), f"{at}.output", ("input_text",))
            messages.append(Message("tool", output, name=names.get(call_id), tool_call_id=call_id))
            joinable = False
        else:
            raise bad(f"{at}.type {str(kind)[:60]!r} is not supported: items are messages, function_call and "
                      "function_call_output", f"{at}.type")
    return messages


def _tools(raw: Any) -> list[dict] | None:
    """Function tools as Chat Completions' (what the renderer shows and the session compares)."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad("tools must be a list", "tools")
    tools = []
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad(f"{at}.type must be 'function' (ctxrl runs no built-in tools), got {str(kind)[:60]!r}",
                      f"{at}.type")
        name = _string(tool.get("name"), f"{at}.name", required=True)
        if not TOOL_NAME.match(name):
            raise bad(f"{at}.name {name[:80]!r} must be 1-64 letters, digits, _ or -", f"{at}.name")
        description = _string(tool.get("description"), f"{at}.description")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad(f"{at}.parameters must be a JSON schema object", f"{at}.parameters")
        function = {"name": name, **({"description": description} if description is not None else {}),
                    **({"parameters": parameters} if parameters is not None else {})}
        tools.append({"type": "function", "function": function})
    return tools


@dataclass
class ResponsesRequest:
    """A validated Responses request: the ``ChatRequest`` to sample, and what the reply echoes."""

    chat: ChatRequest
    body: dict
    previous: str | None
    store: bool
    history: list[Message]
    """The conversation without instructions (the previous response's, then this input): what is stored."""


def parse_request(body: Any, store: ResponseStore, session_id: str | None, *,
                  max_total_tokens: int) -> ResponsesRequest:
    """A Responses request checked field by field (see the module docstring)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required (a string)", "model")
    for key, why in (("background", "a response is answered on its request"),
                     ("conversation", "conversations are not stored; chain with previous_response_id")):
        if body.get(key) not in (None, False):
            raise bad(f"{key} is not supported: {why}", key)
    reasoning = body.get("reasoning")
    if reasoning is not None and not (isinstance(reasoning, dict) and reasoning.get("effort") is None):
        raise bad("reasoning is not supported: the model writes no reasoning items", "reasoning")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("truncation must be 'disabled': a prompt past the context is an error, never cut", "truncation")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and (not isinstance(body["text"], dict) or (
            fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"))):
        raise bad("text.format must be {\"type\": \"text\"}: structured outputs need constrained decoding",
                  "text.format")
    previous = _string(body.get("previous_response_id"), "previous_response_id")
    keep = body.get("store", True)
    if not isinstance(keep, bool):
        raise bad("store must be true or false", "store")
    history = list(store.get(session_id, previous).messages) if previous else []
    names = {c.id: c.name for m in history for c in m.tool_calls if c.id}
    history += parse_input(body.get("input"), names)
    instructions = _string(body.get("instructions"), "instructions")
    messages = ([Message("system", instructions)] if instructions else []) + history
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise bad("tool_choice must be 'auto' or 'none': a forced tool call needs constrained decoding, which ctxrl "
                  "does not do", "tool_choice")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad("include must be a list of strings", "include")
    if body.get("top_logprobs") not in (None, 0):
        raise bad("top_logprobs is not supported: the engine reports the sampled token's log-prob alone",
                  "top_logprobs")
    chat = {"model": model, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_completion_tokens": body.get("max_output_tokens"), "stream": body.get("stream")}
    from ctxrl.serve.protocol import parse_request as parse_chat

    try:  # the numbers and flags are checked as Chat Completions checks them, then named as here
        checked = parse_chat({**chat, "messages": [{"role": "user", "content": ""}]},
                             max_total_tokens=max_total_tokens)
    except APIError as exc:
        if exc.param == "max_completion_tokens":
            raise bad(exc.message.replace("max_completion_tokens", "max_output_tokens"), "max_output_tokens") from None
        raise
    views = [view(m.role, m.content, m.tool_calls, m.tool_call_id) for m in messages]
    request = ChatRequest(model=model, messages=messages, views=views, tools=_tools(body.get("tools")),
                          tool_choice=choice or "auto", temperature=checked.temperature, top_p=checked.top_p,
                          max_tokens=checked.max_tokens, stream=checked.stream, logprobs=LOGPROBS in include)
    return ResponsesRequest(chat=request, body=body, previous=previous, store=keep, history=history)


# -- replies -------------------------------------------------------------------------------------------------------
def output_items(choice: Choice, response_id: str, logprobs: bool) -> list[dict]:
    """The reply as output items: a message (its text), then a function call per tool call."""
    suffix = response_id[-12:]
    items = []
    if choice.content:
        part = {"type": "output_text", "text": choice.content, "annotations": []}
        if logprobs:
            part["logprobs"] = [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(choice.token_texts, choice.logprobs)]
        items.append({"type": "message", "id": f"msg_{suffix}", "status": "completed", "role": "assistant",
                      "content": [part]})
    items += [{"type": "function_call", "id": f"fc_{suffix}_{i}", "call_id": call.id or f"call_{suffix}_{i}",
               "name": call.name, "arguments": json.dumps(call.arguments), "status": "completed"}
              for i, call in enumerate(choice.tool_calls)]
    return items


def response_json(parsed: ResponsesRequest, choice: Choice, prompt_tokens: int, response_id: str,
                  created: int) -> dict:
    body, chat = parsed.body, parsed.chat
    incomplete = choice.finish_reason == "length" and not choice.tool_calls
    return {"id": response_id, "object": "response", "created_at": created,
            "status": "incomplete" if incomplete else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": chat.model, "output": output_items(choice, response_id, chat.logprobs),
            "parallel_tool_calls": True, "previous_response_id": parsed.previous, "store": parsed.store,
            "temperature": chat.temperature, "top_p": chat.top_p, "tool_choice": chat.tool_choice,
            "tools": body.get("tools") or [], "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": body.get("metadata") or {},
            "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": choice.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt_tokens + choice.completion_tokens}}


def stream_events(response: dict, choice: Choice) -> list[tuple[str, dict]]:
    """The events of a streamed reply: created, in progress, each output item's run, completed."""
    events: list[tuple[str, dict]] = []

    def event(kind: str, **data) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **data}))

    started = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    event("response.created", response=started)
    event("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            event("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                          "content": []})
            event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                  part={"type": "output_text", "text": "", "annotations": []})
            pieces = [(t, lp) for t, lp in zip(choice.token_texts, choice.logprobs) if t] if (
                choice.token_texts and not choice.tool_calls) else [(part["text"], None)]
            for text, lp in pieces:  # token by token, as sampled
                logprobs = [{"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}] if (
                    "logprobs" in part and lp is not None) else []
                event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                      delta=text, logprobs=logprobs)
            event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                  text=part["text"], logprobs=part.get("logprobs", []))
            event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        else:
            event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                          "status": "in_progress"})
            event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                  delta=item["arguments"])
            event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                  name=item["name"], arguments=item["arguments"])
        event("response.output_item.done", output_index=index, item=item)
    event("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)
    return events


def _stored(parsed: ResponsesRequest, choice: Choice, response: dict) -> Stored:
    """The conversation this response ends, as a next request's items would give it (``parse_input``)."""
    items = [{k: v for k, v in item.items() if k in ("type", "role", "content", "call_id", "name", "arguments")}
             for item in response["output"]]
    return Stored(parsed.history + (parse_input(items, {}) if items else [Message("assistant", "")]))


async def _responses(server, request: Request, session_id: str | None):
    if session_id is not None:
        server.check_session_id(session_id)
    store: ResponseStore = server.responses
    body = await server.body(request)
    parsed = await asyncio.to_thread(parse_request, body, store, session_id,
                                     max_total_tokens=server.max_total_tokens)
    client = tuple(request.client) if request.client else "in-process"
    choices, prompt_tokens = await server.complete(parsed.chat, session_id, client)
    response_id = f"resp_{uuid.uuid4().hex[:24]}"
    response = response_json(parsed, choices[0], prompt_tokens, response_id, int(time.time()))
    if parsed.store:
        store.put(session_id, response_id, _stored(parsed, choices[0], response), set(server.store.sessions))
    headers = {"x-ctxrl-session": session_id or "none"}
    if parsed.chat.stream:
        return StreamingResponse(sse(stream_events(response, choices[0])), media_type="text/event-stream",
                                 headers=headers)
    return JSONResponse(response, headers=headers)


def add_routes(app: FastAPI, server) -> None:
    """``POST /v1/responses`` (not recorded) and ``POST /sessions/<id>/v1/responses`` (recorded into that session)."""
    server.responses = getattr(server, "responses", None) or ResponseStore()

    @app.post("/v1/responses")
    async def plain(request: Request):
        return await _responses(server, request, None)

    @app.post("/sessions/{session_id}/v1/responses")
    async def in_session(session_id: str, request: Request):
        return await _responses(server, request, session_id)
