"""SWE-bench adapter on the bundled ``tinycalc`` fixture (CPU, no network, no docker).

Pins: the local sandbox runs commands with a reported timeout and truncation notice, refuses
paths outside the repository, clones independently and diffs against its start; records are
validated field by field; grading gives 1 for the gold patch and 0 for no / wrong / breaking
patches; the veRL tools edit the sandbox, record the patch, clone on fork (deepcopy) and refuse
calls after ``submit``; the fixture task run through ``HartsToolAgentLoop`` with fork sampling
and a scripted server yields one resolved and one unresolved branch.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from harts_verl.workers.envs import swe
from harts_verl.workers.envs.sandbox import (
    ExecResult,
    LocalSandbox,
    format_exec_result,
    truncate_output,
)

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "swebench"
OLD = '    """Arithmetic mean of a sequence of numbers."""\n'
FIX = OLD + '    if not xs:\n        raise ValueError("mean of an empty sequence")\n'
WRONG = OLD + "    if not xs:\n        return 0\n"


@pytest.fixture(scope="module")
def inst() -> swe.SweInstance:
    (i,) = swe.fixture_instances()
    return i


@pytest.fixture
def box(inst):
    with LocalSandbox(swe.fixture_repo(inst.fixture)) as b:
        yield b


# ---------------------------------------------------------------------- sandbox
def test_truncation_says_what_it_cut():
    text = "".join(f"line {i}\n" for i in range(1000))
    out = truncate_output(text, 200)
    assert out.startswith("line 0\n") and out.endswith("line 999\n")
    assert f"output truncated: {len(text) - 200} of {len(text)} characters omitted" in out
    assert truncate_output("short", 200) == "short"
    with pytest.raises(ValueError, match="max_chars"):
        truncate_output("x", 0)
    assert format_exec_result(ExecResult("ok", 3), 100, 5).endswith("[exit code: 3]")
    assert "timed out after 5 s" in format_exec_result(ExecResult("", None, True), 100, 5)


def test_local_sandbox_exec_timeout_paths_diff_clone(box):
    res = box.exec("python -c 'print(6*7)'; exit 4", 30)
    assert res.output.strip() == "42" and res.exit_code == 4 and not res.timed_out
    t = time.monotonic()
    res = box.exec("echo started; sleep 30", 1.0)
    assert res.timed_out and res.exit_code is None and "started" in res.output
    assert time.monotonic() - t < 15  # the process group was killed, not waited for
    for bad in ("../outside.txt", "/etc/passwd"):
        with pytest.raises(ValueError, match="path"):
            box.read_file(bad)
    with pytest.raises(ValueError, match="command"):
        box.exec("  ", 5)
    assert box.diff() == ""
    box.exec("python -c 'import tinycalc'", 30)  # creates no __pycache__ in the patch
    box.write_file("notes/new.txt", "hello\n")
    other = box.clone()
    try:
        other.write_file("tinycalc/stats.py", "broken\n")
        assert "broken" not in box.read_file("tinycalc/stats.py")
        assert "notes/new.txt" in box.diff() and "stats.py" not in box.diff()
        assert "stats.py" in other.diff() and "notes/new.txt" in other.diff()
    finally:
        other.close()
    assert "__pycache__" not in box.diff()


def test_local_sandbox_symlinks_cannot_lead_outside(box, tmp_path):
    """A link inside the repository that points outside it is refused by every file access,
    like the outside path itself; links that stay inside work."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("TOPSECRET\n")
    box.exec(
        f"ln -s {outside} out && ln -s {outside / 'secret.txt'} s.txt && ln -s tinycalc in", 30
    )
    for path in ("out/secret.txt", "s.txt", "out/new.txt", "out"):
        with pytest.raises(ValueError, match="leads outside the repository root"):
            box.read_file(path) if path != "out/new.txt" else box.write_file(path, "x")
        with pytest.raises(ValueError, match="leads outside"):
            box.exists(path)
    with pytest.raises(ValueError, match="leads outside"):
        box.write_file("s.txt", "overwritten\n")
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "TOPSECRET\n"
    assert "def mean" in box.read_file("in/stats.py")


def test_local_sandbox_output_is_capped_while_read_and_escapees_are_not_awaited(box):
    """Endless output keeps at most MAX_READ_CHARS in memory and says how much was cut (of the
    whole output); a background process that left the process group and holds the output open
    is not waited for past the timeout."""
    from harts_verl.workers.envs.sandbox import MAX_READ_CHARS

    n = 3 * MAX_READ_CHARS
    res = box.exec(f"head -c {n} /dev/zero | tr '\\0' a; echo; echo END", 60)
    assert res.exit_code == 0 and not res.timed_out
    assert len(res.output) == MAX_READ_CHARS and res.omitted == n + 5 - MAX_READ_CHARS
    assert res.output.endswith("a\nEND\n") and res.output.startswith("a")
    shown = format_exec_result(res, 1000, 60)
    assert f"of {n + 5} characters omitted" in shown and shown.endswith("[exit code: 0]")
    t = time.monotonic()
    res = box.exec("setsid sleep 30 & echo bg", 1.0)
    assert res.timed_out and "bg" in res.output
    assert time.monotonic() - t < 10
    # input a command never reads (more than a pipe holds) does not hold the call either
    from harts_verl.workers.envs.sandbox import _run

    t = time.monotonic()
    assert _run(["sleep", "30"], None, 1.0, stdin="x" * 200_000).timed_out
    assert time.monotonic() - t < 10


def test_local_sandbox_diff_carries_binary_files(box, inst):
    """A binary file the agent leaves behind does not make the patch unappliable."""
    box.write_file("tinycalc/stats.py", box.read_file("tinycalc/stats.py").replace(OLD, FIX))
    box.exec("printf '\\x00\\x01\\x02binary' > data.bin", 30)
    patch = box.diff()
    assert "GIT binary patch" in patch
    with LocalSandbox(swe.fixture_repo(inst.fixture)) as fresh:
        fresh.write_file("p.diff", patch)
        res = fresh.exec("git apply p.diff && rm p.diff && git status --short", 30)
        assert res.exit_code == 0, res.output
        assert "data.bin" in res.output and "stats.py" in res.output


