"""Repository sandboxes for software-engineering agents: run commands, read/write files, diff.

* :class:`LocalSandbox`: a temporary copy of a directory (a git repository is created in it so
  :meth:`Sandbox.diff` is a ``git diff`` against the starting tree); commands run as local
  subprocesses with a timeout. Used by the tests and for the bundled fixtures. It is *not*
  isolation: commands run with the caller's permissions.
* :class:`DockerSandbox`: a container from an image (e.g. a SWE-bench instance image) driven
  through the ``docker`` CLI; :meth:`~Sandbox.clone` commits the container to an image and
  starts a new container from it (fork sampling copies the repository state this way).

Every command result says whether it timed out, and :func:`truncate_output` says what it cut.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DockerSandbox",
    "ExecResult",
    "LocalSandbox",
    "Sandbox",
    "TooLarge",
    "format_exec_result",
    "swebench_harness",
    "truncate_output",
]

# build/cache files never belong to a patch (kept out of the tree via .git/info/exclude)
_EXCLUDE = "__pycache__/\n*.pyc\n.pytest_cache/\n"
# The starting tree's commit, recorded at creation (clones keep it): diffs are taken against it,
# so an agent that commits, resets or checks out its work still hands in every change.
_START_REF = "refs/harts/start"
# The patch is staged in an index of its own, never the repository's: the agent's `git diff`,
# `git status`, `git checkout -- f` / `git restore f` work on its own index as in any checkout
# (a `git add -A` there made `git diff` print nothing and `git checkout -- f` keep the edit).
# Seeded from the repository's index (its stat cache: `git add -A` then rehashes changed files
# only) with the index file's mtime (git rehashes an entry as new as its index, edited within
# the same second: a copy dated now made it trust that entry's stale stat data), else the start
# tree; kept between calls. Every bash line of a diff starts with it.
_PATCH_INDEX = (
    'export GIT_INDEX_FILE="$(git rev-parse --absolute-git-dir)/harts-patch-index"; '
    '[ -f "$GIT_INDEX_FILE" ] || cp -p "$(git rev-parse --absolute-git-dir)/index" '
    f'"$GIT_INDEX_FILE" 2>/dev/null || git read-tree {_START_REF} || exit 1; '
)
# ... and synced with the working tree before the first diff command (git add's warnings, an
# embedded repository's or line endings', are not part of the patch)
_STAGE = 'out=$(git add -A 2>&1) || { printf "%s\n" "$out"; exit 1; }; '
_MARK_START = (
    f"git rev-parse -q --verify {_START_REF} >/dev/null || git update-ref {_START_REF} HEAD"
)
_GIT_ID = [
    "-c",
    "user.name=harts",
    "-c",
    "user.email=harts@localhost",
    "-c",
    "commit.gpgsign=false",
]


# Before an agent's command in a container: the image's ~/.bashrc, which a non-interactive
# `bash -c` does not read (SWE-bench images activate the repository's conda env `testbed` there;
# without it `python` / `pytest` are the base env's). Its own output is dropped.
_PROFILE = "[ -f ~/.bashrc ] && . ~/.bashrc >/dev/null 2>&1\n"

# Characters of a command's output kept while it is read (head and tail halves; the middle is
# counted, not stored): a command that prints without end cannot fill the worker's memory.
MAX_READ_CHARS = 1 << 20
# The most characters a file read (an edit writes it back whole) or a patch may have: past it
# they are refused (TooLarge), never cut.
MAX_WHOLE_CHARS = 64 << 20


class TooLarge(ValueError):
    """A file or patch over :data:`MAX_WHOLE_CHARS`, refused rather than cut."""


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command: combined stdout+stderr text, exit code (``None`` when it timed
    out), and whether it timed out. ``omitted``: characters dropped from the middle of the
    output while it was read (``output`` is then its first and last halves, joined)."""

    output: str
    exit_code: int | None
    timed_out: bool = False
    omitted: int = 0


def truncate_output(text: str, max_chars: int, omitted: int = 0) -> str:
    """``text`` if it has at most ``max_chars`` characters and nothing was ``omitted`` from its
    middle already, else its head and tail around a line that says how many characters of the
    whole output (``len(text) + omitted``) were omitted (the result then has about
    ``max_chars`` characters plus that notice)."""
    if max_chars <= 0:
        raise ValueError(f"max_chars: expected > 0, got {max_chars}")
    if len(text) <= max_chars and not omitted:
        return text
    keep = min(max_chars, len(text))
    head = keep // 2
    tail = keep - head
    cut = len(text) - head - tail + omitted
    return (
        f"{text[:head]}\n[... output truncated: {cut} of {len(text) + omitted} characters "
        f"omitted ...]\n{text[len(text) - tail :]}"
    )


