"""veRL tools for a SWE agent: ``bash``, ``str_replace_editor``, ``submit`` (``BaseTool``s).

Declare them in a veRL tool config (``rollout.multi_turn.tool_config_path``; see
``recipes/swebench/tools.yaml``)::

    tools:
      - class_name: harts_verl.workers.envs.swe_tools.BashTool
        config: {type: native, sandbox: local, timeout: 60, max_output_chars: 8000}

Per-trajectory state lives in the trajectory's ``AgentData.extra_fields`` (veRL's place for
tool session data), so fork sampling copies it:

* ``swe_sandbox``: a :class:`SandboxRef`, the key of the trajectory's sandbox in this
  process's :data:`POOL`. The first tool call starts the sandbox from the row's
  ``create_kwargs`` (``instance_id``, ``fixture``, ``record``). ``copy.deepcopy`` of the ref
  (what a fork does to ``extra_fields``) clones the sandbox, so every branch edits its own
  copy; pickling gives a plain string; the sandbox is closed when the ref is garbage
  collected, on ``submit``, or at process exit.
* ``swe_patch``: the sandbox's ``git diff`` after every call that may change files; the
  reward (:func:`harts_verl.workers.envs.swe.compute_score`) grades it, so grading needs no
  access to the sandbox. ``swe_submitted``: set by ``submit``.

Invalid arguments raise ``ValueError`` naming the argument; veRL's ``ToolAgentLoop`` returns
the message to the model as the tool's answer.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shlex
import threading
import weakref
from typing import Any, ClassVar

from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from harts_verl.workers.envs.sandbox import (
    DockerSandbox,
    LocalSandbox,
    Sandbox,
    TooLarge,
    format_exec_result,
    truncate_output,
)
from harts_verl.workers.envs.swe import NAMESPACE_KEY, fixture_repo
from harts_verl.workers.rollout.agent_loop import TrajectoryTool

__all__ = [
    "PATCH_KEY",
    "POOL",
    "SANDBOX_KEY",
    "SUBMITTED_KEY",
    "BashTool",
    "EditTool",
    "SandboxPool",
    "SandboxRef",
    "SubmitTool",
    "SweToolConfig",
]

# per trajectory state (AgentData, by identity): the lock its tool calls run under
_CALL_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

SANDBOX_KEY = "swe_sandbox"
PATCH_KEY = "swe_patch"
SUBMITTED_KEY = "swe_submitted"


class SandboxPool:
    """Sandboxes of this process by key (thread-safe)."""

    def __init__(self) -> None:
        self._boxes: dict[str, Sandbox] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._closing: list[threading.Thread] = []  # background closes (joined at exit)
        self._exiting = False  # close_all ran: close in the caller's thread from now on

    def add(self, box: Sandbox) -> SandboxRef:
        """Register ``box``; the returned ref owns it."""
        with self._lock:
            self._next += 1
            key = f"sbx{self._next}-{id(box):x}"
            self._boxes[key] = box
        return SandboxRef(key)

    def get(self, key: str) -> Sandbox | None:
        with self._lock:
            return self._boxes.get(str(key))

    def close(self, key: str) -> None:
        """Close and forget the sandbox ``key`` (no-op when unknown)."""
        with self._lock:
            box = self._boxes.pop(str(key), None)
        if box is not None:
            box.close()

    def close_in_background(self, key: str) -> None:
        """Forget the sandbox ``key`` now and close it on a thread of its own: a container's
        ``docker rm`` (up to minutes) must not block the thread that dropped the last ref,
        often an agent worker's event loop. At exit (:meth:`close_all` waits for those
        threads) or where no thread can start, it is closed here."""
        with self._lock:
            box = self._boxes.pop(str(key), None)
            exiting = self._exiting
        if box is None:
            return
        if not exiting:
            thread = threading.Thread(target=box.close, name=f"close-{key}", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # interpreter shutdown: no new threads
                pass
            else:
                with self._lock:
                    self._closing = [t for t in self._closing if t.is_alive()] + [thread]
                return
        box.close()

    def close_all(self) -> None:
        """Close every sandbox, and wait for those closing in the background (at exit)."""
        with self._lock:
            boxes, self._boxes = list(self._boxes.values()), {}
            closing, self._exiting = list(self._closing), True
        for box in boxes:
            box.close()
        for thread in closing:
            thread.join()

    def __len__(self) -> int:
        return len(self._boxes)


POOL = SandboxPool()
atexit.register(POOL.close_all)


class SandboxRef(str):
    """Key of a pooled sandbox (a ``str``, so veRL and TransferQueue store it as one).

    ``copy.deepcopy`` clones the sandbox and returns a ref to the clone; ``copy.copy`` and
    pickling give a plain ``str`` (no ownership); when this object is collected the sandbox is
    closed (on a thread of its own: :meth:`SandboxPool.close_in_background`).
    """

    __slots__ = ()

    def __deepcopy__(self, memo: dict) -> str:
        box = POOL.get(self)
        return POOL.add(box.clone()) if box is not None else str(self)

    def __reduce__(self) -> tuple:
        return (str, (str(self),))

    def __del__(self) -> None:
        try:
            POOL.close_in_background(str(self))
        except Exception:  # interpreter shutdown
            pass


class SweToolConfig:
    """The ``config`` of a SWE tool: ``sandbox`` (``local`` = bundled fixture copy, ``docker``
    = SWE-bench instance image), ``timeout`` (s per command), ``max_output_chars``,
    ``docker_namespace`` (SWE-bench image namespace, default ``swebench``; ``null``: the local
    image names, images built beforehand with the SWE-bench harness; the reward grades in the
    same images: ``extra_fields["swe_docker_namespace"]``)."""

    KEYS: ClassVar[set[str]] = {
        "type",
        "sandbox",
        "timeout",
        "max_output_chars",
        "docker_namespace",
    }

    def __init__(self, config: dict[str, Any] | None) -> None:
        cfg = dict(config or {})
        unknown = set(cfg) - self.KEYS
        if unknown:
            raise ValueError(f"config.{sorted(unknown)[0]}: unknown SWE tool option")
        self.sandbox = str(cfg.get("sandbox", "local"))
        if self.sandbox not in ("local", "docker"):
            raise ValueError(f"config.sandbox: expected 'local' or 'docker', got {self.sandbox!r}")
        self.timeout = float(cfg.get("timeout", 60))
        if self.timeout <= 0:
            raise ValueError(f"config.timeout: expected > 0, got {self.timeout}")
        self.max_output_chars = int(cfg.get("max_output_chars", 8000))
        if self.max_output_chars <= 0:
            raise ValueError(f"config.max_output_chars: expected > 0, got {self.max_output_chars}")
        self.docker_namespace = cfg.get("docker_namespace", "swebench")


def _schema(name: str, description: str, properties: dict, required: list[str]) -> Any:
    return OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {"type": "object", "properties": properties, "required": required},
            },
        }
    )


class _SweTool(TrajectoryTool):
    """Shared lifecycle: ``create`` keeps the row's ``create_kwargs`` for the call, the sandbox
    comes from (or is started into) the trajectory's ``extra_fields``."""

    NAME: ClassVar[str] = ""
    MUTATES: ClassVar[bool] = True
    STATE = "SWE tools keep their sandbox"

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: Any = None) -> None:
        self.cfg = SweToolConfig(config)
        super().__init__(config or {}, tool_schema or self.default_schema(self.cfg))

    @classmethod
    def default_schema(cls, cfg: SweToolConfig) -> Any:
        raise NotImplementedError

    def _start(self, create: dict[str, Any]) -> Sandbox:
        if self.cfg.sandbox == "local":
            if not create.get("fixture"):
                raise ValueError(
                    "create_kwargs.fixture: the local sandbox runs bundled fixtures only "
                    f"(instance {create.get('instance_id')!r} has none; use sandbox: docker)"
                )
            return LocalSandbox(fixture_repo(create["fixture"]))
        record = create.get("record")
        if not record:
            raise ValueError("create_kwargs.record: the docker sandbox needs the SWE-bench record")
        record = json.loads(record) if isinstance(record, str) else dict(record)
        return DockerSandbox.from_swebench(record, namespace=self.cfg.docker_namespace)

    def _sandbox(self, instance_id: str, agent_data: Any) -> Sandbox:
        fields = agent_data.extra_fields
        if fields.get(SUBMITTED_KEY):
            raise ValueError(f"{self.name}: the patch was already submitted")
        box = POOL.get(fields[SANDBOX_KEY]) if fields.get(SANDBOX_KEY) else None
        if box is None:
            box = self._start(self._kwargs.get(instance_id, {}))
            fields[SANDBOX_KEY] = POOL.add(box)
            if self.cfg.sandbox == "docker":  # the reward grades in the same images
                fields[NAMESPACE_KEY] = self.cfg.docker_namespace
        return box

    def run(self, box: Sandbox, parameters: dict[str, Any]) -> str:
        """The tool's answer text (blocking; runs in a worker thread)."""
        raise NotImplementedError

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        agent_data = self._agent_data(kwargs)
        self._check_parameters(parameters)
        self._check_known(parameters)
        # One call at a time per trajectory: a turn's calls run together when
        # max_parallel_calls > 1, and must neither each start a sandbox of their own nor run
        # git in the same repository at once. Starting a sandbox (a docker run, an image pull)
        # and the call itself block: worker threads, not the event loop.
        async with _call_lock(agent_data):
            box = await asyncio.to_thread(self._sandbox, instance_id, agent_data)
            text = await self._call(box, parameters, agent_data)
        return ToolResponse(text=text), 0.0, {}

    async def _call(self, box: Sandbox, parameters: dict[str, Any], agent_data: Any) -> str:
        """The call's answer: :meth:`run`, then (a tool that may change files) the sandbox's
        patch recorded in ``extra_fields``."""
        text = await asyncio.to_thread(self.run, box, parameters)
        if self.MUTATES:
            try:
                agent_data.extra_fields[PATCH_KEY] = await asyncio.to_thread(box.diff)
            except TooLarge as exc:  # no patch (it scores 0) until the agent cleans up
                agent_data.extra_fields[PATCH_KEY] = ""
                text = f"{text}\n[{exc}]"
            except (RuntimeError, OSError) as exc:
                # the call itself worked: its answer stands, with why the patch could not be
                # taken (e.g. a nested repository without a commit, a stale index.lock); no
                # patch (it scores 0) until the agent fixes it
                agent_data.extra_fields[PATCH_KEY] = ""
                text = f"{text}\n[the repository's changes could not be recorded: {exc}]"
        return text