@pytest.fixture
def fake_docker(tmp_path, monkeypatch) -> Path:
    """A ``docker`` CLI stand-in that runs ``exec`` commands on this machine (in the ``-w``
    folder) and a fresh git repository ``tmp_path/testbed`` to act as the container's."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text(
        "#!/bin/bash\ncmd=$1; shift\ncase $cmd in\n  run) echo fakeid; exit 0;;\n"
        '  exec) [ "$1" = -i ] && shift; [ "$1" = -w ] && { wd=$2; shift 2; }; shift; '
        'cd "$wd" && exec "$@";;\n  *) exit 0;;\nesac\n'
    )
    (fake / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    work = tmp_path / "testbed"
    work.mkdir()
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "start"], check=True)
    return work


def test_docker_sandbox_paths_are_quoted_and_checked(tmp_path, fake_docker):
    """File paths reach the container's shell quoted (no expansion, no command substitution)
    and checked there for symbolic links; a command that exits 124 early is not a timeout."""
    from harts_verl.workers.envs.sandbox import DockerSandbox

    work = fake_docker
    (tmp_path / "outside").mkdir()
    (work / "out").symlink_to(tmp_path / "outside")
    box = DockerSandbox("img", workdir=str(work))
    for name in ("dollar$HOME.txt", "sub$(touch INJECTED).txt", 'q"uote.txt'):
        box.write_file(name, "x\n")
        assert box.read_file(name) == "x\n" and box.exists(name)
    assert sorted(p.name for p in work.iterdir() if p.suffix == ".txt") == sorted(
        ["dollar$HOME.txt", "sub$(touch INJECTED).txt", 'q"uote.txt']
    )
    assert not (work / "INJECTED").exists()
    with pytest.raises(ValueError, match="leads outside the repository root"):
        box.write_file("out/pwn.txt", "x\n")
    assert list((tmp_path / "outside").iterdir()) == []
    with pytest.raises(FileNotFoundError):
        box.read_file("missing.txt")
    res = box.exec("echo hi; exit 124", 30)
    assert res.exit_code == 124 and not res.timed_out


# ---------------------------------------------------------------------- records, rows, reward
def test_record_validation_names_the_field(inst):
    rec = dict(inst.record)
    assert swe.SweInstance.from_record(rec).fail_to_pass == (
        "tests/test_stats.py::test_mean_empty_raises",
    )
    for key in ("instance_id", "FAIL_TO_PASS", "PASS_TO_PASS", "problem_statement"):
        bad = {k: v for k, v in rec.items() if k != key}
        with pytest.raises(ValueError, match=key):
            swe.SweInstance.from_record(bad)
    with pytest.raises(ValueError, match="FAIL_TO_PASS"):
        swe.SweInstance.from_record({**rec, "FAIL_TO_PASS": "[not json"})
    with pytest.raises(ValueError, match="FAIL_TO_PASS"):
        swe.SweInstance.from_record({**rec, "FAIL_TO_PASS": "[]"})
    with pytest.raises(ValueError, match="PASS_TO_PASS"):
        swe.SweInstance.from_record({**rec, "PASS_TO_PASS": [1, 2]})
    with pytest.raises(ValueError, match="fixture"):
        swe.fixture_repo("nope")


def test_dataset_rows_parquet_round_trip(inst, tmp_path):
    import pandas as pd

    rows = swe.dataset_rows([inst])
    pd.DataFrame(rows).to_parquet(tmp_path / "t.parquet")
    back = pd.read_parquet(tmp_path / "t.parquet").iloc[0]
    assert back["agent_name"] == "harts_tool_agent"
    assert back["data_source"] == swe.FIXTURE_DATA_SOURCE
    assert [m["role"] for m in back["prompt"]] == ["system", "user"]
    assert "mean([])" in back["prompt"][1]["content"]
    info = back["extra_info"]
    assert json.loads(info["swe_instance"])["instance_id"] == inst.instance_id
    for tool in ("bash", "str_replace_editor", "submit"):
        assert info["tools_kwargs"][tool]["create_kwargs"]["fixture"] == "tinycalc"
    with pytest.raises(TypeError, match=r"instances\[0\]"):
        swe.dataset_rows([inst.record])


def _patch(box, new: str) -> str:
    text = box.read_file("tinycalc/stats.py")
    box.write_file("tinycalc/stats.py", text.replace(OLD, new))
    return box.diff()


def test_reward_gold_one_none_wrong_breaking_zero(inst):
    def score(patch: str) -> dict:
        info = {"swe_instance": json.dumps(inst.record), "swe_fixture": "tinycalc"}
        if patch is not None:
            info["swe_patch"] = patch
        return swe.compute_score(swe.FIXTURE_DATA_SOURCE, "", inst.instance_id, info)

    assert score(inst.record["patch"]) == {
        "score": 1.0,
        "resolved": True,
        "patch_applied": True,
        "fail_to_pass_passed": 1,
        "pass_to_pass_passed": 2,
    }
    assert score(None)["score"] == 0.0 and not score(None)["patch_applied"]
    with LocalSandbox(swe.fixture_repo("tinycalc")) as b:
        wrong = _patch(b, WRONG)
    r = score(wrong)
    assert r["score"] == 0.0 and r["patch_applied"] and r["fail_to_pass_passed"] == 0
    with LocalSandbox(swe.fixture_repo("tinycalc")) as b:
        fix = _patch(b, FIX)
        b.write_file(
            "tinycalc/stats.py", b.read_file("tinycalc/stats.py").replace("max(lo", "min(lo")
        )
        breaking = b.diff()
    r = score(breaking)
    assert r["score"] == 0.0 and r["fail_to_pass_passed"] == 1 and r["pass_to_pass_passed"] == 1
    assert score(fix)["score"] == 1.0
    assert score("not a patch\n")["patch_applied"] is False
    # As in the SWE-bench harness, the files test_patch touches are reset before it applies:
    # a fix that also edits (or creates) those test files still counts.
    touched = swe._patch_paths(inst.test_patch)
    assert touched and all(p.startswith("tests/") for p in touched)
    with LocalSandbox(swe.fixture_repo("tinycalc")) as b:
        _patch(b, FIX)
        for path in touched:
            old = b.read_file(path) if b.exists(path) else ""
            b.write_file(path, old + "\n# the agent's own note\n")
        fix_and_tests = b.diff()
    assert score(fix_and_tests)["score"] == 1.0
    with pytest.raises(ValueError, match="swe_instance"):
        swe.compute_score("x", "", "", {"swe_patch": fix})


_FAKE_PASS = {
    # a module named pytest at the repository root, taken by `python -m pytest` before the real one
    "pytest.py": "import sys\nfor a in sys.argv[1:]:\n    print('PASSED', a)\n",
    # a conftest hook that turns every failure into a pass
    "conftest.py": (
        "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n    out = yield\n"
        "    rep = out.get_result()\n    rep.outcome = 'passed'\n"
    ),
}


@pytest.mark.parametrize("trick", ["pytest.py", "conftest.py", "forged_lines"])
def test_grader_is_not_fooled_by_harness_tricks(inst, trick):
    """A patch that leaves the bug and fakes the test outcome scores 0: a pytest.py module or a
    conftest.py it adds are graded as in the starting tree (gone), and results are read from
    pytest's JUnit XML outside the repository, not from printed PASSED lines (an atexit hook
    printing them after the summary scored 1.0)."""
    with LocalSandbox(swe.fixture_repo("tinycalc")) as b:
        if trick == "forged_lines":
            init = b.read_file("tinycalc/__init__.py")
            ids = " ".join(repr(t) for t in inst.fail_to_pass)
            b.write_file(
                "tinycalc/__init__.py",
                init + f"\nimport atexit\natexit.register(lambda: [print('PASSED', t) "
                f"for t in [{ids.replace(' ', ', ')}]])\n",
            )
        else:
            b.write_file(trick, _FAKE_PASS[trick])
        patch = b.diff()
    r = swe.grade_local(inst, patch)
    assert r["score"] == 0.0 and r["patch_applied"] and r["fail_to_pass_passed"] == 0
    assert r["pass_to_pass_passed"] == len(inst.pass_to_pass)  # the real tests ran
    assert swe.grade_local(inst, inst.record["patch"])["score"] == 1.0


def test_parse_junit_report_matches_listed_ids_by_their_collected_address():
    """Listed ids match the (classname, name) pytest writes for them, also for a test method
    inherited from a class in another file (its ``file`` attribute names that file) and for
    parameter ids with spaces, "::" or brackets; tests that did not run are absent."""
    xml = (
        '<testsuites><testsuite><testcase classname="tests.test_a" name="test_ok" '
        'file="tests/test_a.py"/><testcase classname="tests.test_a.TestC" name="test_m[1]" '
        'file="tests/test_a.py"><failure message="x"/></testcase><testcase '
        'classname="tests.test_b" name="test_s"><skipped/></testcase><testcase '
        'classname="tests.test_a.TestK" name="test_inherited" file="tests/base.py"/>'
        '<testcase classname="tests.test_a" name="test_p[a b::c]"/></testsuite></testsuites>'
    )
    ids = [
        "tests/test_a.py::test_ok",
        "tests/test_a.py::TestC::test_m[1]",
        "tests/test_b.py::test_s",
        "tests/test_a.py::TestK::test_inherited",
        "tests/test_a.py::test_p[a b::c]",
        "tests/test_a.py::test_never_ran",
    ]
    assert swe.parse_junit_report(xml, ids) == {
        "tests/test_a.py::test_ok": "PASSED",
        "tests/test_a.py::TestC::test_m[1]": "FAILED",
        "tests/test_b.py::test_s": "SKIPPED",
        "tests/test_a.py::TestK::test_inherited": "PASSED",
        "tests/test_a.py::test_p[a b::c]": "PASSED",
    }
    assert swe.parse_junit_report("PASSED tests/test_a.py::test_ok", ids) == {}


def test_diff_is_against_the_start_even_after_commits(box, inst):
    """An agent that commits (or resets) its work still hands in every change: the diff is
    taken against the tree the sandbox started from (after `git commit` it was empty)."""
    fix = _patch(box, FIX)
    assert fix
    box.exec("git -c user.name=a -c user.email=a@a commit -qam 'my fix'", 30)
    assert box.diff() == fix
    clone = box.clone()
    try:
        assert clone.diff() == fix
    finally:
        clone.close()
    assert swe.grade_local(inst, box.diff())["score"] == 1.0


def test_close_kills_background_processes_and_files_keep_line_endings(inst):
    b = LocalSandbox(swe.fixture_repo(inst.fixture))
    res = b.exec("sleep 300 >/dev/null 2>&1 & echo $!", 30)
    pid = int(res.output.split()[-1])
    os.kill(pid, 0)  # running
    b.write_file("crlf.txt", "alpha\r\nbeta\r\n")
    assert b.read_file("crlf.txt") == "alpha\r\nbeta\r\n"
    with open(os.path.join(b.root, "crlf.txt"), "rb") as f:
        assert f.read() == b"alpha\r\nbeta\r\n"
    b.close()
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("close() left a background process running")


def test_patch_paths():
    patch = (
        "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n"
        "diff --git a/dir with space/y.py b/dir with space/y.py\n"
        "diff --git a/old.py b/new.py\nrename from old.py\n"
        "diff --git a/x.py b/x.py\n"
    )
    assert swe._patch_paths(patch) == ["x.py", "dir with space/y.py", "old.py", "new.py"]
    assert swe._patch_paths("") == []


# ---------------------------------------------------------------------- veRL tools
class _AgentData:
    def __init__(self):
        self.extra_fields: dict = {}


def _tools():
    pytest.importorskip("verl")
    from harts_verl.workers.envs.swe_tools import BashTool, EditTool, SubmitTool

    cfg = {"type": "native", "sandbox": "local", "timeout": 2, "max_output_chars": 300}
    return BashTool(cfg), EditTool(cfg), SubmitTool(cfg)


def _call(tool, args, data, create):
    async def go():
        iid, _ = await tool.create(create_kwargs=create)
        try:
            resp, _reward, _ = await tool.execute(iid, args, agent_data=data)
        finally:
            await tool.release(iid)
        return resp.text

    return asyncio.run(go())


def test_tools_edit_record_patch_fork_and_submit(inst):
    from harts_verl.workers.envs.swe_tools import PATCH_KEY, POOL, SANDBOX_KEY, SweToolConfig

    bash, edit, submit = _tools()
    create = swe.dataset_rows([inst])[0]["extra_info"]["tools_kwargs"]["bash"]["create_kwargs"]
    data = _AgentData()
    n0 = len(POOL)
    out = _call(bash, {"command": "cat tinycalc/stats.py"}, data, create)
    assert "def mean(xs)" in out and out.endswith("[exit code: 0]")
    assert len(POOL) == n0 + 1 and data.extra_fields[PATCH_KEY] == ""
    # truncation and timeout reach the model as text
    out = _call(bash, {"command": "seq 1 2000"}, data, create)
    assert "output truncated" in out and out.startswith("1\n") and "2000" in out
    out = _call(bash, {"command": "sleep 20"}, data, create)
    assert "timed out after 2 s" in out
    # bad arguments name the field
    for args, field in [
        ({}, "command"),
        ({"command": 3}, "command"),
    ]:
        with pytest.raises(ValueError, match=field):
            _call(bash, args, data, create)
    for args, field in [
        ({"command": "delete", "path": "x"}, "command"),
        ({"command": "view"}, "path"),
        ({"command": "view", "path": "../x"}, "path"),
        ({"command": "str_replace", "path": "tinycalc/stats.py", "old_str": "nope"}, "old_str"),
        ({"command": "str_replace", "path": "tinycalc/stats.py", "old_str": "return"}, "old_str"),
        ({"command": "create", "path": "tinycalc/stats.py", "file_text": "x"}, "path"),
    ]:
        with pytest.raises(ValueError, match=field):
            _call(edit, args, data, create)
    with pytest.raises(ValueError, match=r"config\.sandbox"):
        SweToolConfig({"sandbox": "vm"})
    with pytest.raises(ValueError, match=r"create_kwargs\.fixture"):
        _call(bash, {"command": "ls"}, _AgentData(), {"instance_id": "x", "fixture": ""})
    out = _call(edit, {"command": "view", "path": "tinycalc/stats.py"}, data, create)
    assert '     5\t    """Arithmetic mean' in out
    # fork: deepcopy of extra_fields clones the sandbox
    branch = _AgentData()
    branch.extra_fields = copy.deepcopy(data.extra_fields)
    assert branch.extra_fields[SANDBOX_KEY] != data.extra_fields[SANDBOX_KEY]
    assert len(POOL) == n0 + 2
    args = {"command": "str_replace", "path": "tinycalc/stats.py", "old_str": OLD}
    assert "Edited" in _call(edit, {**args, "new_str": FIX}, data, create)
    assert "Edited" in _call(edit, {**args, "new_str": WRONG}, branch, create)
    assert "empty sequence" in data.extra_fields[PATCH_KEY]
    assert "return 0" in branch.extra_fields[PATCH_KEY]
    assert "empty sequence" not in branch.extra_fields[PATCH_KEY]
    # pickling/str gives a plain key without ownership
    assert type(json.loads(json.dumps(data.extra_fields))[SANDBOX_KEY]) is str
    assert "Submitted a patch" in _call(submit, {}, data, create)
    assert data.extra_fields["swe_submitted"] and SANDBOX_KEY not in data.extra_fields
    with pytest.raises(ValueError, match="already submitted"):
        _call(bash, {"command": "ls"}, data, create)
    info = {"swe_instance": json.dumps(inst.record), "swe_fixture": "tinycalc"}
    assert swe.compute_score("x", "", "", {**info, **data.extra_fields})["score"] == 1.0
    assert swe.compute_score("x", "", "", {**info, **branch.extra_fields})["score"] == 0.0
    del branch  # the last ref goes: its sandbox is closed
    import gc

    gc.collect()
    assert len(POOL) == n0