def format_exec_result(result: ExecResult, max_chars: int, timeout: float) -> str:
    """The text an agent sees for a command: (truncated) output, then a status line with the
    exit code, or a line saying the command timed out after ``timeout`` seconds."""
    body = truncate_output(result.output, max_chars, result.omitted)
    if result.timed_out:
        status = f"[command timed out after {timeout:g} s; it was killed; output so far is above]"
    else:
        status = f"[exit code: {result.exit_code}]"
    return f"{body}\n{status}" if body else status


SWEBENCH_PIN = "swebench>=4.1,<5"


def swebench_harness() -> Any:
    """The SWE-bench harness modules this package drives (``swebench`` 4.x: ``make_test_spec``
    from ``harness.test_spec.test_spec``, ``run_instance(test_spec, pred, rm_image,
    force_rebuild, client, run_id, timeout)``, ``RUN_EVALUATION_LOG_DIR``) as one namespace.
    ``ImportError`` naming :data:`SWEBENCH_PIN` when it is missing, or when the installed
    version is 5 or later (its harness takes another dataset format: a prebuilt image and an
    eval script in every record) or lacks these names (the version and the reason said)."""
    import types

    try:
        import swebench
    except ImportError as exc:
        raise ImportError(
            f"the SWE-bench harness needs the 'swebench' package: pip install '{SWEBENCH_PIN}'"
        ) from exc
    version = str(getattr(swebench, "__version__", "?"))
    head = version.split(".")[0]
    if head.isdigit() and int(head) >= 5:
        raise ImportError(
            f"swebench {version} is installed; this recipe drives the 4.x harness (5.x takes "
            f"another dataset format: a prebuilt image and an eval script in every record): "
            f"pip install '{SWEBENCH_PIN}'"
        )
    try:
        from swebench.harness.constants import RUN_EVALUATION_LOG_DIR
        from swebench.harness.run_evaluation import run_instance
        from swebench.harness.test_spec.test_spec import make_test_spec
    except ImportError as exc:
        raise ImportError(
            f"swebench {version}: its harness lacks what this recipe drives ({exc}); "
            f"pip install '{SWEBENCH_PIN}'"
        ) from exc
    return types.SimpleNamespace(
        version=version,
        make_test_spec=make_test_spec,
        run_instance=run_instance,
        log_dir=RUN_EVALUATION_LOG_DIR,
    )


class Sandbox(ABC):
    """A repository the agent works in. Paths are relative to :attr:`root` (absolute paths
    must lie inside it)."""

    root: str

    @abstractmethod
    def exec(self, command: str, timeout: float) -> ExecResult:
        """Run ``command`` with bash in :attr:`root`; kill it after ``timeout`` seconds."""

    @abstractmethod
    def read_file(self, path: str) -> str:
        """The whole text of the file at ``path`` (bytes that are not UTF-8 as surrogate
        escapes, which :meth:`write_file` writes back as they were);
        ``FileNotFoundError`` if it does not exist, :class:`TooLarge` (a ``ValueError`` naming
        it) past :data:`MAX_WHOLE_CHARS`."""

    @abstractmethod
    def write_file(self, path: str, text: str) -> None:
        """Create or overwrite ``path`` with ``text`` (UTF-8, surrogate escapes as the bytes
        they stand for; parent folders are created). Text UTF-8 cannot hold (a lone surrogate
        such as half of an escaped emoji) is a ``ValueError`` and leaves the file as it was."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether ``path`` exists (file or folder)."""

    @abstractmethod
    def diff(self) -> str:
        """The repository's changes against its starting tree as a ``git diff`` patch
        (new files included, ``""`` when unchanged) that ``git apply`` accepts on that tree;
        :class:`TooLarge` past :data:`MAX_WHOLE_CHARS`."""

    @abstractmethod
    def clone(self) -> Sandbox:
        """An independent sandbox with the same current files."""

    @abstractmethod
    def close(self) -> None:
        """Release the sandbox's resources (idempotent)."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _too_large(path: str) -> TooLarge:
    return TooLarge(
        f"path: {path!r} is larger than {MAX_WHOLE_CHARS >> 20} MiB; look into it with bash "
        "(head, sed -n, grep)"
    )


def _utf8(what: str, text: str, after: str = "") -> bytes:
    """``text`` as UTF-8 (surrogate escapes as the bytes they stand for); ``ValueError`` naming
    ``what`` and the character UTF-8 cannot hold (a lone surrogate), then ``after``."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what}: {text[exc.start]!r} at index {exc.start} is not a character UTF-8 can "
            f"hold (a lone surrogate: half of an escaped pair?){after}"
        ) from None


