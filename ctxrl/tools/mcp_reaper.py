"""Run one MCP server and end every process it leaves behind: ``python -I -S mcp_reaper.py -- PROGRAM ARGS...``.

``ctxrl.tools.mcp_session`` starts each stdio server through this script on Linux. The MCP SDK starts a stdio
server in a session of its own and, at shutdown, closes its stdin, and kills its process group only when it has
not exited within a grace period. So a server that exits at once leaves its children running, and a child that
starts a session or process group of its own escapes even the kill: they outlived the run. This script is the
process the SDK starts, the session leader: it makes itself the subreaper of everything under it
(``PR_SET_CHILD_SUBREAPER``: a process whose parent dies is re-parented here, whatever session or group it is
in), runs the server with the same stdin, stdout and stderr, and when the server exits, or the SDK signals the
group (SIGTERM, SIGINT, SIGHUP), kills every process left under it, reaps them, and exits with the server's
status. Standard library only, started with ``-I -S``: it costs a few milliseconds.

What it does not end: a process that another user owns (a setuid program), or one that moved into a PID
namespace of its own; and nothing, if this script is killed with SIGKILL before it can act (the SDK sends
SIGKILL only to a group that ignored SIGTERM for 2 s, and this script acts on SIGTERM at once).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stop(Exception):
    """The SDK signalled the group: end everything now."""


def descendants(root: int) -> list[int]:
    """Every live process under ``root``, from ``/proc`` (each process's parent is the fourth field of its stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z":  # (a zombie is dead already: reaped below)
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def reap() -> None:
    """Collect every child of this process that has exited."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_all(deadline_s: float = 5.0) -> None:
    """SIGKILL every process under this one, again as orphans are re-parented here, until none is left."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        left = descendants(os.getpid())
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        reap()
        time.sleep(0.01)
    reap()


def stop(signum: int, _frame) -> None:
    raise Stop(signum)


def run(argv: list[str]) -> int:
    """Run ``argv`` as the server; end everything under this process when it exits or the SDK signals; its status."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("ctxrl mcp_reaper: the kernel refused PR_SET_CHILD_SUBREAPER; the server's children that leave its "
              "session may outlive it", file=sys.stderr)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # (held until the parent is ready to act on them)
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    server = os.fork()
    if server == 0:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            print(f"ctxrl mcp_reaper: cannot run {argv[0]!r}: {exc.strerror}", file=sys.stderr)
        os._exit(127)
    code = 1
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        devnull = os.open(os.devnull, os.O_RDWR)  # (the server's stdin and stdout are its own: the SDK sees EOF)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        while True:
            pid, status = os.waitpid(-1, 0)  # (orphans re-parented here are reaped as they exit, too)
            if pid == server:
                code = os.waitstatus_to_exitcode(status)
                break
    except Stop as signalled:
        code = 128 + signalled.args[0]
    finally:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        end_all()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.exit("usage: python -I -S mcp_reaper.py -- PROGRAM [ARGS...]")
    sys.exit(run(args))