def test_the_agents_git_index_is_its_own_and_a_failed_record_keeps_the_answer(inst):
    """The patch is staged in an index of its own: the agent's `git diff` shows its edit, `git
    status` an unstaged change and an untracked file, and `git checkout -- f` undoes the edit
    and drops it from the patch (a `git add -A` in the agent's index made `git diff` print
    nothing and the checkout keep the edit). When the patch cannot be taken (a nested
    repository without a commit), the call's answer stands with a note (it was replaced by an
    error), and submit says what to fix instead of failing."""
    from harts_verl.workers.envs.swe_tools import PATCH_KEY, SUBMITTED_KEY

    bash, edit, submit = _tools()
    create = swe.dataset_rows([inst])[0]["extra_info"]["tools_kwargs"]["bash"]["create_kwargs"]
    data = _AgentData()
    args = {"command": "str_replace", "path": "tinycalc/stats.py", "old_str": OLD}
    assert "Edited" in _call(edit, {**args, "new_str": FIX}, data, create)
    assert "empty sequence" in data.extra_fields[PATCH_KEY]
    out = _call(
        bash, {"command": "git diff --stat; touch new.py; git status --short"}, data, create
    )
    assert "tinycalc/stats.py | " in out and " M tinycalc/stats.py" in out and "?? new.py" in out
    out = _call(bash, {"command": "git checkout -- tinycalc/stats.py && git diff"}, data, create)
    assert "empty sequence" not in out and "empty sequence" not in data.extra_fields[PATCH_KEY]
    assert "new.py" in data.extra_fields[PATCH_KEY]
    # a nested repository without a commit: git add refuses it
    out = _call(bash, {"command": "git init -q scratch && echo MADE"}, data, create)
    assert out.startswith("MADE") and "could not be recorded" in out and "scratch" in out
    assert data.extra_fields[PATCH_KEY] == ""
    out = _call(submit, {}, data, create)
    assert out.startswith("Cannot submit: ") and not data.extra_fields.get(SUBMITTED_KEY)
    out = _call(bash, {"command": "rm -rf scratch new.py && echo OK"}, data, create)
    assert out.startswith("OK") and "could not be recorded" not in out
    assert "Submitted: no changes." == _call(submit, {}, data, create)


def test_docker_sandbox_errors_are_clear(monkeypatch):
    from harts_verl.workers.envs.sandbox import DockerSandbox

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="docker"):
        DockerSandbox("some/image")
    with pytest.raises(ValueError, match="image"):
        DockerSandbox("")
    try:
        import swebench  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="swebench"):
            swe.grade_swebench(swe.fixture_instances()[0], "diff")


