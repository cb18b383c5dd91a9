"""Run untrusted Python (model-written code) in a throw-away, resource-limited process.

``run_python(code)`` (or ``await run_python_async(code)``, or a ``SandboxPool`` for many at once)
writes ``code`` to a fresh temporary directory and runs it with the same interpreter, in a new
process and process group, and returns a ``SandboxResult``.

What it does, in the child before the code starts (a small launcher, then ``execve``):

- **Resources**: rlimits on address space (``memory_mb``), CPU seconds, number of processes
  (fork bombs fail to fork), file size, open files; no core dumps. Python's ``MemoryError`` is
  reported as ``memory_exceeded``.
- **Processes**: PID and IPC namespaces of its own, in a private mount namespace with a ``/proc``
  of its own, where the kernel allows them (as root, or inside an unprivileged user namespace):
  the code sees only the run's processes (a small init as PID 1, the code as PID 2), never the
  host's command lines, and SysV IPC objects it leaves vanish with the namespace. When the code's
  process exits, init exits and the kernel kills whatever is left. The mode in force is in
  ``SandboxResult.processes``: ``namespace`` or ``host`` (said once in the log).
- **Time**: one wall-clock deadline for the whole run; at the deadline, or as soon as the main
  process exits, every process the run started is killed (the namespace's, and by its dedicated
  uid when running as root, otherwise by process group and session), and the call waits until
  none is left. The call returns when the main process exits, whoever still holds its stdout: the
  output pipes are the caller's own, read for at most ``OUTPUT_GRACE_S`` after the kill.
- **Network**: a new network namespace with no interfaces up, when the kernel allows it (as root,
  or through an unprivileged user namespace); otherwise ``socket`` is replaced before the code
  runs, which only stops Python code that does not reach for ``_socket`` or ctypes. The mode in
  force is in ``SandboxResult.network``: ``namespace`` or ``python-socket-block``.
- **Files**: the working directory is fresh and removed afterwards. As root the code runs as an
  unprivileged uid of its own, in a private mount namespace whose world-writable directories
  (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``) are empty tmpfs mounts that vanish with
  it: writes outside the working directory either fail (no permission) or do not persist.
  ``SandboxResult.files`` says which: ``private`` or ``host`` (not root: the code can write
  wherever the calling user can). As root the code therefore runs with an interpreter that such
  a uid can read (``sandbox_python()``; ``$CTXRL_SANDBOX_PYTHON`` chooses it).
- **Environment**: a scrubbed environment (``PATH``, ``HOME`` = the work dir, ``LANG``, thread
  caps); nothing of the parent's variables (secrets) is passed; stdin is closed (``/dev/null``).
- **Output**: stdout and stderr are read as they come and kept up to ``max_output_bytes`` each
  (a marker says what was cut), so a gigabyte of printing costs the parent no memory.

What it does not protect against: kernel exploits; reading world-readable host files (the code
sees the host filesystem, read-only where it matters); CPU and memory contention with the
host; anything when the kernel refuses namespaces and the process is not root (then it is a
resource-limited subprocess, not a security boundary: the code can read other processes'
command lines in ``/proc`` and leave SysV IPC segments behind, and a child that leaves its
session keeps running after the call, which then waits ``OUTPUT_GRACE_S`` for its output). For
hostile code at scale, run the sandbox itself inside a container or VM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ctxrl.errors import CtxrlError

log = logging.getLogger(__name__)

MEMORY_EXIT = 86  # the exit code the child uses to say "MemoryError"
TRUNCATION_MARKER = "\n[ctxrl sandbox: output truncated after {n} bytes]\n"
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
UID_RANGE = (200_000, 260_000)
OUTPUT_GRACE_S = 2.0
PROCESS_NAMESPACES = True
"""Whether runs get PID and IPC namespaces of their own where the kernel allows them (tests turn it off to check
what a run does where the kernel refuses them)."""
"""How long the call waits, after the run's processes are killed, for its output pipes to close."""


