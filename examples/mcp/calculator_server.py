"""An MCP server whose one tool is ctxrl's calculator: what a server of your own looks like (docs/mcp.md).

Written with the ``mcp`` SDK's ``MCPServer`` (``pip install -e '.[mcp]'``). A ctxrl run starts it over stdio::

    [env]
    mcp_servers = ["python examples/mcp/calculator_server.py"]

or reaches it over streamable HTTP when it is started with a port (``env.mcp_servers =
["http://127.0.0.1:8000/mcp"]``)::

    .venv/bin/python examples/mcp/calculator_server.py --port 8000

The tool's name, description and parameter are the built-in calculator's, so the policy sees the same tool
whether ctxrl runs it or this server does (tests/test_mcp.py checks the episodes are the same, token for token).
"""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from ctxrl.tools.calculator import CalculatorError, calculate

server = MCPServer("calculator", log_level="WARNING")  # (stdout is the protocol's: log to stderr, and little)


@server.tool()
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    try:
        return calculate(expression)
    except CalculatorError as exc:  # a ToolError's message reaches the model; other exceptions are hidden
        raise ToolError(str(exc)) from None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, help="serve streamable HTTP at http://127.0.0.1:PORT/mcp, not stdio")
    args = parser.parse_args()
    if args.port is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