# the arguments of each editor command (the schema declares their union)
_EDIT_ARGS: dict[str, frozenset[str]] = {
    "view": frozenset({"path", "view_range"}),
    "create": frozenset({"path", "file_text"}),
    "str_replace": frozenset({"path", "old_str", "new_str"}),
}


def _occurrences(text: str, part: str) -> int:
    """How many times ``part`` starts in ``text``, overlapping ones counted (``str.count``
    counts ``"aa"`` once in ``"aaa"``: an ambiguous ``old_str`` passed as unique)."""
    n, at = 0, text.find(part)
    while at >= 0 and n < 2:  # unique or not is all that matters
        n += 1
        at = text.find(part, at + 1)
    return n


def _call_lock(agent_data: Any) -> asyncio.Lock:
    """The trajectory's lock (a fresh one for an agent state that takes no weak reference)."""
    try:
        return _CALL_LOCKS.setdefault(agent_data, asyncio.Lock())
    except TypeError:
        return asyncio.Lock()


def _str_arg(parameters: dict[str, Any], name: str, required: bool = True) -> str | None:
    value = parameters.get(name)
    if value is None:
        if required:
            raise ValueError(f"{name}: missing required argument")
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected a string, got {type(value).__name__}")
    return value


class BashTool(_SweTool):
    """``bash(command)``: run a command in the repository root. The answer is the combined
    output (middle truncated with a notice past ``max_output_chars``) and a status line: the
    exit code, or that the command timed out after ``timeout`` s and was killed."""

    NAME = "bash"

    @classmethod
    def default_schema(cls, cfg: SweToolConfig) -> Any:
        return _schema(
            cls.NAME,
            f"Run a bash command in the repository root (killed after {cfg.timeout:g} s; long "
            "output is truncated in the middle).",
            {"command": {"type": "string", "description": "the command to run"}},
            ["command"],
        )

    def run(self, box: Sandbox, parameters: dict[str, Any]) -> str:
        command = _str_arg(parameters, "command")
        if not command.strip():
            raise ValueError("command: expected a non-empty command")
        res = box.exec(command, self.cfg.timeout)
        return format_exec_result(res, self.cfg.max_output_chars, self.cfg.timeout)