@dataclass
class SandboxResult:
    """What a sandboxed run did."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The process's exit status; negative for a signal (-9: killed); None if it never started."""
    timed_out: bool
    memory_exceeded: bool
    truncated: bool
    duration_s: float
    network: str = ""
    """``namespace`` or ``python-socket-block``."""
    files: str = ""
    """``private`` (writes outside the work dir cannot persist) or ``host``."""
    processes: str = ""
    """``namespace`` (PID and IPC namespaces of its own: ``/proc`` lists the run's processes only, and its SysV
    IPC objects go with it) or ``host`` (the kernel refused them: see the module docstring)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.memory_exceeded


# The launcher runs first in the child: it isolates itself, then (with a PID namespace of its own) forks the
# namespace's init, which forks the code's process; that one limits itself and execs the interpreter.
_LAUNCHER = r'''
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
def unshare(flags):
    return libc.unshare(flags) == 0
def mount(source, target, kind, flags, data=None):
    return libc.mount(source, target, kind, flags, data) == 0
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
network, files, processes = "python-socket-block", "host", "host"
uid, gid = os.getuid(), os.getgid()
privileged = uid == 0
if uid == 0:
    if unshare(CLONE_NEWNET):
        network = "namespace"
elif unshare(CLONE_NEWUSER | CLONE_NEWNET):
    network = "namespace"
    try:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    except OSError:
        pass
    privileged = True  # within its own user namespace
private = privileged and unshare(CLONE_NEWNS) and mount(None, b"/", None, MS_REC | MS_PRIVATE)
if private and uid == 0:
    ok = True
    for d in cfg["world_writable"]:
        if os.path.isdir(d):
            ok &= mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64m,mode=1777")
    files = "private" if ok else "host"
# A PID namespace needs a private mount namespace, for the /proc that shows only its processes.
own_processes = cfg["process_namespaces"] and private and unshare(CLONE_NEWIPC | CLONE_NEWPID)

def run_code():
    mb = 1024 * 1024
    limits = [(resource.RLIMIT_AS, cfg["memory_mb"] * mb), (resource.RLIMIT_CPU, cfg["cpu_s"]),
              (resource.RLIMIT_NPROC, cfg["max_processes"]), (resource.RLIMIT_FSIZE, cfg["max_file_mb"] * mb),
              (resource.RLIMIT_NOFILE, 256)]
    for what, value in limits:
        try:
            resource.setrlimit(what, (value, value))
        except (ValueError, OSError):
            pass
    mode = files
    if uid == 0:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
        if files == "host":
            mode = "unprivileged-uid"
    os.chdir(cfg["workdir"])
    os.write(cfg["mode_fd"], f"{network} {mode} {processes}".encode())
    os.close(cfg["mode_fd"])
    os.execve(cfg["python"], [cfg["python"], "-I", "-c", cfg["bootstrap"], network], cfg["env"])

if not own_processes:
    run_code()
status_r, status_w = os.pipe()
init = os.fork()
if init == 0:
    # PID 1 of the run's namespace: when it exits, the kernel kills every process left in it.
    os.close(status_r)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC):
        processes = "namespace"
    code = os.fork()
    if code == 0:
        os.close(status_w)
        run_code()
    os.close(cfg["mode_fd"])
    status = 0
    while True:  # reap every orphan until the code's own process ends
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid == code:
            break
    os.write(status_w, str(status).encode())
    os._exit(0)
# The launcher, outside the namespace: it ends as the code's process ended.
os.close(status_w)
os.close(cfg["mode_fd"])
_, status = os.waitpid(init, 0)
written = os.read(status_r, 64)
if written:
    status = int(written)
if os.WIFSIGNALED(status):
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
'''

# The bootstrap runs in the exec'd interpreter, as the code's own process.
_BOOTSTRAP = r'''
import os, runpy, sys
if sys.argv[1] != "namespace":
    import socket
    def _blocked(*args, **kwargs):
        raise PermissionError("network access is disabled in the ctxrl sandbox")
    class _NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            _blocked()
    socket.socket = _NoSocket
    socket.create_connection = _blocked
    socket.getaddrinfo = _blocked
sys.argv = ["main.py"]
sys.path.insert(0, os.getcwd())
try:
    runpy.run_path("main.py", run_name="__main__")
except MemoryError:
    os.write(2, b"MemoryError: the sandbox memory limit was reached\n")
    os._exit(MEMORY_EXIT)
except SystemExit:
    raise
except BaseException as exc:
    # the traceback of the user's code only, without the sandbox's own frames
    import traceback
    te = traceback.TracebackException.from_exception(exc)
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename == "main.py"])
    try:
        sys.stdout.flush()
    except Exception:
        pass
    sys.stderr.write("".join(te.format()))
    sys.stderr.flush()
    os._exit(1)
'''.replace("MEMORY_EXIT", str(MEMORY_EXIT))


class SandboxError(CtxrlError, RuntimeError):
    """The sandbox cannot run here (not the code's fault); the message says how to fix it."""

    kind = "sandbox error"


_python_for_uid: str | None = None


def sandbox_python() -> str:
    """The interpreter the code runs with.

    Not root: this interpreter. Root: the code runs as an unprivileged uid, which must be able to
    read and run the interpreter; the first of ``$CTXRL_SANDBOX_PYTHON``, this interpreter (or its
    real path) and ``/usr/bin/python3`` that a trial run as such a uid can start. Packages the code
    imports come from that interpreter's own site-packages.
    """
    global _python_for_uid
    if os.getuid() != 0:
        return sys.executable
    if _python_for_uid is None:
        explicit = os.environ.get("CTXRL_SANDBOX_PYTHON")
        candidates = [explicit] if explicit else [sys.executable, os.path.realpath(sys.executable),
                                                  "/usr/bin/python3", "/usr/local/bin/python3"]
        for candidate in candidates:
            if candidate and os.path.exists(candidate) and _runs_unprivileged(candidate):
                _python_for_uid = candidate
                break
        else:
            raise SandboxError(
                "no Python interpreter is usable by an unprivileged user "
                f"(tried {', '.join(c for c in candidates if c)}); "
                "as root the sandbox drops to such a user, so the interpreter and every directory above it must "
                "be world-readable and -executable. Set CTXRL_SANDBOX_PYTHON to one that is (e.g. /usr/bin/python3).")
    return _python_for_uid


def _runs_unprivileged(python: str) -> bool:
    import subprocess

    uid = UID_RANGE[1] - 1

    def drop() -> None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)

    try:
        done = subprocess.run([python, "-I", "-c", "import runpy, json; print('ok')"], preexec_fn=drop,
                              capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"}, cwd="/")
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.strip() == "ok"


_used_uids: set[int] = set()
_uid_lock = threading.Lock()


def _take_uid() -> int:
    with _uid_lock:
        while True:
            uid = random.randrange(*UID_RANGE)
            if uid not in _used_uids:
                _used_uids.add(uid)
                return uid


def _release_uid(uid: int) -> None:
    with _uid_lock:
        _used_uids.discard(uid)


def _workdir_base() -> Path:
    """Where work dirs go. As root: a root-owned, traversable directory outside the world-writable
    ones (which the child replaces with tmpfs), so ``..`` from a work dir is not writable either.
    ``$CTXRL_SANDBOX_DIR`` overrides it."""
    if os.getuid() != 0:
        return Path(os.environ.get("CTXRL_SANDBOX_DIR", tempfile.gettempdir()))
    base = Path(os.environ.get("CTXRL_SANDBOX_DIR", "/var/lib/ctxrl/sandbox"))
    base.mkdir(parents=True, exist_ok=True)
    for d in (base, base.parent):
        if d.stat().st_uid == 0 and d != Path("/var/lib"):
            os.chmod(d, 0o711)
    return base


def _processes(uid: int | None, session: int) -> list[int]:
    """PIDs that belong to a run: owned by its uid (as root) or in its session."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if uid is not None:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                pids.append(pid)
                            break
            elif os.getsid(pid) == session:
                pids.append(pid)
        except (OSError, ValueError):
            continue
    return pids


def _kill_all(uid: int | None, session: int, pgid: int) -> None:
    """Kill every process of the run and wait (up to 5 s) until none is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        left = [p for p in _processes(uid, session) if p != os.getpid()]
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)


