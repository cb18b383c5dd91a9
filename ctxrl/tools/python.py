"""The ``python`` tool: model-written code run in the sandbox, its output as the observation.

The observation is what a person at a terminal would see: stdout, then stderr, then one status
line when the run did not end normally (time limit, memory limit, non-zero exit). The tool's
own ``timeout_s`` (the turn-level guard in ``execute_tool_calls``) is set a little above the
sandbox's, so the sandbox's deadline, which also kills the run's processes, always fires first.

Every ``python`` tool of a process runs through one ``SandboxPool``: at most ``workers``
interpreters at once (each may use its memory limit, 512 MB by default), however many episodes
call it together; the rest wait their turn. ``configure_pool(workers)`` sizes it
(``rollout.sandbox_workers``; a ``RolloutWorker`` sets it from its spec).
"""

from __future__ import annotations

from ctxrl.tools.base import Tool
from ctxrl.tools.sandbox import SandboxPool, SandboxResult

DEFAULT_WORKERS = 8
_POOL = SandboxPool(workers=DEFAULT_WORKERS)


def configure_pool(workers: int) -> SandboxPool:
    """Size the shared pool: at most ``workers`` sandboxed interpreters at once in this process."""
    global _POOL
    if workers != _POOL.workers:
        _POOL = SandboxPool(workers=workers)
    return _POOL


def pool() -> SandboxPool:
    """The pool every ``python`` tool of this process runs through."""
    return _POOL


def format_result(result: SandboxResult) -> str:
    """The observation text for one sandboxed run."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stderr.strip():
        parts.append(result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append(f"[timed out after {result.duration_s:.1f} s]")
    elif result.memory_exceeded:
        parts.append("[memory limit exceeded]")
    elif result.exit_code not in (0, None):
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts) if parts else "[no output]"


def python_tool(*, timeout_s: float = 10.0, memory_mb: int = 512, max_output_bytes: int = 4096) -> Tool:
    """The ``python`` tool: one required string argument ``code``; prints are the result."""

    async def run(code: str) -> str:
        return format_result(await pool().run(code, timeout_s=timeout_s, memory_mb=memory_mb,
                                              max_output_bytes=max_output_bytes))

    return Tool(
        name="python",
        description="Run Python code and return what it prints.",
        parameters={"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        fn=run,
        timeout_s=timeout_s + 10.0,
    )