def _file_bytes(path: str, text: str) -> bytes:
    """``text`` as the bytes :meth:`Sandbox.write_file` writes; ``ValueError`` naming the
    character and ``path`` where UTF-8 cannot hold it (before anything is written)."""
    return _utf8(f"text for {path!r}", text, "; the file is unchanged")


def _not_regular(path: str) -> ValueError:
    return ValueError(
        f"path: {path!r} is not a regular file (a named pipe, socket or device); look into it "
        "with bash"
    )


def _copy_entry(src: str, dst: str) -> None:
    """``copytree``'s copy of one non-folder entry for a sandbox clone: a named pipe is made
    anew (its reader would wait forever on a copy), a socket or device is left out (nothing
    can copy it; git records neither), a file removed while the tree is copied is skipped."""
    try:
        mode = os.lstat(src).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISFIFO(mode):
        os.mkfifo(dst, stat.S_IMODE(mode))
    elif stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        with contextlib.suppress(FileNotFoundError):
            shutil.copy2(src, dst, follow_symlinks=False)


def _patch_too_large() -> TooLarge:
    return TooLarge(
        f"the repository's changes are larger than {MAX_WHOLE_CHARS >> 20} MiB as a patch (a "
        "large file written into the repository?): remove what does not belong to the fix"
    )


_DIFF = (
    "diff --cached --binary --no-color --no-ext-diff --no-textconv --src-prefix=a/ --dst-prefix=b/"
)
# One file's diff as a binary patch: ``-diff`` for every path at the attributes' highest
# precedence ($GIT_DIR/info/attributes, restored after), so a repository's .gitattributes
# cannot turn it back into text.
_AS_BINARY = (
    "a=$(git rev-parse --git-path info/attributes) || exit 1; "
    'restore() { if [ -e "$a.harts" ]; then mv -f "$a.harts" "$a"; else rm -f "$a"; fi; }; '
    'rm -f "$a.harts"; mkdir -p "$(dirname "$a")" || exit 1; '
    'if [ -e "$a" ]; then cp -p "$a" "$a.harts" || exit 1; fi; '
    'printf "\\n* -diff\\n" >> "$a" || { restore; exit 1; }; '
    "{ @CMD@; }; rc=$?; restore; exit $rc"
)