class EditTool(_SweTool):
    """``str_replace_editor(command, path, ...)``: ``view`` a file (numbered lines) or folder,
    ``create`` a new file (``file_text``), ``str_replace`` a unique ``old_str`` by ``new_str``."""

    NAME = "str_replace_editor"
    COMMANDS: ClassVar[tuple[str, ...]] = ("view", "create", "str_replace")

    @classmethod
    def default_schema(cls, cfg: SweToolConfig) -> Any:
        return _schema(
            cls.NAME,
            "View, create and edit files. `view` shows a file with line numbers (or lists a "
            "folder); `create` writes a new file; `str_replace` replaces the unique occurrence "
            "of `old_str` by `new_str`. Paths are relative to the repository root.",
            {
                "command": {"type": "string", "enum": list(cls.COMMANDS)},
                "path": {"type": "string"},
                "file_text": {"type": "string"},
                "old_str": {"type": "string"},
                "new_str": {"type": "string"},
                "view_range": {
                    "type": "array",
                    "description": "view of a file: two integers [first, last], the lines to "
                    "show (1-based; last -1 = to the end)",
                },
            },
            ["command", "path"],
        )

    def run(self, box: Sandbox, parameters: dict[str, Any]) -> str:
        command = _str_arg(parameters, "command")
        if command not in self.COMMANDS:
            raise ValueError(f"command: expected one of {list(self.COMMANDS)}, got {command!r}")
        # an argument of another command is refused, not ignored (a str_replace with its new
        # text in file_text deleted old_str)
        stray = sorted(  # a null is an argument left out (models send every field)
            k
            for k, v in parameters.items()
            if v is not None and k not in _EDIT_ARGS[command] and k != "command"
        )
        if stray:
            raise ValueError(
                f"{', '.join(stray)}: not an argument of the {command} command (it takes "
                f"{', '.join(sorted(_EDIT_ARGS[command]))})"
            )
        path = _str_arg(parameters, "path")
        limit = self.cfg.max_output_chars
        if command == "view":
            if not box.exists(path):
                raise ValueError(f"path: {path!r} does not exist")
            # "./" first: a name starting with "-" must not read as an option of test / find
            # (a folder "-delete" made `find -delete ...` wipe the repository)
            rel = "." if os.path.normpath(path) == "." else "./" + path  # "." lists ./x
            arg = shlex.quote(path if path.startswith("/") else rel)
            res = box.exec(f"test -d {arg}", self.cfg.timeout)
            if res.exit_code == 0:
                if parameters.get("view_range") is not None:
                    raise ValueError(f"view_range: {path!r} is a folder; it applies to files")
                listing = box.exec(
                    # -H: a symlinked folder is listed, not the link alone
                    f"find -H {arg} -maxdepth 2 -not -path '*/.git' -not -path '*/.git/*' | sort",
                    self.cfg.timeout,
                )
                return truncate_output(listing.output, limit)
            lines = _lines(box.read_file(path))
            if not lines and parameters.get("view_range") is None:
                return f"{path} is empty (0 lines)."
            lo, hi = _view_range(parameters.get("view_range"), len(lines), path)
            return truncate_output(
                "\n".join(f"{i + 1:6d}\t{lines[i]}" for i in range(lo, hi)), limit
            )
        if command == "create":
            text = _str_arg(parameters, "file_text")
            if box.exists(path):
                raise ValueError(f"path: {path!r} already exists (use str_replace to edit it)")
            box.write_file(path, text)
            return f"Created {path} ({len(text.splitlines())} lines)."
        old = _str_arg(parameters, "old_str")
        new = _str_arg(parameters, "new_str", required=False) or ""
        if not old:
            raise ValueError("old_str: expected a non-empty string")
        if not box.exists(path):
            raise ValueError(f"path: {path!r} does not exist")
        arg = shlex.quote(path if path.startswith("/") else "./" + path)
        if box.exec(f"test -d {arg}", self.cfg.timeout).exit_code == 0:
            raise ValueError(f"path: {path!r} is a folder; str_replace edits a file")
        text = box.read_file(path)
        if "\r\n" in text and text.count("\r\n") == text.count("\n"):
            # a CRLF file, shown without its \r by view: what the agent copies from there
            # matches, and the lines it writes keep the file's line ends
            old = old if "\r" in old else old.replace("\n", "\r\n")
            new = new if "\r" in new else new.replace("\n", "\r\n")
        count = _occurrences(text, old)
        if count != 1:
            where = "does not occur" if count == 0 else "occurs more than once"
            raise ValueError(f"old_str: {where} in {path}; it must occur exactly once")
        edited = text.replace(old, new, 1)
        box.write_file(path, edited)
        start = text.index(old)
        first = text.count("\n", 0, start)
        new_lines = _lines(edited)  # what was written: no second read of the whole file
        lo, hi = max(first - 3, 0), min(first + new.count("\n") + 4, len(new_lines))
        snippet = "\n".join(f"{i + 1:6d}\t{new_lines[i]}" for i in range(lo, hi))
        return f"Edited {path}. Lines {lo + 1}-{hi} now read:\n{snippet}"