# ---------------------------------------------------------------------- through the agent loop
def test_fixture_task_through_harts_tool_agent_with_forks(inst):
    """Tools run via veRL's ToolAgentLoop tool-call path (hermes format); the fork after turn 1
    gives two branches with their own sandboxes: one fixes the bug, one does not."""
    pytest.importorskip("verl")
    from verl.tools.tool_registry import initialize_tools_from_config

    from harts_verl.workers.envs import testing
    from harts_verl.workers.rollout.agent_loop import ForkSpec, HartsToolAgentLoop

    tok = testing.byte_tokenizer()
    row = swe.dataset_rows([inst])[0]
    tools = initialize_tools_from_config(str(RECIPE / "tools_fixture.yaml"))
    edits = iter([FIX, WRONG])

    def script(rid: str, turn: int, text: str) -> str:
        if turn == 0:
            return "Look first. " + testing.hermes_call(
                "bash", {"command": "cat tinycalc/stats.py"}
            )
        if turn == 1:
            args = {"command": "str_replace", "path": "tinycalc/stats.py", "old_str": OLD}
            return testing.hermes_call("str_replace_editor", {**args, "new_str": next(edits)})
        if turn == 2:
            return testing.hermes_call("submit", {})
        return "Done."

    async def main():
        server = testing.ScriptedServer(tok, script)
        loop = testing.make_loop(HartsToolAgentLoop, server, tools)
        outs = await loop.run_tree(
            {},
            fork=ForkSpec(turns=(1,), branching=2, budget=2),
            raw_prompt=row["prompt"],
            tools_kwargs=row["extra_info"]["tools_kwargs"],
            extra_info=row["extra_info"],
        )
        return server, outs

    server, outs = asyncio.run(main())
    assert len(outs) == 2 and len({rid for rid, _ in server.calls}) == 3  # prefix + 2 branches
    scores = []
    for out in outs:
        text = tok.decode(out.response_ids)
        assert "def mean(xs)" in text and "[exit code: 0]" in text and "Submitted a patch" in text
        assert out.extra_fields["swe_submitted"] is True
        assert json.loads(out.extra_fields["harts_tree"])["turns"]
        info = {**row["extra_info"], **out.extra_fields}
        scores.append(swe.compute_score(row["data_source"], text, inst.instance_id, info)["score"])
    assert sorted(scores) == [0.0, 1.0]


def test_editor_view_of_a_folder_named_like_an_option(box):
    """``view`` of a folder whose name starts with "-" lists it (``find -delete ...`` wiped the
    repository, .git included)."""
    _, edit, _ = _tools()
    box.write_file("-delete/notes.txt", "x\n")
    listing = edit.run(box, {"command": "view", "path": "-delete"})
    assert "notes.txt" in listing
    assert box.exists("tinycalc/stats.py") and "notes.txt" in box.diff()
    # "." lists ./x (it printed ././x); a symlinked folder lists its files (the link alone)
    top = edit.run(box, {"command": "view", "path": "."}).splitlines()
    assert "./tinycalc/stats.py" in top and not any(line.startswith("././") for line in top)
    box.exec("ln -s tinycalc linked", 10)
    assert "./linked/stats.py" in edit.run(box, {"command": "view", "path": "linked"})