def _is_utf8(text: str) -> bool:
    """Whether ``text`` (decoded with ``surrogateescape``) came from valid UTF-8 bytes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _staged_patch(bash: Callable[[str], ExecResult], where: str) -> str:
    """The changes against the start as a patch that ``git apply`` takes on the starting tree
    and whose text is valid UTF-8 (it is stored as a ``str`` field and written back as UTF-8):
    a changed file whose diff is not UTF-8 text (a Latin-1 source edited) becomes a binary
    patch of that file alone (exact bytes), every other file stays a text diff. Staged in the
    patch index, synced with the working tree once, before the first git command.
    ``bash(line)``: a bash line's result in the repository (``where``, named by a failure),
    its whole output decoded with ``surrogateescape``. Raises RuntimeError when a git command
    fails, :class:`TooLarge` when the patch is over ``MAX_WHOLE_CHARS``."""
    stage = _STAGE

    def run(script: str) -> str:
        nonlocal stage
        res = bash(_PATCH_INDEX + stage + script)
        stage = ""  # once, with the first command
        if res.exit_code != 0:
            raise RuntimeError(f"git diff failed in {where}: {res.output}")
        if res.omitted:
            raise _patch_too_large()
        return res.output

    patch = run(f"git {_DIFF} {_START_REF}")
    if _is_utf8(patch):
        return patch
    names = run(f"git diff --cached --name-only -z --no-renames {_START_REF}").split("\0")
    names = [name for name in names if name]
    # One section per file (a line that starts a section cannot occur inside one: hunk lines
    # start with ' ', '+', '-' or '\\', base85 lines hold no space); a file whose change git
    # splits in two (a type change) leaves the counts apart: then each file on its own.
    whole = run(f"git {_DIFF} --no-renames {_START_REF}")
    sections = [part for part in re.split(r"(?m)^(?=diff --git )", whole) if part]
    if len(sections) != len(names):
        sections = [None] * len(names)
    parts = []
    for name, part in zip(names, sections, strict=True):
        one = f"git --literal-pathspecs {_DIFF} --no-renames {_START_REF} -- {shlex.quote(name)}"
        part = run(one) if part is None else part
        parts.append(part if _is_utf8(part) else run(_AS_BINARY.replace("@CMD@", one)))
    patch = "".join(parts)
    if len(patch) > MAX_WHOLE_CHARS:
        raise _patch_too_large()
    if not _is_utf8(patch):  # a path name git printed raw (core.quotePath off in the image)
        raise RuntimeError("git diff: the patch names a path that is not UTF-8")
    return patch


def _inside(root: str, full: str) -> bool:
    return full == root or full.startswith(root.rstrip("/") + "/")


# Linux takes at most 128 KiB (MAX_ARG_STRLEN, its NUL included) in one argument: bash -c's
# command line is one (the container's also carries _PROFILE): the longest that fits both
MAX_COMMAND_BYTES = 128 * 1024 - 1 - len(_PROFILE.encode())


def _check_text(field: str, value: str) -> bytes:
    """``value`` as UTF-8; ValueError naming ``field`` for a NUL byte (no command line or path
    can hold one) or a character UTF-8 cannot hold (a lone surrogate)."""
    if "\0" in value:
        raise ValueError(f"{field}: contains a NUL byte at index {value.index(chr(0))}")
    return _utf8(field, value)


def _check_command(command: Any) -> str:
    """``command`` for :meth:`Sandbox.exec`: a non-empty string bash can take as its command
    line; ValueError naming ``command`` otherwise (too long: the way around it said)."""
    if not isinstance(command, str) or not command.strip():
        raise ValueError(f"command: expected a non-empty string, got {command!r}")
    size = len(_check_text("command", command))
    if size > MAX_COMMAND_BYTES:
        raise ValueError(
            f"command: {size} bytes, more than the {MAX_COMMAND_BYTES} a command line takes; "
            "write long file contents with the editor's create command, then run a short command"
        )
    return command


def _check_rel(root: str, path: str, field: str = "path") -> str:
    """``path`` resolved inside ``root``; ``ValueError`` naming ``field`` if it escapes (or
    holds a NUL byte or a lone surrogate)."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{field}: expected a non-empty path string, got {path!r}")
    _check_text(field, path)
    full = os.path.normpath(path if os.path.isabs(path) else os.path.join(root, path))
    if not _inside(root, full):
        raise ValueError(f"{field}: {path!r} is outside the repository root {root}")
    return full


def _check_real(root: str, path: str, field: str = "path") -> str:
    """:func:`_check_rel` on the local file system, symbolic links followed: a link inside
    ``root`` that points outside it is refused like the outside path itself."""
    full = _check_rel(root, path, field)
    if not _inside(os.path.realpath(root), os.path.realpath(full)):
        raise ValueError(
            f"{field}: {path!r} leads outside the repository root {root} (through a symbolic link)"
        )
    return full


def _inside_script(root: str, full: str) -> str:
    """A bash line that exits 3 with a message unless ``full``, symbolic links followed
    (``realpath -m``), lies inside ``root``: the container's own check of :func:`_check_real`."""
    r, f = shlex.quote(root.rstrip("/") or "/"), shlex.quote(full)
    return (
        f'p=$(realpath -m -- {f}) && r=$(realpath -m -- {r}) && case "$p" in "$r"|"$r"/*) ;; '
        f'*) echo "leads outside the repository root (through a symbolic link)" >&2; exit 3;; '
        "esac"
    )


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a member (signal 0 probes without sending)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal: not ours to kill either
        return False
    return True