class _Capped:
    """Keeps the first ``limit`` bytes of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit, self.data, self.seen = limit, bytearray(), 0

    def feed(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.seen += len(chunk)

    @property
    def truncated(self) -> bool:
        return self.seen > self.limit

    def text(self) -> str:
        out = self.data.decode("utf-8", errors="replace")
        return out + TRUNCATION_MARKER.format(n=self.limit) if self.truncated else out


async def _drain(fd: int, sink: _Capped) -> None:
    """Read the pipe ``fd`` into ``sink`` until every writer has closed it (or until cancelled), then close it."""
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                os.fdopen(fd, "rb", buffering=0))
    try:
        while chunk := await reader.read(65536):
            sink.feed(chunk)
    finally:
        transport.close()


async def run_python_async(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512,
                           max_output_bytes: int = 65536, max_processes: int = 64, max_file_mb: int = 64
                           ) -> SandboxResult:
    """Run ``code`` in a sandbox (see the module docstring); never raises because of the code."""
    if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0:
        raise ValueError("timeout_s, memory_mb and max_output_bytes must be > 0")
    root = os.getuid() == 0
    uid = _take_uid() if root else None
    workdir = Path(tempfile.mkdtemp(prefix="ctxrl-sbx-", dir=_workdir_base()))
    try:
        env = _write_code(workdir, code, uid)
        return await run_in_sandbox(_BOOTSTRAP, workdir, uid, env, timeout_s=timeout_s, memory_mb=memory_mb,
                                    max_output_bytes=max_output_bytes, max_processes=max_processes,
                                    max_file_mb=max_file_mb)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            _release_uid(uid)


async def run_in_sandbox(bootstrap: str, workdir: Path, uid: int | None, env: dict[str, str], *, timeout_s: float,
                         memory_mb: int, max_output_bytes: int, max_processes: int, max_file_mb: int
                         ) -> SandboxResult:
    """Run the Python ``bootstrap`` (as ``python -I -c BOOTSTRAP MODE``, ``MODE`` the network mode) in ``workdir``, as
    ``uid`` when given (root), isolated and limited as the module docstring says; the caller owns ``workdir`` and
    ``uid`` (``run_python_async`` makes and removes both; ``ctxrl.tools.shell`` keeps a task's tree across runs)."""
    started = time.monotonic()
    python = await asyncio.to_thread(sandbox_python)
    proc = None
    out, err = _Capped(max_output_bytes), _Capped(max_output_bytes)
    mode_r, mode_w = os.pipe()
    # The output pipes are the parent's own, not the subprocess transport's: waiting for the main process
    # then never waits for a child that still holds them open.
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    readers = None
    try:
        cfg = {"workdir": str(workdir), "uid": uid, "memory_mb": memory_mb, "cpu_s": int(timeout_s) + 2,
               "max_processes": max_processes, "max_file_mb": max_file_mb, "env": env,
               "world_writable": list(WORLD_WRITABLE), "bootstrap": bootstrap, "mode_fd": mode_w, "python": python,
               "process_namespaces": PROCESS_NAMESPACES}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", _LAUNCHER, json.dumps(cfg), stdin=asyncio.subprocess.DEVNULL,
            stdout=out_w, stderr=err_w, start_new_session=True, env=env, cwd=str(workdir), pass_fds=(mode_w,))
        for fd in (mode_w, out_w, err_w):
            os.close(fd)
        mode_w = out_w = err_w = -1
        readers = asyncio.gather(_drain(out_r, out), _drain(err_r, err))
        out_r = err_r = -1  # the readers close them
        timed_out = await _wait_then_kill(proc, readers, max(timeout_s - (time.monotonic() - started), 0.001), uid)
    finally:
        if readers is not None and not readers.done():
            readers.cancel()
            await asyncio.gather(readers, return_exceptions=True)
        if proc is not None and proc.returncode is None:
            await asyncio.to_thread(_kill_all, uid, proc.pid, proc.pid)
        for fd in (mode_w, out_w, err_w, out_r, err_r):
            if fd >= 0:
                os.close(fd)
        mode = (_read_all(mode_r).split() + ["unknown"] * 3)[:3]
        os.close(mode_r)
        _say_once_without_namespaces(mode[2])
    exit_code = proc.returncode if proc is not None else None
    return SandboxResult(stdout=out.text(), stderr=err.text(), exit_code=exit_code, timed_out=timed_out,
                         memory_exceeded=exit_code == MEMORY_EXIT, truncated=out.truncated or err.truncated,
                         duration_s=time.monotonic() - started, network=mode[0], files=mode[1], processes=mode[2])


