"""ctxrl's built-in tools served as an MCP server (``ctxrl mcp-serve``): the other direction of ``ctxrl.tools.mcp``.

Any MCP client (an IDE's agent, another framework, a ctxrl run through ``env.mcp_servers``) can then call the
sandboxed ``python`` tool or the ``calculator`` as ctxrl's policies do: the same schema, the same observation
text, the same deadline. Over stdio (the default: a client starts ``ctxrl mcp-serve`` itself) or streamable HTTP
(``--port``; at ``http://HOST:PORT/mcp``).

A call runs through ``execute_tool_calls``, so what the client reads is what ctxrl's agent loop would show a
model: an unknown tool, arguments that break the schema, a tool that raises or passes its deadline are each an
``isError`` result whose text is that observation (less its ``Error: ``), never a protocol error.

Built on the SDK's low-level ``Server``, not ``MCPServer``, which derives a schema from a Python signature: a
ctxrl tool's schema is given, and is served exactly. What it does not do: authentication (serve HTTP on loopback,
or behind a proxy that checks), resources or prompts.
"""

from __future__ import annotations

from typing import Any

from ctxrl.tools.base import Tool, execute_tool_calls
from ctxrl.types import Message, ToolCall


def tool_server(tools: list[Tool], name: str = "ctxrl") -> Any:
    """An MCP ``Server`` listing ``tools`` and answering their calls (see the module docstring)."""
    import mcp_types as types
    from mcp.server import Server

    by_name = {tool.name: tool for tool in tools}

    async def list_tools(_ctx: Any, _params: Any) -> Any:
        return types.ListToolsResult(tools=[types.Tool(name=t.name, description=t.description,
                                                       input_schema=t.parameters) for t in tools])

    async def call_tool(_ctx: Any, params: Any) -> Any:
        text, failed = await call_text(list(by_name.values()), params.name, params.arguments or {})
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=failed)

    return Server(name, on_list_tools=list_tools, on_call_tool=call_tool)


async def call_text(tools: list[Tool], name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    """The observation ctxrl's agent loop gives for one call, and whether it is an error (then without its
    ``Error: `` prefix: the ``isError`` flag says it, and a client writes its own)."""
    call = Message(role="assistant", content="", tool_calls=[ToolCall(name=name, arguments=arguments)])
    observations, counts = await execute_tool_calls(tools, call)
    text, failed = observations[0].content, counts["tool_errors"] > 0
    return (text.removeprefix("Error: ") if failed else text), failed


async def serve_stdio(tools: list[Tool]) -> None:
    """Serve ``tools`` over this process's stdin and stdout until the client closes stdin."""
    from mcp.server.stdio import stdio_server

    server = tool_server(tools)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def http_app(tools: list[Tool], host: str = "127.0.0.1") -> Any:
    """The ASGI app serving ``tools`` over streamable HTTP at ``/mcp`` (DNS-rebinding protection on loopback)."""
    return tool_server(tools).streamable_http_app(streamable_http_path="/mcp", host=host)