def _run(
    args: list[str],
    cwd: str | None,
    timeout: float,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
    groups: list[int] | None = None,
    max_chars: int = MAX_READ_CHARS,
    errors: str = "replace",
) -> ExecResult:
    """Run ``args`` in a new session, reading its combined output (at most ``max_chars``
    characters kept, the rest counted in ``omitted``) until it ends and closes it; ``errors``: how bytes that are not
    UTF-8 decode (``surrogateescape`` gives them back on encoding). After ``timeout`` seconds
    the whole process group is killed, and a process that left the group and still holds the
    output open is no longer waited for (timed out). ``groups`` collects the process group id,
    for the caller to kill what the command left running."""
    data_in = stdin.encode("utf-8", errors="surrogateescape") if stdin is not None else b""
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    if groups is not None:
        groups.append(proc.pid)
    half = max(max_chars // 2, 1)
    head: list[str] = []
    tail: list[str] = []
    state = {"head": 0, "tail": 0, "omitted": 0}
    lock = threading.Lock()

    def read() -> None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        decoder = codecs.getincrementaldecoder("utf-8")(errors=errors)
        while True:
            data = os.read(fd, 1 << 16)  # what is there now: nothing waits for a full buffer
            chunk = decoder.decode(data, final=not data)
            with lock:
                room = half - state["head"]
                if room > 0:
                    head.append(chunk[:room])
                    state["head"] += len(head[-1])
                    chunk = chunk[room:]
                if chunk:
                    tail.append(chunk)
                    state["tail"] += len(chunk)
                    while state["tail"] - len(tail[0]) >= half:  # drop whole old pieces
                        state["tail"] -= len(tail[0])
                        state["omitted"] += len(tail.pop(0))
            if not data:
                return

    def write() -> None:  # its own thread: a command that never reads cannot block the caller
        assert proc.stdin is not None
        try:
            proc.stdin.write(data_in)
        except OSError:  # BrokenPipeError included: the command exited without reading it all
            pass
        finally:
            with contextlib.suppress(OSError):
                proc.stdin.close()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    if stdin is not None:
        threading.Thread(target=write, daemon=True).start()
    timed_out = False
    try:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            reader.join(max(deadline - time.monotonic(), 0.0))
            timed_out = reader.is_alive()  # a background process still holds the output open
        except subprocess.TimeoutExpired:
            timed_out = True
    finally:  # also on any exception here: never leave the command running
        if timed_out or proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(2.0)  # a process outside the group may keep the pipe: not waited for
        if not reader.is_alive():
            with contextlib.suppress(OSError):
                proc.stdout.close()  # type: ignore[union-attr]
    with lock:
        over = max(state["tail"] - half, 0)  # trim the tail to its half, counting the cut
        text = "".join(head) + "".join(tail)[over:]
        omitted = state["omitted"] + over
    if timed_out:
        return ExecResult(text, None, True, omitted)
    return ExecResult(text, proc.returncode, False, omitted)


class LocalSandbox(Sandbox):
    """A temporary copy of ``source`` (a folder) in which a git repository records the start.

    Commands run as local subprocesses (``bash -c``) with the sandbox as working directory and
    ``HOME`` unchanged; this is for trusted fixtures and tests, not for untrusted code.
    """

    def __init__(self, source: str, *, _copy: bool = True) -> None:
        if not os.path.isdir(source):
            raise ValueError(f"source: {source!r} is not a directory")
        self.root = tempfile.mkdtemp(prefix="harts_sandbox_")
        self._closed = False
        self._groups: list[int] = []  # process groups of exec'd commands, killed on close
        try:
            if _copy:
                self._start(source)
        except BaseException:
            self.close()
            raise

    def _start(self, source: str) -> None:
        shutil.copytree(source, self.root, dirs_exist_ok=True)
        if not os.path.isdir(os.path.join(self.root, ".git")):
            self._git("init", "-q")
            with open(os.path.join(self.root, ".git", "info", "exclude"), "a") as f:
                f.write(_EXCLUDE)
            self._git("add", "-A")
            self._git(*_GIT_ID, "commit", "-q", "--allow-empty", "-m", "sandbox start")
        res = _run(["bash", "-c", _MARK_START], self.root, 60)
        if res.exit_code != 0:
            raise RuntimeError(f"git update-ref failed in {self.root}: {res.output}")

    def _git(self, *args: str, whole: bool = False) -> str:
        limit = MAX_WHOLE_CHARS if whole else MAX_READ_CHARS
        res = _run(["git", *args], self.root, 60, max_chars=limit)
        if whole and res.omitted:
            raise _patch_too_large()
        if res.exit_code != 0:
            raise RuntimeError(f"git {' '.join(args)} failed in {self.root}: {res.output}")
        return res.output

    def exec(self, command: str, timeout: float) -> ExecResult:
        _check_command(command)
        if timeout <= 0:
            raise ValueError(f"timeout: expected > 0, got {timeout}")
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", GIT_PAGER="cat", PAGER="cat")
        res = _run(["bash", "-c", command], self.root, timeout, env=env, groups=self._groups)
        # keep only groups with a live member: an ended group's id may be reused by others
        self._groups = [g for g in self._groups if _group_alive(g)]
        return res

    def read_file(self, path: str) -> str:
        full = _check_real(self.root, path)
        # O_NONBLOCK: opening a named pipe must not wait for a writer (it hung the call)
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)
        try:  # checked before fdopen, which fails on a folder without closing the fd
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            if not stat.S_ISREG(info.st_mode):
                raise _not_regular(path)
            if info.st_size > MAX_WHOLE_CHARS:
                raise _too_large(path)
            os.set_blocking(fd, True)
            raw = os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise
        with raw:
            data = raw.read()
        return data.decode("utf-8", "surrogateescape")  # line endings as stored

    def write_file(self, path: str, text: str) -> None:
        full = _check_real(self.root, path)
        data = _file_bytes(path, text)  # first: a failed encoding must not empty the file
        try:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(data)
        except (FileExistsError, NotADirectoryError):  # a file where a folder should be
            raise ValueError(f"path: {path!r}: a part of it before the name is a file") from None
        except IsADirectoryError:
            raise ValueError(f"path: {path!r} is a folder") from None

    def exists(self, path: str) -> bool:
        return os.path.exists(_check_real(self.root, path))

    def diff(self) -> str:
        def bash(line: str) -> ExecResult:
            return _run(
                ["bash", "-c", line],
                self.root,
                60,
                max_chars=MAX_WHOLE_CHARS,
                errors="surrogateescape",
            )

        return _staged_patch(bash, self.root)

    def clone(self) -> LocalSandbox:
        other = LocalSandbox(self.root, _copy=False)
        try:
            shutil.copytree(
                self.root, other.root, dirs_exist_ok=True, symlinks=True, copy_function=_copy_entry
            )
        except BaseException:
            other.close()  # no folder left behind
            raise
        return other

    def close(self) -> None:
        """Kill what the sandbox's commands left running (background processes: their process
        groups), then remove its folder."""
        if not self._closed:
            self._closed = True
            for pgid in self._groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
            shutil.rmtree(self.root, ignore_errors=True)