def _lines(text: str) -> list[str]:
    """The lines of a file's ``text`` as an agent sees them, numbered as ``grep -n`` / ``sed``
    count (split at ``\\n`` only, a line's ``\\r`` dropped), bytes that are not UTF-8 (surrogate
    escapes of :meth:`Sandbox.read_file`) as U+FFFD; the file itself keeps them."""
    shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    lines = shown.split("\n")
    if lines and lines[-1] == "":  # the final newline ends the last line
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _view_range(value: Any, n: int, path: str) -> tuple[int, int]:
    """The 0-based line slice ``[lo, hi)`` of ``view_range`` ([first, last], 1-based, last -1
    = the end; None = the whole file) over ``n`` lines; ``ValueError`` naming it otherwise."""
    if value is None:
        return 0, n
    ok = (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )
    first, last = value if ok else (0, 0)
    if ok and n == 0:
        raise ValueError(f"view_range: {path} is empty (0 lines); view it without a range")
    if not ok or not 1 <= first <= n or not (last == -1 or first <= last):
        raise ValueError(
            f"view_range: expected [first, last] with 1 <= first <= {n} (the lines of {path}) "
            f"and last >= first or -1, got {value!r}"
        )
    return first - 1, n if last == -1 else min(last, n)


def changed_lines(patch: str) -> int:
    """Lines a ``git diff`` patch adds or removes: ``+`` / ``-`` lines inside its hunks (a
    file's ``---`` / ``+++`` header lines are not changes; a binary patch has no hunk)."""
    n, in_hunk = 0, False
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            in_hunk = False
        elif line.startswith("@@"):
            in_hunk = True
        elif in_hunk and line.startswith(("+", "-")):
            n += 1
    return n


class SubmitTool(_SweTool):
    """``submit()``: record the final patch (``swe_patch``), mark the trajectory submitted and
    close its sandbox. Later tool calls of the trajectory are refused."""

    NAME = "submit"
    MUTATES = False

    @classmethod
    def default_schema(cls, cfg: SweToolConfig) -> Any:
        return _schema(
            cls.NAME, "Submit the current changes of the repository as your solution.", {}, []
        )

    def run(self, box: Sandbox, parameters: dict[str, Any]) -> str:
        return box.diff()

    async def _call(self, box: Sandbox, parameters: dict[str, Any], agent_data: Any) -> str:
        try:
            patch = await asyncio.to_thread(box.diff)
        except (TooLarge, RuntimeError, OSError) as exc:  # not submitted: the agent can fix it
            return f"Cannot submit: {exc}. Fix the repository and submit again."
        fields = agent_data.extra_fields
        fields[PATCH_KEY] = patch
        fields[SUBMITTED_KEY] = True
        ref = fields.pop(SANDBOX_KEY, None)
        if ref is not None:
            await asyncio.to_thread(POOL.close, ref)
        n = changed_lines(patch)
        return f"Submitted a patch with {n} changed lines." if patch else "Submitted: no changes."
