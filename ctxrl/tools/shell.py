"""A repository's working tree in the sandbox, and the tools that work on it: ``read_file``, ``write_file``,
``apply_patch`` and ``run`` (a shell command).

A ``Tree`` is a directory of the sandbox's work area (``ctxrl.tools.sandbox``) holding one task's repository for one
episode. As root it is owned by a uid of its own, taken for the tree's whole life, with mode 0700: a command run in
another tree (another uid) can neither list nor read nor change it, and a command run in this one can write nowhere
on the host but its tree (the sandbox's private ``/tmp`` aside, which vanishes with the run).

- ``run(command)``: ``/bin/sh -c COMMAND`` with the tree as its working directory, in the sandbox's namespaces (PID,
  IPC, mount, network) under its rlimits, as the tree's uid; one deadline for the whole run, when every process it
  started is killed (a ``sleep 1e9`` or a fork bomb is cut there); stdout and stderr capped. Runs go through the
  ``python`` tool's pool (``rollout.sandbox_workers`` at once).
- ``read_file``, ``write_file``, ``apply_patch``: done by ctxrl itself, on paths checked to stay inside the tree
  (no ``..``, no absolute path, no symlink out of it, no file another user owns: a hard link to a host file is
  refused), so a link the model made with ``run`` never lets ctxrl read or write for it outside. Nothing of the
  model's runs while these act: a run's processes are all gone when ``run`` returns.
- ``apply_patch`` takes a unified diff (``--- a/x`` / ``+++ b/x``, hunks ``@@ -l,n +l,n @@``) and applies it
  exactly (no fuzz): every hunk's context must match, or nothing is written and the observation says which hunk
  failed. ``/dev/null`` as the old file creates one; as the new file deletes one.

What it does not protect against: what the sandbox does not (docs/sandbox.md); not running as root, there is no
uid of the tree's own, so a command can write wherever the calling user can.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from ctxrl.tools.base import Tool
from ctxrl.tools.python import pool
from ctxrl.tools.sandbox import SandboxResult, _release_uid, _take_uid, _workdir_base, run_in_sandbox

MAX_COMMAND = 16_384
"""The longest command ``run`` takes, in characters."""
MAX_FILE_BYTES = 256 * 1024
"""The largest file ``write_file`` writes, or a patch ``apply_patch`` applies."""
READ_CHARS = 12_000
"""How much of a file ``read_file`` shows (a marker says when it cut)."""


class TreeError(ValueError):
    """A path or patch the model gave that cannot be used (its observation: the message)."""


class Tree:
    """One task's repository, checked out for one episode (see the module docstring). ``close`` removes it."""

    def __init__(self, files: dict[str, str]) -> None:
        self.uid = _take_uid() if os.getuid() == 0 else None
        self.path = Path(tempfile.mkdtemp(prefix="ctxrl-repo-", dir=_workdir_base())).resolve()
        try:
            for rel, content in files.items():
                self.write(rel, content)
            self._own(self.path)
            os.chmod(self.path, 0o700)
        except BaseException:
            self.close()
            raise

    # -- files, as ctxrl reads and writes them for the model ----------------------------------------------
    def resolve(self, rel: str, *, exists: bool = False) -> Path:
        """``rel`` inside the tree, or a ``TreeError`` saying why not."""
        if not isinstance(rel, str) or not rel.strip() or "\x00" in rel:
            raise TreeError("give a path relative to the repository root, such as pkg/stats.py")
        if os.path.isabs(rel) or ".." in Path(rel).parts:
            raise TreeError(f"{rel!r} is outside the repository: give a path relative to its root, without '..'")
        target = Path(os.path.realpath(self.path / rel))
        if target != self.path and self.path not in target.parents:
            raise TreeError(f"{rel!r} leads outside the repository (a symbolic link)")
        if exists and not target.is_file():
            raise TreeError(f"no file {rel!r} in the repository")
        if target.exists() and self.uid is not None and target.lstat().st_uid != self.uid:
            raise TreeError(f"{rel!r} is not a file of the repository")
        if target.exists() and target.is_file() and target.stat().st_nlink > 1:
            raise TreeError(f"{rel!r} is a hard link; ctxrl reads and writes only the repository's own files")
        return target

    def read(self, rel: str) -> str:
        target = self.resolve(rel, exists=True)
        with open(target, "rb") as f:
            data = f.read(READ_CHARS * 4 + 1)
        text = data.decode("utf-8", errors="replace")
        return text if len(text) <= READ_CHARS else text[:READ_CHARS] + f"\n[ctxrl: cut after {READ_CHARS} characters]"

    def read_all(self, rel: str) -> str:
        """The whole file (for a patch), up to ``MAX_FILE_BYTES``."""
        target = self.resolve(rel, exists=True)
        if target.stat().st_size > MAX_FILE_BYTES:
            raise TreeError(f"{rel!r} is over {MAX_FILE_BYTES} bytes")
        return target.read_text(encoding="utf-8", errors="replace")

    def write(self, rel: str, content: str) -> None:
        if len(content.encode("utf-8", errors="surrogatepass")) > MAX_FILE_BYTES:
            raise TreeError(f"the content is over {MAX_FILE_BYTES} bytes")
        target = self.resolve(rel)
        if target.is_dir():
            raise TreeError(f"{rel!r} is a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        fd = os.open(target, flags, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write(content)
        for path in [target, *(p for p in target.parents if self.path in p.parents)]:
            self._own(path, recursive=False)

    def delete(self, rel: str) -> None:
        self.resolve(rel, exists=True).unlink()

    def files(self) -> dict[str, str]:
        """Every regular file of the tree as text (what grading overlays), symbolic links left out."""
        out = {}
        for root, dirs, names in os.walk(self.path):
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
            for name in names:
                path = Path(root, name)
                mode = path.lstat().st_mode
                if stat.S_ISREG(mode) and path.stat().st_size <= MAX_FILE_BYTES:
                    out[str(path.relative_to(self.path))] = path.read_text(encoding="utf-8", errors="replace")
        return out

    def _own(self, path: Path, recursive: bool = True) -> None:
        if self.uid is None:
            return
        os.chown(path, self.uid, self.uid, follow_symlinks=False)
        if recursive and path.is_dir():
            for root, dirs, names in os.walk(path):
                for name in dirs + names:
                    os.chown(os.path.join(root, name), self.uid, self.uid, follow_symlinks=False)

    # -- commands, run by the model in the sandbox ----------------------------------------------------------
    async def run(self, command: str, *, timeout_s: float = 10.0, memory_mb: int = 1024,
                  max_output_bytes: int = 8192, max_processes: int = 64) -> SandboxResult:
        """``sh -c command`` in the tree, sandboxed (module docstring)."""
        if len(command) > MAX_COMMAND:
            raise TreeError(f"the command is over {MAX_COMMAND} characters")
        bootstrap = f"import os\nos.execv('/bin/sh', ['sh', '-c', {command!r}])\n"
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.path), "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "TMPDIR": "/tmp" if self.uid is not None else str(self.path)}
        async with pool().slot():
            return await run_in_sandbox(bootstrap, self.path, self.uid, env, timeout_s=timeout_s,
                                        memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                                        max_processes=max_processes, max_file_mb=16)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self.uid is not None:
            _release_uid(self.uid)
            self.uid = None