def _write_code(workdir: Path, code: str, uid: int | None) -> dict[str, str]:
    """``code`` as ``main.py`` in ``workdir`` (owned by the run's uid, when there is one); the run's environment."""
    (workdir / "main.py").write_text(code)
    if uid is not None:
        os.chown(workdir, uid, uid)
        os.chown(workdir / "main.py", uid, uid)
        os.chmod(workdir, 0o700)
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir),
            "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


async def _wait_then_kill(proc, readers, remaining: float, uid: int | None) -> bool:
    """Wait up to ``remaining`` seconds for the main process, then kill whatever it started and give the output
    readers ``OUTPUT_GRACE_S``; whether the main process ran out of time."""
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), remaining)
    except asyncio.TimeoutError:
        timed_out = True
    # the main process is done (or out of time): nothing it started may outlive the call (with a PID
    # namespace the kernel has killed them already)
    await asyncio.to_thread(_kill_all, uid, proc.pid, proc.pid)
    await proc.wait()
    try:  # what the run wrote is in the pipes; only a process that escaped the kill can hold them longer
        await asyncio.wait_for(readers, OUTPUT_GRACE_S)
    except asyncio.TimeoutError:
        pass
    return timed_out


_said: list[str] = []


def _say_once_without_namespaces(processes: str) -> None:
    if processes == "host" and not _said:
        _said.append(processes)
        log.warning("sandboxed runs get no PID and IPC namespaces of their own here (the kernel refused them or the "
                    "mount namespace they need; %s): sandboxed code can list this machine's processes and their "
                    "command lines in /proc, and its SysV IPC objects outlive it (docs/sandbox.md)",
                    "running as root" if os.getuid() == 0 else "unprivileged user namespaces unavailable?")