# ---------------------------------------------------------------------- review fixes
def test_docker_sandbox_reads_whole_files_keeps_bytes_and_reads_bashrc(
    tmp_path, fake_docker, monkeypatch
):
    """A file over the output read limit comes back whole (an edit wrote back its first MiB:
    26,000 lines gone), bytes that are not UTF-8 survive a read and write, and an agent's
    command first reads the image's ~/.bashrc (SWE-bench images activate the testbed env
    there; `bash -c` alone does not read it)."""
    from harts_verl.workers.envs.sandbox import MAX_READ_CHARS, DockerSandbox

    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("export HARTS_ENV=testbed\necho noise\n")
    monkeypatch.setenv("HOME", str(home))
    big = "".join(f"line {i:07d}\n" for i in range(MAX_READ_CHARS // 13 + 5000))
    (fake_docker / "big.py").write_text(big)
    (fake_docker / "latin.py").write_bytes(b"AUTHOR = 'Jos\xe9'\nx = 1\n")
    box = DockerSandbox("img", workdir=str(fake_docker))
    assert box.read_file("big.py") == big
    text = box.read_file("latin.py")
    box.write_file("latin.py", text.replace("x = 1", "x = 2"))
    assert (fake_docker / "latin.py").read_bytes() == b"AUTHOR = 'Jos\xe9'\nx = 2\n"
    res = box.exec('echo "env=$HARTS_ENV"', 30)
    assert res.output == "env=testbed\n" and res.exit_code == 0
    assert len(box.diff()) > MAX_READ_CHARS  # the new big file, whole


def test_patch_over_the_read_limit_comes_back_whole(inst):
    """A patch larger than the output read limit (the fix plus a big file the agent wrote) is
    recorded whole and applies: it was cut at 1 MiB, a corrupt patch that scored 0."""
    from harts_verl.workers.envs.sandbox import MAX_READ_CHARS

    with LocalSandbox(swe.fixture_repo("tinycalc")) as b:
        b.write_file("notes.log", "".join(f"note {i}\n" for i in range(MAX_READ_CHARS // 8)))
        patch = _patch(b, FIX)
    assert len(patch) > MAX_READ_CHARS
    assert swe.grade_local(inst, patch)["score"] == 1.0


def test_grading_follows_swebench_on_xfail_skip_and_missing_tests(inst):
    """As SWE-bench's grading of a ``pytest -rA`` log: an expected failure (pytest's
    ``skipped type="pytest.xfail"``) passes (an xfail PASS_TO_PASS test made even the gold
    patch score 0); an absent, failed, erroring, skipped (its ``-rA`` line names no test, so
    SWE-bench finds it absent) or unexpectedly passing one fails (a skip scored 1.0)."""
    xml = (
        '<testsuites><testsuite><testcase classname="t" name="a">'
        '<skipped type="pytest.xfail" message="x"/></testcase>'
        '<testcase classname="t" name="b"><skipped type="pytest.skip"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert swe.parse_junit_report(xml, ["t.py::a", "t.py::b"]) == {
        "t.py::a": "XFAIL",
        "t.py::b": "SKIPPED",
    }
    f2p, p2p = inst.fail_to_pass, inst.pass_to_pass
    ok = dict.fromkeys(f2p, "PASSED")
    for status, resolved in [
        ({**ok, p2p[0]: "XFAIL", p2p[1]: "PASSED"}, True),
        ({**ok, p2p[0]: "XFAIL", p2p[1]: "SKIPPED"}, False),
        ({**ok, p2p[0]: "PASSED", p2p[1]: "XPASS"}, False),
        ({f2p[0]: "SKIPPED", p2p[0]: "PASSED", p2p[1]: "PASSED"}, False),
        ({**ok, p2p[0]: "PASSED"}, False),  # p2p[1] absent
        ({**ok, p2p[0]: "PASSED", p2p[1]: "ERROR"}, False),
        ({f2p[0]: "FAILED", p2p[0]: "PASSED", p2p[1]: "PASSED"}, False),
    ]:
        r = swe._report(inst, status, True)
        assert r["resolved"] is resolved, status
    r = swe._report(inst, {**ok, p2p[0]: "XFAIL", p2p[1]: "SKIPPED"}, True)
    assert (r["fail_to_pass_passed"], r["pass_to_pass_passed"]) == (1, 1)


def test_a_patch_that_skips_the_failing_test_scores_zero(inst):
    """A fix that makes the FAIL_TO_PASS test skip instead of pass is not a fix (it scored 1.0
    on the bundled fixture; SWE-bench finds the skipped test absent)."""
    skip = OLD + '    if not xs:\n        import pytest\n        pytest.skip("empty")\n'
    with LocalSandbox(swe.fixture_repo("tinycalc")) as b:
        b.write_file("tinycalc/stats.py", b.read_file("tinycalc/stats.py").replace(OLD, skip))
        patch = b.diff()
    r = swe.grade_local(inst, patch)
    assert r["patch_applied"] and r["score"] == 0.0 and r["fail_to_pass_passed"] == 0


def test_a_patch_cannot_register_a_pytest_plugin_or_rewrite_the_report(inst):
    """Two ways a patch without a fix scored 1.0: a package's metadata in the repository that
    registers a pytest plugin through an entry point (the repository joined sys.path before
    pytest looked plugins up), and an exit handler that rewrites the JUnit report once pytest
    returned."""
    plugin = _FAKE_PASS["conftest.py"]
    rewrite = (
        "\nimport atexit as _a, sys as _s\n"
        "def _w():\n"
        "    for _x in _s.argv:\n"
        "        if _x.startswith('--junitxml='):\n"
        "            open(_x.split('=', 1)[1], 'w').write('<testsuites><testsuite>' + ''.join(\n"
        '                \'<testcase classname="tests.test_stats" name="%s"/>\' % n\n'
        "                for n in ('test_mean', 'test_clamp', 'test_mean_empty_raises'))\n"
        "                + '</testsuite></testsuites>')\n"
        "_a.register(_w)\n"
    )
    with LocalSandbox(swe.fixture_repo("tinycalc")) as b:
        b.write_file("harts_helper.py", plugin)
        meta = "harts_helper-0.1.dist-info"
        b.write_file(
            f"{meta}/METADATA", "Metadata-Version: 2.1\nName: harts-helper\nVersion: 0.1\n"
        )
        b.write_file(f"{meta}/entry_points.txt", "[pytest11]\nharts_helper = harts_helper\n")
        entry_point = b.diff()
    with LocalSandbox(swe.fixture_repo("tinycalc")) as b:
        b.write_file("tinycalc/__init__.py", b.read_file("tinycalc/__init__.py") + rewrite)
        at_exit = b.diff()
    for name, patch in (("entry point", entry_point), ("exit handler", at_exit)):
        r = swe.grade_local(inst, patch)
        assert r["patch_applied"] and r["score"] == 0.0, (name, r)


def test_pytest_config_files_are_graded_as_in_the_start(inst):
    """A patch that adds pytest's other config files (``.pytest.ini``, ``pytest.toml``) to load
    a plugin that turns failures into passes scores 0: they are reset like ``pytest.ini``."""
    plugin = _FAKE_PASS["conftest.py"]
    for name, text in [
        (".pytest.ini", "[pytest]\naddopts = -p harts_pass\n"),
        ("pytest.toml", '[pytest]\naddopts = ["-p", "harts_pass"]\n'),
    ]:
        with LocalSandbox(swe.fixture_repo("tinycalc")) as b:
            b.write_file("harts_pass.py", plugin)
            b.write_file(name, text)
            patch = b.diff()
        r = swe.grade_local(inst, patch)
        assert r["score"] == 0.0 and r["fail_to_pass_passed"] == 0, name


def test_bad_records_name_their_instance_and_line(inst, tmp_path):
    """A malformed record's error names its instance; prepare.py names the file and line."""
    import argparse
    import importlib.util

    bad = {**inst.record, "FAIL_TO_PASS": "[]"}
    with pytest.raises(ValueError, match=rf"^instance {inst.instance_id!r}: FAIL_TO_PASS"):
        swe.SweInstance.from_record(bad)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(inst.record) + "\n\n" + json.dumps(bad) + "\n{broken\n")
    spec = importlib.util.spec_from_file_location("swe_prepare", RECIPE / "prepare.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    args = argparse.Namespace(fixtures=False, jsonl=str(path))
    with pytest.raises(ValueError, match=rf"rows\.jsonl:3: instance {inst.instance_id!r}"):
        prep.load_records(args)
    path.write_text(json.dumps(inst.record) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"rows\.jsonl:2: Expecting property name"):
        prep.load_records(args)


def test_editor_keeps_other_bytes_views_ranges_and_refuses_unknown_arguments(inst):
    """``str_replace`` in a file with bytes that are not UTF-8 leaves them as they were (they
    became U+FFFD in the file); ``view`` shows them as U+FFFD, numbers lines as ``grep -n``
    (form feeds do not split), takes ``view_range``; an undeclared argument is refused by
    name (``view_range`` was ignored: the whole file came back)."""
    from harts_verl.workers.envs.swe_tools import POOL, SANDBOX_KEY

    bash, edit, _ = _tools()
    create = swe.dataset_rows([inst])[0]["extra_info"]["tools_kwargs"]["bash"]["create_kwargs"]
    data = _AgentData()
    _call(bash, {"command": "printf 'A = \\xe9\\nB = 1\\n\\fC = 2\\n' > lat.py"}, data, create)
    args = {"command": "str_replace", "path": "lat.py", "old_str": "B = 1", "new_str": "B = 3"}
    assert "Edited" in _call(edit, args, data, create)
    box = POOL.get(data.extra_fields[SANDBOX_KEY])
    with open(os.path.join(box.root, "lat.py"), "rb") as f:
        assert f.read() == b"A = \xe9\nB = 3\n\x0cC = 2\n"
    out = _call(edit, {"command": "view", "path": "lat.py"}, data, create)
    assert out == "     1\tA = \ufffd\n     2\tB = 3\n     3\t\x0cC = 2"
    view = {"command": "view", "path": "lat.py"}
    assert _call(edit, {**view, "view_range": [2, 3]}, data, create).startswith("     2\tB = 3")
    assert _call(edit, {**view, "view_range": [3, -1]}, data, create) == "     3\t\x0cC = 2"
    for bad in ([0, 2], [3, 2], [9, -1], [1], "1-2"):
        with pytest.raises(ValueError, match="view_range"):
            _call(edit, {**view, "view_range": bad}, data, create)
    with pytest.raises(ValueError, match="insert_line: unknown argument of str_replace_editor"):
        _call(edit, {**view, "insert_line": 3}, data, create)
    with pytest.raises(ValueError, match="unknown argument of bash"):
        _call(bash, {"command": "ls", "cwd": "/"}, data, create)
    # an argument of another editor command is refused: a str_replace with its new text in
    # file_text deleted old_str and said "Edited"
    path = {"path": "tinycalc/stats.py"}
    with pytest.raises(ValueError, match="file_text: not an argument of the str_replace"):
        _call(
            edit, {"command": "str_replace", **path, "old_str": OLD, "file_text": FIX}, data, create
        )
    with pytest.raises(ValueError, match="old_str: not an argument of the view command"):
        _call(edit, {"command": "view", **path, "old_str": OLD}, data, create)
    # ... but a null one is an argument left out (models send every field of the schema)
    nulls = {"file_text": None, "old_str": None, "new_str": None}
    assert "def mean" in _call(edit, {"command": "view", **path, **nulls}, data, create)
    # an old_str that occurs twice overlapping ("aa" in "aaa") is ambiguous, not unique
    _call(bash, {"command": "printf 'x = 1\\n\\n\\n\\ny = 2\\n' > gaps.py"}, data, create)
    with pytest.raises(ValueError, match="old_str: occurs more than once"):
        _call(
            edit,
            {"command": "str_replace", "path": "gaps.py", "old_str": "\n\n", "new_str": "\n"},
            data,
            create,
        )


def test_a_dropped_sandbox_closes_off_the_dropping_thread():
    """The last ref of a sandbox going away (a trajectory ending without submit, a cancelled
    branch: on the agent worker's event loop) closes it on a thread of its own; a container's
    ``docker rm`` blocked the event loop."""
    pytest.importorskip("verl")
    import threading
    import time

    from harts_verl.workers.envs.swe_tools import POOL

    closed = threading.Event()

    class SlowBox:
        def close(self):
            time.sleep(1.0)
            closed.set()

    n0 = len(POOL)
    ref = POOL.add(SlowBox())
    t0 = time.monotonic()
    del ref
    assert time.monotonic() - t0 < 0.5 and len(POOL) == n0  # forgotten at once
    assert closed.wait(10)  # and closed
    # at exit close_all waits for background closes, and closes any later one in place (a
    # thread started after the interpreter waited for its threads died with the process)
    from harts_verl.workers.envs.swe_tools import SandboxPool

    pool, done = SandboxPool(), []

    class Box:
        def __init__(self, name):
            self.name = name

        def close(self):
            time.sleep(0.2)
            done.append(self.name)

    a = str(pool.add(Box("a")))
    keep = str(pool.add(Box("b")))  # open until close_all
    pool.close_in_background(a)
    pool.close_all()
    assert sorted(done) == ["a", "b"] and pool.get(keep) is None  # a's close was waited for
    c = str(pool.add(Box("c")))
    pool.close_in_background(c)
    assert done[-1] == "c"  # after close_all: closed in place


def test_sandboxes_start_off_the_event_loop(inst, monkeypatch):
    """Starting a sandbox (a docker run, an image pull: minutes) runs in a worker thread, not
    on the agent loop's event loop (every trajectory of the worker stalled behind it)."""
    import threading

    from harts_verl.workers.envs.swe_tools import BashTool

    bash, _, _ = _tools()
    threads = []
    start = BashTool._start

    def recording(self, create):
        threads.append(threading.current_thread())
        return start(self, create)

    monkeypatch.setattr(BashTool, "_start", recording)
    create = swe.dataset_rows([inst])[0]["extra_info"]["tools_kwargs"]["bash"]["create_kwargs"]
    assert _call(bash, {"command": "true"}, _AgentData(), create).endswith("[exit code: 0]")
    assert threads and threads[0] is not threading.main_thread()


def _fake_swebench(monkeypatch, version: str, run_instance=None) -> None:
    """``swebench`` (and ``docker``) stand-ins in ``sys.modules`` at ``version``."""
    import sys
    import types

    mods = {}
    for name in (
        "swebench",
        "swebench.harness",
        "swebench.harness.constants",
        "swebench.harness.run_evaluation",
        "swebench.harness.test_spec",
        "swebench.harness.test_spec.test_spec",
        "docker",
    ):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["swebench"].__version__ = version
    mods["swebench.harness.constants"].RUN_EVALUATION_LOG_DIR = Path("logs") / "run_evaluation"
    mods["swebench.harness.run_evaluation"].run_instance = run_instance
    mods["swebench.harness.test_spec.test_spec"].make_test_spec = lambda rec, **kw: (rec, kw)
    mods["docker"].from_env = lambda: "client"


def test_swebench_harness_versions_and_logs(inst, monkeypatch, tmp_path, caplog):
    """swebench 5.x (another dataset format, another ``run_instance``) is refused naming the
    version and the pin (it failed as 'package missing', and its signature would have taken
    our arguments in the wrong places); 4.x gets keyword arguments; a completed run's logs are
    removed (they piled up per call), an incomplete one's are kept and named in a WARNING."""
    import logging

    from harts_verl.workers.envs.sandbox import swebench_harness

    _fake_swebench(monkeypatch, "5.0.2")
    with pytest.raises(ImportError, match=r"swebench 5\.0\.2 is installed.*swebench>=4\.1,<5"):
        swe.grade_swebench(inst, "diff")
    calls = []

    def run_instance(spec, pred, rm_image, force_rebuild, client, run_id, timeout=None):
        calls.append((rm_image, force_rebuild, client, timeout))
        logs = Path("logs") / "run_evaluation" / run_id / "harts" / pred["instance_id"]
        logs.mkdir(parents=True)
        ok = pred["model_patch"] == "good"
        return {"completed": ok, "resolved": ok}

    _fake_swebench(monkeypatch, "4.1.0", run_instance)
    monkeypatch.chdir(tmp_path)
    assert swebench_harness().version == "4.1.0"
    r = swe.grade_swebench(inst, "good", timeout=99)
    assert r["score"] == 1.0 and calls == [(False, False, "client", 99)]
    assert list((tmp_path / "logs" / "run_evaluation").iterdir()) == []
    with caplog.at_level(logging.WARNING):
        r = swe.grade_swebench(inst, "bad")
    assert r["score"] == 0.0 and not r["patch_applied"]
    (kept,) = (tmp_path / "logs" / "run_evaluation").iterdir()
    assert kept.name in caplog.text and inst.instance_id in caplog.text


def test_reward_grades_in_the_image_namespace_the_tools_ran(inst, monkeypatch, tmp_path):
    """The docker sandbox records its ``docker_namespace`` and the reward grades with it (it
    always graded in ``swebench``: a private mirror's images were used by the tools only)."""
    specs = []

    def run_instance(spec, pred, rm_image, force_rebuild, client, run_id, timeout=None):
        specs.append(spec)
        return {"completed": True, "resolved": True}

    _fake_swebench(monkeypatch, "4.1.0", run_instance)
    monkeypatch.chdir(tmp_path)
    rec = {k: v for k, v in inst.record.items()}
    row = swe.dataset_rows([swe.SweInstance.from_record(rec)])[0]
    info = {**row["extra_info"], "swe_patch": "diff --git a/x b/x\n"}
    for extra, namespace in (({}, "swebench"), ({swe.NAMESPACE_KEY: "mirror"}, "mirror")):
        specs.clear()
        assert swe.compute_score(row["data_source"], "", "", {**info, **extra})["score"] == 1.0
        assert specs[0][1]["namespace"] == namespace
    pytest.importorskip("verl")
    from harts_verl.workers.envs import swe_tools

    class _Box:
        def close(self):
            pass

    monkeypatch.setattr(swe_tools.DockerSandbox, "from_swebench", lambda rec, namespace: _Box())
    bash = swe_tools.BashTool({"type": "native", "sandbox": "docker", "docker_namespace": "mirror"})
    data = _AgentData()
    bash._kwargs["i"] = {"instance_id": inst.instance_id, "record": json.dumps(rec)}
    bash._sandbox("i", data)
    assert data.extra_fields[swe.NAMESPACE_KEY] == "mirror"


def test_parallel_calls_share_one_sandbox_and_oversize_is_refused_not_cut(inst, monkeypatch):
    """Calls of one turn run together (``max_parallel_calls`` > 1): they run one at a time on
    one sandbox, not one each (the second replaced the first, closing it under its running
    command) and never with git at once in it (``index.lock`` exists, seen under load). A
    file or a patch over the whole-read bound is refused with a message, never cut: the view
    says so, and an oversize patch is recorded as none (it scores 0) until the agent cleans
    up; ``view_range`` on a folder is refused."""
    from harts_verl.workers.envs import sandbox as sandbox_mod
    from harts_verl.workers.envs.swe_tools import PATCH_KEY, POOL

    bash, edit, _ = _tools()
    create = swe.dataset_rows([inst])[0]["extra_info"]["tools_kwargs"]["bash"]["create_kwargs"]
    data = _AgentData()
    n0 = len(POOL)

    async def together():
        calls = []
        for k in range(3):
            iid, _ = await bash.create(create_kwargs=create)
            calls.append(bash.execute(iid, {"command": f"echo {k} > f{k}.txt"}, agent_data=data))
        return await asyncio.gather(*calls)

    asyncio.run(together())
    assert len(POOL) == n0 + 1
    patch = data.extra_fields[PATCH_KEY]
    assert all(f"f{k}.txt" in patch for k in range(3))
    monkeypatch.setattr(sandbox_mod, "MAX_WHOLE_CHARS", 4096)
    out = _call(bash, {"command": "seq 1 3000 > big.txt"}, data, create)
    assert "larger than 0 MiB as a patch" in out and data.extra_fields[PATCH_KEY] == ""
    with pytest.raises(ValueError, match=r"big\.txt' is larger than"):
        _call(edit, {"command": "view", "path": "big.txt"}, data, create)
    _call(bash, {"command": "rm big.txt"}, data, create)
    assert "f0.txt" in data.extra_fields[PATCH_KEY]
    with pytest.raises(ValueError, match="view_range: 'tinycalc' is a folder"):
        _call(edit, {"command": "view", "path": "tinycalc", "view_range": [1, 2]}, data, create)


@pytest.mark.parametrize(
    "kind,typechange", [("local", False), ("local", True), ("docker", False), ("docker", True)]
)
def test_patch_of_a_file_that_is_not_utf8_applies_exactly(tmp_path, kind, typechange, request):
    """An edited Latin-1 source comes back as a binary patch of that file alone (its text diff
    decoded to U+FFFD: a patch that no longer applied, a right fix scored 0); the other files
    stay text diffs, a repository's .gitattributes cannot force text, the patch is valid UTF-8
    and applies to the start byte for byte, and the repository's own info/attributes is kept.
    Only the files that are not UTF-8 are diffed again on their own, unless a type change (a
    file become a symlink: two sections for one name) takes every file on its own."""
    from harts_verl.workers.envs import sandbox
    from harts_verl.workers.envs.sandbox import DockerSandbox

    src = tmp_path / "src"
    src.mkdir()
    (src / "latin.py").write_bytes(b"AUTHOR = 'Jos\xe9'\nx = 1\n")
    (src / "ok.py").write_text("y = 1\n")
    (src / "t.txt").write_text("t\n")
    edit = (
        "printf \"AUTHOR = 'Jos\\xe9'\\nx = 2\\n\" > latin.py && printf 'y = 2\\n' > ok.py && "
        "printf 'w\\xff\\n' > new.txt && echo '* diff text' > .gitattributes"
    )
    if typechange:
        edit += " && rm t.txt && ln -s ok.py t.txt"
    if kind == "local":
        box = LocalSandbox(str(src))
        root = Path(box.root)
    else:
        root = request.getfixturevalue("fake_docker")
        for f in src.iterdir():
            (root / f.name).write_bytes(f.read_bytes())
        git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", "files"], check=True)
        box = DockerSandbox("img", workdir=str(root))
    attributes = root / ".git" / "info" / "attributes"
    attributes.parent.mkdir(exist_ok=True)
    attributes.write_text("*.bin binary\n")
    scripts: list[str] = []
    run = sandbox._run

    def counted(args, *a, **kw):
        scripts.append(" ".join(args))
        return run(args, *a, **kw)

    request.getfixturevalue("monkeypatch").setattr(sandbox, "_run", counted)
    names = ("latin.py", "ok.py", "new.txt", ".gitattributes")
    with box:
        assert box.exec(edit, 30).exit_code == 0
        scripts.clear()
        patch = box.diff()
        assert attributes.read_text() == "*.bin binary\n"
        edited = {name: (root / name).read_bytes() for name in names}
        link = os.readlink(root / "t.txt") if typechange else None
    one_by_one = sum("--literal-pathspecs" in s and "info/attributes" not in s for s in scripts)
    assert one_by_one == (5 if typechange else 0)  # every changed file, or none
    assert sum("* -diff" in s for s in scripts) == 2  # the two files that are not UTF-8
    patch.encode("utf-8")  # a str field that is written back as UTF-8
    sections = {s.split(" ", 1)[0]: s for s in patch.split("diff --git a/")[1:]}
    assert set(sections) == {".gitattributes", "latin.py", "new.txt", "ok.py"} | (
        {"t.txt"} if typechange else set()
    )
    assert "GIT binary patch" in sections["latin.py"] and "GIT binary patch" in sections["new.txt"]
    assert "+y = 2" in sections["ok.py"] and "\ufffd" not in patch
    with LocalSandbox(str(src)) as fresh:
        fresh.write_file("p.diff", patch)
        res = fresh.exec("git apply p.diff && rm p.diff", 30)
        assert res.exit_code == 0, res.output
        assert {name: (Path(fresh.root) / name).read_bytes() for name in names} == edited
        if typechange:
            assert os.readlink(Path(fresh.root) / "t.txt") == link == "ok.py"
    assert edited["latin.py"] == b"AUTHOR = 'Jos\xe9'\nx = 2\n"


def test_patch_index_keeps_gits_racy_entry_check(fake_docker):
    """An edit that keeps a file's size and mtime (within the index's own timestamp second) is
    in the patch, as in the repository's own `git diff`: the patch index is seeded with the
    index file's mtime (a plain copy made its entries look older than the index, so git
    trusted their stale stat data and the edit was left out)."""
    from harts_verl.workers.envs.sandbox import DockerSandbox

    work = fake_docker
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "config", "core.trustctime", "false"], check=True)
    src = work / "a.py"
    src.write_text("x = 1\n")
    stamp = int(time.time()) - 100
    os.utime(src, (stamp, stamp))
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    box = DockerSandbox("img", workdir=str(work))
    os.utime(work / ".git" / "index", (stamp, stamp))  # entry as new as the index: racy
    with src.open("r+") as f:  # same inode, same size, same mtime
        f.write("x = 2\n")
    os.utime(src, (stamp, stamp))
    own = subprocess.run([*git, "diff", "HEAD"], check=True, capture_output=True, text=True)
    assert "+x = 2" in own.stdout  # git itself sees the edit
    with box:
        assert "+x = 2" in box.diff()


def test_editor_keeps_files_on_bad_text_edits_crlf_and_counts_changes(inst, tmp_path, fake_docker):
    """Review fixes: an edit whose text UTF-8 cannot hold (a lone surrogate, half of an escaped
    emoji) leaves the file as it was, in both sandboxes (the local one emptied it: a patch that
    deleted the file); a multi-line old_str copied from the view of a CRLF file matches and the
    lines written keep CRLF; an empty file and a folder are named; submit counts the changed
    lines, not the file headers."""
    from harts_verl.workers.envs.sandbox import DockerSandbox
    from harts_verl.workers.envs.swe_tools import POOL, SANDBOX_KEY, changed_lines

    bash, edit, submit = _tools()
    create = swe.dataset_rows([inst])[0]["extra_info"]["tools_kwargs"]["bash"]["create_kwargs"]
    data = _AgentData()
    _call(bash, {"command": "printf 'def f():\\r\\n    return 1\\r\\n' > win.py"}, data, create)
    root = POOL.get(data.extra_fields[SANDBOX_KEY]).root
    stats = os.path.join(root, "tinycalc", "stats.py")
    before = Path(stats).read_bytes()
    args = {"command": "str_replace", "path": "tinycalc/stats.py", "old_str": OLD}
    with pytest.raises(ValueError, match=r"'\\ud83d' at index \d+ .*the file is unchanged"):
        _call(edit, {**args, "new_str": OLD + "    # \ud83d\n"}, data, create)
    assert Path(stats).read_bytes() == before
    with pytest.raises(ValueError, match="the file is unchanged"):
        _call(edit, {"command": "create", "path": "e.py", "file_text": "\ud83d"}, data, create)
    assert not os.path.exists(os.path.join(root, "e.py"))
    crlf = {"command": "str_replace", "path": "win.py", "old_str": "def f():\n    return 1"}
    out = _call(edit, {**crlf, "new_str": "def f():\n    x = 2\n    return x"}, data, create)
    assert out.endswith("     1\tdef f():\n     2\t    x = 2\n     3\t    return x")
    assert Path(root, "win.py").read_bytes() == b"def f():\r\n    x = 2\r\n    return x\r\n"
    _call(bash, {"command": ": > empty.py"}, data, create)
    assert _call(edit, {"command": "view", "path": "empty.py"}, data, create) == (
        "empty.py is empty (0 lines)."
    )
    with pytest.raises(ValueError, match=r"empty\.py is empty"):
        _call(edit, {"command": "view", "path": "empty.py", "view_range": [1, -1]}, data, create)
    with pytest.raises(ValueError, match="'tinycalc' is a folder"):
        _call(edit, {"command": "str_replace", "path": "tinycalc", "old_str": "x"}, data, create)
    out = _call(submit, {}, data, create)
    # win.py: a new file of 3 lines; empty.py: a new empty file (no hunk)
    assert out == "Submitted a patch with 3 changed lines."
    assert changed_lines("--- a/x\n+++ b/x\n@@ -1 +1 @@\n--- sql comment\n+-- sql\n") == 2
    # the docker sandbox refuses before touching the container's file
    (fake_docker / "a.py").write_bytes(b"a = 1\n")
    box = DockerSandbox("img", workdir=str(fake_docker))
    with pytest.raises(ValueError, match="the file is unchanged"):
        box.write_file("a.py", "a = \ud83d\n")
    assert (fake_docker / "a.py").read_bytes() == b"a = 1\n"
    box.close()


def test_an_unexpectedly_passing_test_fails_the_grade(tmp_path, monkeypatch):
    """An xfail-marked PASS_TO_PASS test that the patch makes pass (XPASS) fails the grade, as
    SWE-bench parses no such status (JUnit XML writes it as a plain pass: it scored 1.0); the
    same test failing as expected (XFAIL, the gold patch) passes."""
    repo = tmp_path / "xpass" / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "m.py").write_text("def f():\n    return 0\n\n\ndef g():\n    return 0\n")
    before = "import pytest\n\nfrom m import f, g\n\n\n@pytest.mark.xfail(strict=False)\n"
    before += "def test_g():\n    assert g() == 1\n"
    (repo / "tests" / "test_m.py").write_text(before)
    with LocalSandbox(str(repo)) as b:
        b.write_file("tests/test_m.py", before + "\n\ndef test_f():\n    assert f() == 1\n")
        test_patch = b.diff()
    with LocalSandbox(str(repo)) as b:
        b.write_file("m.py", "def f():\n    return 1\n\n\ndef g():\n    return 0\n")
        gold = b.diff()
        b.write_file("m.py", "def f():\n    return 1\n\n\ndef g():\n    return 1\n")
        both = b.diff()
    record = {
        "instance_id": "x__xpass-1",
        "repo": "x/xpass",
        "base_commit": "0" * 40,
        "problem_statement": "f should return 1",
        "patch": gold,
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(["tests/test_m.py::test_f"]),
        "PASS_TO_PASS": json.dumps(["tests/test_m.py::test_g"]),
    }
    monkeypatch.setattr(swe, "FIXTURES", str(tmp_path))
    inst = swe.SweInstance.from_record(record, fixture="xpass")
    assert swe.grade_local(inst, gold)["score"] == 1.0  # test_g: XFAIL
    r = swe.grade_local(inst, both)  # test_g: XPASS
    assert r["score"] == 0.0 and r["fail_to_pass_passed"] == 1 and r["pass_to_pass_passed"] == 0


def _made_fixture(tmp_path, monkeypatch, name, files, test_files, gold_files, f2p, p2p):
    """A fixture ``name`` under ``tmp_path`` (``swe.FIXTURES`` pointed there): the repository
    ``files``, a ``test_patch`` writing ``test_files``, a gold patch writing ``gold_files``;
    returns (instance, gold patch)."""
    repo = tmp_path / name / "repo"
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    patches = []
    for changes in (test_files, gold_files):
        with LocalSandbox(str(repo)) as b:
            for rel, text in changes.items():
                b.write_file(rel, text)
            patches.append(b.diff())
    record = {
        "instance_id": f"x__{name}-1",
        "repo": f"x/{name}",
        "base_commit": "0" * 40,
        "problem_statement": "f should return 1",
        "patch": patches[1],
        "test_patch": patches[0],
        "FAIL_TO_PASS": json.dumps(f2p),
        "PASS_TO_PASS": json.dumps(p2p),
    }
    monkeypatch.setattr(swe, "FIXTURES", str(tmp_path))
    return swe.SweInstance.from_record(record, fixture=name), patches[1]


def test_grading_keeps_the_repositorys_own_pytest_setup(tmp_path, monkeypatch):
    """The repository's own ini works as under `python -m pytest`: a plugin module of the
    repository named with `-p` in its addopts, `pythonpath = src` ahead of a stale copy of the
    package at the root (the gold patch scores 1.0); and a `pythonpath = .` there does not let
    a patch's package metadata register a pytest plugin (no fix: 0)."""
    m0, m1 = "def f():\n    return 0\n", "def f():\n    return 1\n"
    tests = "from pkg.m import f\n\n\ndef test_old():\n    assert True\n"
    new_test = tests + "\n\ndef test_f():\n    assert f() == 1\n"
    ids = (["tests/test_m.py::test_f"], ["tests/test_m.py::test_old"])
    plug = "import pytest\n\n\n@pytest.fixture\ndef thing():\n    return 1\n"
    addopts = {
        "pkg/__init__.py": "",
        "pkg/m.py": m0,
        "myplug.py": plug,
        "pytest.ini": "[pytest]\naddopts = -p myplug\n",
        "tests/test_m.py": tests,
    }
    src = {
        "src/pkg/__init__.py": "",
        "src/pkg/m.py": m0,
        "pkg/__init__.py": "",  # a stale copy at the root, shadowed by pythonpath
        "pkg/m.py": m0,
        "pytest.ini": "[pytest]\npythonpath = src\n",
        "tests/test_m.py": tests,
    }
    for name, files, gold_file in (("addopts", addopts, "pkg/m.py"), ("src", src, "src/pkg/m.py")):
        inst, gold = _made_fixture(
            tmp_path, monkeypatch, name, files, {"tests/test_m.py": new_test}, {gold_file: m1}, *ids
        )
        assert swe.grade_local(inst, gold)["score"] == 1.0, name
    dot = {"pkg/__init__.py": "", "pkg/m.py": m0, "pytest.ini": "[pytest]\npythonpath = .\n"}
    inst, _ = _made_fixture(
        tmp_path,
        monkeypatch,
        "dot",
        {**dot, "tests/test_m.py": tests},
        {"tests/test_m.py": new_test},
        {"pkg/m.py": m1},
        *ids,
    )
    with LocalSandbox(swe.fixture_repo("dot")) as b:
        b.write_file("evilplug.py", _FAKE_PASS["conftest.py"])
        b.write_file(
            "evilplug-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: e\nVersion: 1\n"
        )
        b.write_file("evilplug-0.1.dist-info/entry_points.txt", "[pytest11]\nevil = evilplug\n")
        forged = b.diff()
    r = swe.grade_local(inst, forged)
    assert r["patch_applied"] and r["score"] == 0.0


def test_special_files_failed_starts_and_git_config_do_not_hang_leak_or_break_the_patch(
    inst, tmp_path, monkeypatch
):
    """A named pipe in the repository: the editor refuses it (it hung the call for good) and a
    fork clones the sandbox (the copy failed, leaking its folder); a docker sandbox whose
    setup fails removes its container, a clone that cannot start its image removes it; the
    patch keeps a/ b/ prefixes whatever git's diff.noprefix says (score 0 for a right fix)."""
    from harts_verl.workers.envs.sandbox import DockerSandbox

    _, edit, _ = _tools()
    with LocalSandbox(swe.fixture_repo(inst.fixture)) as box:
        box.exec("mkfifo pipe", 10)
        with pytest.raises(ValueError, match="'pipe' is not a regular file"):
            edit.run(box, {"command": "view", "path": "pipe"})
        other = box.clone()
        assert os.path.exists(os.path.join(other.root, "pipe"))
        other.close()
        box.exec("git config diff.noprefix true", 10)
        box.write_file("tinycalc/stats.py", box.read_file("tinycalc/stats.py").replace(OLD, FIX))
        patch = box.diff()
    assert patch.startswith("diff --git a/tinycalc/stats.py b/tinycalc/stats.py")
    assert swe.grade_local(inst, patch)["score"] == 1.0
    # docker: a log of the CLI's calls
    fake, log = tmp_path / "bin", tmp_path / "calls.log"
    fake.mkdir()
    (fake / "docker").write_text(
        f'#!/bin/bash\necho "$*" >> {log}\ncmd=$1; shift\ncase $cmd in\n'
        '  run) [ -n "$FAIL_RUN" ] && exit 125; echo id;;\n'
        '  exec) [ "$1" = -i ] && shift; [ "$1" = -w ] && { wd=$2; shift 2; }; shift; '
        'cd "$wd" && exec "$@";;\n  *) exit 0;;\nesac\n'
    )
    (fake / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    (tmp_path / "nogit").mkdir()
    with pytest.raises(RuntimeError, match="update-ref"):
        DockerSandbox("img", workdir=str(tmp_path / "nogit"))
    calls = log.read_text().splitlines()
    name = next(c.split()[3] for c in calls if c.startswith("run "))
    run_line = next(c for c in calls if c.startswith("run "))
    assert f"--label harts-verl.sandbox=1 --label harts-verl.owner={socket.gethostname()}:" in (
        run_line
    )  # a sweep finds what a killed worker left
    assert f"rm -f {name}" in calls
    work = tmp_path / "testbed"
    work.mkdir()
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "start"], check=True)
    box = DockerSandbox("img", workdir=str(work))
    monkeypatch.setenv("FAIL_RUN", "1")
    with pytest.raises(RuntimeError, match="docker run"):
        box.clone()
    box.close()
    calls = log.read_text().splitlines()
    (image,) = [c.split()[-1] for c in calls if c.startswith("commit ")]
    assert f"rmi -f {image}" in calls


def test_bad_commands_and_paths_are_named_errors(inst):
    """A NUL byte or a lone surrogate in a command or path, a command line longer than Linux
    takes in one argument, a file created below a file: ValueErrors naming the field and the
    way around (they were OSErrors / UnicodeEncodeErrors naming nothing, one with the host's
    sandbox folder)."""
    from harts_verl.workers.envs.sandbox import MAX_COMMAND_BYTES

    bash, edit, _ = _tools()
    with LocalSandbox(swe.fixture_repo(inst.fixture)) as box:
        with pytest.raises(ValueError, match="command: contains a NUL byte at index 4"):
            bash.run(box, {"command": "echo\0x"})
        with pytest.raises(ValueError, match="command: '\\\\ud83d' at index 5 is not"):
            bash.run(box, {"command": "echo \ud83d"})
        with pytest.raises(ValueError, match=f"command: {MAX_COMMAND_BYTES + 1} bytes, more"):
            bash.run(box, {"command": "#" * (MAX_COMMAND_BYTES + 1)})
        assert bash.run(box, {"command": "true #" + "x" * (MAX_COMMAND_BYTES - 7)}) is not None
        with pytest.raises(ValueError, match="path: contains a NUL byte"):
            edit.run(box, {"command": "view", "path": "READ\0ME.md"})
        with pytest.raises(ValueError, match=r"path: 'README\.md/x\.py': a part of it before"):
            edit.run(box, {"command": "create", "path": "README.md/x.py", "file_text": "x"})
        with pytest.raises(ValueError, match="path: 'tinycalc' is a folder"):
            box.write_file("tinycalc", "x")


def test_reading_a_folder_closes_its_descriptor(inst):
    """``read_file`` of a folder: os.fdopen refused the descriptor without closing it (one fd
    leaked per call) and the error named the fd number instead of the path."""
    with LocalSandbox(swe.fixture_repo(inst.fixture)) as box:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            with pytest.raises(IsADirectoryError, match="'tinycalc'"):
                box.read_file("tinycalc")
        assert len(os.listdir("/proc/self/fd")) == before