# -- unified diffs ---------------------------------------------------------------------------------------------------
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _path(header: str) -> str | None:
    name = header.split("\t")[0].strip()
    if name == "/dev/null":
        return None
    return name[2:] if name[:2] in ("a/", "b/") else name


def parse_patch(patch: str) -> list[tuple[str | None, str | None, list[tuple[int, list[str]]]]]:
    """``[(old path, new path, [(old start line, hunk lines)])]`` of a unified diff, or a ``TreeError``."""
    lines = patch.splitlines()
    files, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise TreeError(f"line {i + 1}: a '--- old' header must be followed by '+++ new'")
        old, new = _path(lines[i][4:]), _path(lines[i + 1][4:])
        i += 2
        hunks = []
        while i < len(lines) and lines[i].startswith("@@"):
            match = _HUNK.match(lines[i])
            if not match:
                raise TreeError(f"line {i + 1}: a hunk header reads '@@ -START,COUNT +START,COUNT @@'")
            start, count = int(match.group(1)), int(match.group(2) or 1)
            new_count = int(match.group(4) or 1)
            i += 1
            body, seen_old, seen_new = [], 0, 0
            while i < len(lines) and (seen_old < count or seen_new < new_count):
                line = lines[i]
                tag = line[:1] or " "
                if tag not in " +-\\":
                    break
                if tag != "\\":
                    body.append(tag + line[1:])
                    seen_old += tag in " -"
                    seen_new += tag in " +"
                i += 1
            if seen_old != count or seen_new != new_count:
                raise TreeError(f"a hunk of {old or new} has {seen_old} old and {seen_new} new lines; its header says "
                                f"{count} and {new_count}")
            hunks.append((start, body))
        if not hunks:
            raise TreeError(f"no hunks for {old or new}")
        files.append((old, new, hunks))
    if not files:
        raise TreeError("no file in the patch: a unified diff starts '--- a/PATH' then '+++ b/PATH' then hunks")
    return files