class DockerSandbox(Sandbox):
    """A running container of ``image`` (working folder ``workdir``, default SWE-bench's
    ``/testbed``), driven by the ``docker`` CLI. The image's repository must be a git checkout
    at the task's base commit (SWE-bench instance images are).

    :meth:`from_swebench` derives the image from a SWE-bench instance with the ``swebench``
    package (``pip install 'swebench>=4.1,<5'``); a clear ``ImportError`` names it when it is missing.
    """

    def __init__(self, image: str, workdir: str = "/testbed", docker: str = "docker") -> None:
        if not image:
            raise ValueError("image: expected a docker image name")
        if shutil.which(docker) is None:
            raise RuntimeError(f"docker: the '{docker}' command is not installed or not on PATH")
        self.image, self.root, self.docker = image, workdir, docker
        self.name = f"harts-sbx-{uuid.uuid4().hex[:12]}"
        self._closed = False
        self._images: list[str] = []  # committed clone images owned by this sandbox
        try:
            res = _run(
                [
                    docker,
                    "run",
                    "-d",
                    "--name",
                    self.name,
                    # a worker killed without its exit handlers (SIGKILL, the OOM killer) leaves
                    # its containers running: `docker ps -f label=harts-verl.sandbox` finds them
                    "--label",
                    "harts-verl.sandbox=1",
                    "--label",
                    f"harts-verl.owner={socket.gethostname()}:{os.getpid()}",
                    "-w",
                    workdir,
                    image,
                    "sleep",
                    "infinity",
                ],
                None,
                600,
            )
            if res.exit_code != 0:
                raise RuntimeError(f"docker run {image} failed: {res.output.strip()}")
            self._exec(["bash", "-c", f"printf '{_EXCLUDE}' >> .git/info/exclude"], 60)
            res = self._exec(["bash", "-c", _MARK_START], 60)
            if res.exit_code != 0:
                raise RuntimeError(f"git update-ref failed in {self.name}: {res.output.strip()}")
        except BaseException:
            # a container created (a failed start leaves one; a timed-out run may still make
            # one) or started whose setup failed is removed, not left running `sleep infinity`
            self.close()
            raise

    @classmethod
    def from_swebench(
        cls, instance: dict, namespace: str | None = "swebench", tag: str = "latest"
    ) -> DockerSandbox:
        """A sandbox on the SWE-bench instance image of ``instance`` (a dataset record; the
        harness: :func:`swebench_harness`)."""
        harness = swebench_harness()
        spec = harness.make_test_spec(instance, namespace=namespace, instance_image_tag=tag)
        return cls(spec.instance_image_key)

    def _exec(
        self, args: list[str], timeout: float, stdin: str | None = None, **read: Any
    ) -> ExecResult:
        """``docker exec`` of ``args``; ``read``: :func:`_run`'s ``max_chars`` / ``errors``."""
        flags = ["-i"] if stdin is not None else []
        return _run(
            [self.docker, "exec", *flags, "-w", self.root, self.name, *args],
            None,
            timeout,
            stdin,
            **read,
        )

    def exec(self, command: str, timeout: float) -> ExecResult:
        _check_command(command)
        # `timeout` inside the container kills the command; the outer limit guards docker itself.
        # Its kill exits 137 (124 without -s KILL): a timeout only if the time was used up, not
        # a command that exits 124 or is killed (137, e.g. out of memory) early by itself.
        start = time.monotonic()
        res = self._exec(
            ["timeout", "-s", "KILL", f"{timeout:g}", "bash", "-c", _PROFILE + command],
            timeout + 30,
        )
        used_up = time.monotonic() - start >= timeout
        if res.timed_out or (res.exit_code in (124, 137, -9) and used_up):
            return ExecResult(res.output, None, True, res.omitted)
        return res

    def _on_path(self, path: str, then: str, stdin: str | None = None, **read: Any) -> ExecResult:
        """Run the bash line ``then`` on ``path`` (its quoted full path as ``$f``) after the
        container's symlink check of it, which raises ``ValueError`` naming the path."""
        full = _check_rel(self.root, path)
        script = f"{_inside_script(self.root, full)} && f={shlex.quote(full)} && {then}"
        res = self._exec(["bash", "-c", script], 60, stdin=stdin, **read)
        if res.exit_code == 3:
            raise ValueError(f"path: {path!r} {res.output.strip()}")
        return res

    def read_file(self, path: str) -> str:
        # whole (an edit writes it back), stdout alone: a read error is no file text
        res = self._on_path(
            path,
            '{ [ ! -e "$f" ] || [ -f "$f" ] || [ -d "$f" ] || exit 4; } && cat -- "$f" 2>/dev/null',
            max_chars=MAX_WHOLE_CHARS,
            errors="surrogateescape",
        )
        if res.exit_code == 4:
            raise _not_regular(path)
        if res.exit_code != 0:
            raise FileNotFoundError(path)
        if res.omitted:
            raise _too_large(path)
        return res.output

    def write_file(self, path: str, text: str) -> None:
        _file_bytes(path, text)  # a named error before the container's file is touched
        res = self._on_path(path, 'mkdir -p -- "$(dirname -- "$f")" && cat > "$f"', stdin=text)
        if res.exit_code != 0:
            raise OSError(f"writing {path} failed: {res.output}")

    def exists(self, path: str) -> bool:
        return self._on_path(path, 'test -e "$f"').exit_code == 0

    def diff(self) -> str:
        def bash(line: str) -> ExecResult:
            return self._exec(
                ["bash", "-c", line], 120, max_chars=MAX_WHOLE_CHARS, errors="surrogateescape"
            )

        return _staged_patch(bash, self.name)

    def clone(self) -> DockerSandbox:
        image = f"harts-sbx-clone:{uuid.uuid4().hex[:12]}"
        res = _run([self.docker, "commit", self.name, image], None, 600)
        if res.exit_code != 0:
            raise RuntimeError(f"docker commit {self.name} failed: {res.output.strip()}")
        try:
            other = DockerSandbox(image, self.root, self.docker)
        except BaseException:
            _run([self.docker, "rmi", "-f", image], None, 120)
            raise
        other._images.append(image)
        return other

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _run([self.docker, "rm", "-f", self.name], None, 120)
        for image in self._images:
            _run([self.docker, "rmi", "-f", image], None, 120)