def _read_all(fd: int) -> str:
    """What the launcher wrote on its mode pipe (its write end is closed by now)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 256)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def run_python(code: str, **kwargs) -> SandboxResult:
    """Blocking ``run_python_async`` (not from inside a running event loop: await the async one there)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python_async(code, **kwargs))
    raise RuntimeError("run_python() was called inside an event loop; use `await run_python_async(...)`")


class SandboxPool:
    """At most ``workers`` sandboxes at once; a hang holds one slot until its own deadline only."""

    def __init__(self, workers: int = 8, **limits) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers, self.limits = workers, limits
        self._semaphore: asyncio.Semaphore | None = None
        self._loop = None

    async def run(self, code: str, **overrides) -> SandboxResult:
        async with self.slot():
            return await run_python_async(code, **{**self.limits, **overrides})

    @contextlib.asynccontextmanager
    async def slot(self):
        """One of the ``workers`` slots, held while a sandboxed run made elsewhere runs (``ctxrl.tools.shell``)."""
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._loop is not loop:
            self._semaphore, self._loop = asyncio.Semaphore(self.workers), loop
        async with self._semaphore:
            yield

    async def map(self, codes: list[str]) -> list[SandboxResult]:
        """Run all of ``codes``; results in the same order."""
        return list(await asyncio.gather(*(self.run(c) for c in codes)))