def apply_patch(tree: Tree, patch: str) -> list[str]:
    """Apply a unified diff exactly (module docstring); the paths it changed. Nothing is written unless every hunk of
    every file applies."""
    if len(patch.encode("utf-8", errors="surrogatepass")) > MAX_FILE_BYTES:
        raise TreeError(f"the patch is over {MAX_FILE_BYTES} bytes")
    results: dict[str, str | None] = {}
    for old, new, hunks in parse_patch(patch):
        source = tree.read_all(old) if old is not None else ""
        text = source.splitlines(keepends=True)
        out, at = [], 0
        for n, (start, body) in enumerate(hunks, start=1):
            expected = [line[1:] for line in body if line[0] in " -"]
            begin = max(start - 1, 0) if expected else start
            actual = [line.rstrip("\r\n") for line in text[begin:begin + len(expected)]]
            if begin < at or actual != expected:
                raise TreeError(f"hunk {n} of {old or new} does not apply: its lines {start}-"
                                f"{start + len(expected) - 1} are not what the hunk's context and '-' lines say; read "
                                "the file again and make the patch from what it holds")
            out += text[at:begin]
            out += [line[1:] + "\n" for line in body if line[0] in " +"]
            at = begin + len(expected)
        out += text[at:]
        results[(new or old)] = None if new is None else "".join(out)
        if old is not None and new is not None and old != new:
            results[old] = None
    for rel, content in results.items():
        if content is None:
            tree.delete(rel)
        else:
            tree.write(rel, content)
    return list(results)


# -- the tools -----------------------------------------------------------------------------------------------------
def format_run(result: SandboxResult) -> str:
    """A run's observation: stdout, stderr, then its exit status (always: a test run says pass or fail by it)."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stderr.strip():
        parts.append(result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append(f"[timed out after {result.duration_s:.1f} s: every process of the command was killed]")
    elif result.memory_exceeded:
        parts.append("[memory limit exceeded]")
    else:
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts)


def tree_tools(get_tree, *, run_timeout_s: float = 10.0, max_output_bytes: int = 8192) -> list[Tool]:
    """``read_file``, ``write_file``, ``apply_patch`` and ``run`` on the tree ``get_tree()`` returns (the episode's)."""

    def guarded(fn):
        async def call(**arguments) -> str:
            tree = get_tree()
            if tree is None:
                return "Error: no repository is checked out (the episode has not started)"
            try:
                return await fn(tree, **arguments)
            except TreeError as exc:
                return f"Error: {exc}"
        return call

    async def read_file(tree: Tree, path: str) -> str:
        return tree.read(path)

    async def write_file(tree: Tree, path: str, content: str) -> str:
        tree.write(path, content)
        return f"wrote {path} ({len(content)} characters)"

    async def patch(tree: Tree, patch: str) -> str:
        return "patched " + ", ".join(apply_patch(tree, patch))

    async def run(tree: Tree, command: str) -> str:
        return format_run(await tree.run(command, timeout_s=run_timeout_s, max_output_bytes=max_output_bytes))

    def schema(**props: str) -> dict:
        return {"type": "object", "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
                "required": list(props), "additionalProperties": False}

    return [
        Tool("read_file", "Read a file of the repository.", schema(path="path relative to the repository root"),
             guarded(read_file)),
        Tool("write_file", "Write a file of the repository (its whole content).",
             schema(path="path relative to the repository root", content="the file's new content"),
             guarded(write_file)),
        Tool("apply_patch", "Apply a unified diff (--- a/PATH, +++ b/PATH, @@ hunks) to the repository.",
             schema(patch="the unified diff"), guarded(patch)),
        Tool("run", "Run a shell command in the repository (its root is the working directory).",
             schema(command="the shell command, e.g. python3 -m unittest -v"), guarded(run),
             timeout_s=run_timeout_s + 10.0),
    ]
