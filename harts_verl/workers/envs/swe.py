"""SWE-bench tasks: instance records, veRL dataset rows, and the test-based reward.

* :class:`SweInstance` parses a SWE-bench record (the Hugging Face dataset fields
  ``instance_id``, ``repo``, ``base_commit``, ``problem_statement``, ``FAIL_TO_PASS``,
  ``PASS_TO_PASS``, ``test_patch``, ...; the test lists may be JSON strings, as in the dataset).
* :func:`dataset_rows` turns records into rows of veRL's RLHF dataset: chat ``prompt``,
  ``agent_name``, and ``extra_info`` with the ``tools_kwargs`` the SWE tools read
  (:mod:`harts_verl.workers.envs.swe_tools`) and the record for the reward.
* :func:`compute_score` is a ``reward.custom_reward_function``: it takes the model's patch
  (``swe_patch``, recorded by the tools in the trajectory's ``extra_fields``) and scores 1.0 iff
  after applying it and the task's ``test_patch`` every ``FAIL_TO_PASS`` and ``PASS_TO_PASS``
  test passes. Bundled fixtures are graded locally (:func:`grade_local`, pytest in a temporary
  copy); real instances with the ``swebench`` harness in docker (:func:`grade_swebench`).

The bundled fixture ``tinycalc`` (``fixtures/swe/tinycalc``) is a git-less Python repository
whose hidden test (in its ``test_patch``) fails until ``mean([])`` raises ``ValueError``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from harts_verl.workers.envs.sandbox import LocalSandbox, swebench_harness

__all__ = [
    "DATA_SOURCE",
    "FIXTURE_DATA_SOURCE",
    "SYSTEM_PROMPT",
    "SweInstance",
    "compute_score",
    "dataset_rows",
    "fixture_instances",
    "fixture_repo",
    "grade_local",
    "grade_swebench",
    "parse_junit_report",
    "parse_pytest_report",
]

logger = logging.getLogger(__name__)

DATA_SOURCE = "swebench"
FIXTURE_DATA_SOURCE = "harts_swe_fixture"
# extra_fields key: the SWE-bench image namespace the tools' sandbox ran (graded in the same)
NAMESPACE_KEY = "swe_docker_namespace"
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "swe")

SYSTEM_PROMPT = (
    "You are a software engineer working in a code repository. Use the tools to inspect and "
    "edit the code and to run commands: `bash` runs a shell command in the repository root, "
    "`str_replace_editor` views, creates and edits files. Make the smallest change that "
    "resolves the issue, check it, then call `submit`."
)

_REQUIRED = ("instance_id", "repo", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS")


def _test_list(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{name}: expected a JSON list of test ids, got {value[:80]!r}"
            ) from exc
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{name}: expected a list of test id strings, got {type(value).__name__}")
    return tuple(value)


@dataclass(frozen=True)
class SweInstance:
    """One SWE-bench task. ``record`` keeps every field of the source record (the harness
    needs ``version``, ``environment_setup_commit``, ...); ``fixture`` names a bundled fixture
    repository (graded locally) or is ``None`` (a real instance, graded by the harness)."""

    instance_id: str
    repo: str
    problem_statement: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    test_patch: str = ""
    base_commit: str = ""
    fixture: str | None = None
    record: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_record(cls, record: dict[str, Any], fixture: str | None = None) -> SweInstance:
        """Parse a SWE-bench record; ``ValueError`` names a missing or malformed field (and the
        record's ``instance_id`` when it has one)."""
        if not isinstance(record, dict):
            raise TypeError(f"record: expected a dict, got {type(record).__name__}")
        try:
            return cls._parse(record, fixture)
        except ValueError as exc:
            iid = record.get("instance_id")
            if isinstance(iid, str) and iid.strip():
                raise ValueError(f"instance {iid!r}: {exc}") from None
            raise

    @classmethod
    def _parse(cls, record: dict[str, Any], fixture: str | None) -> SweInstance:
        for key in _REQUIRED:
            if key not in record or record[key] is None:
                raise ValueError(f"{key}: missing from the SWE-bench record")
        for key in ("instance_id", "repo", "problem_statement"):
            if not isinstance(record[key], str) or not record[key].strip():
                raise ValueError(f"{key}: expected a non-empty string, got {record[key]!r}")
        f2p = _test_list(record["FAIL_TO_PASS"], "FAIL_TO_PASS")
        if not f2p:
            raise ValueError("FAIL_TO_PASS: expected at least one test id")
        return cls(
            instance_id=record["instance_id"],
            repo=record["repo"],
            problem_statement=record["problem_statement"],
            fail_to_pass=f2p,
            pass_to_pass=_test_list(record["PASS_TO_PASS"], "PASS_TO_PASS"),
            test_patch=str(record.get("test_patch") or ""),
            base_commit=str(record.get("base_commit") or ""),
            fixture=fixture,
            record=dict(record),
        )


def fixture_repo(name: str) -> str:
    """Folder of the bundled fixture repository ``name``; ``ValueError`` if there is none."""
    path = os.path.join(FIXTURES, str(name), "repo")
    if not os.path.isdir(path):
        known = sorted(os.listdir(FIXTURES)) if os.path.isdir(FIXTURES) else []
        raise ValueError(f"fixture: unknown SWE fixture {name!r} (bundled: {known})")
    return path


def fixture_instances() -> list[SweInstance]:
    """The bundled fixture tasks (each folder of ``fixtures/swe`` with an ``instance.json``)."""
    out = []
    for name in sorted(os.listdir(FIXTURES)):
        path = os.path.join(FIXTURES, name, "instance.json")
        if os.path.isfile(path):
            with open(path) as f:
                out.append(SweInstance.from_record(json.load(f), fixture=name))
    return out


def user_prompt(inst: SweInstance) -> str:
    """The task message: the issue text and what a solution must do."""
    return (
        f"Repository: {inst.repo}\n\n<issue>\n{inst.problem_statement.strip()}\n</issue>\n\n"
        "Edit the repository so the issue is resolved. Do not change the tests. "
        "When done, call `submit`."
    )


def dataset_rows(
    instances: list[SweInstance], split: str = "train", system_prompt: str = SYSTEM_PROMPT
) -> list[dict[str, Any]]:
    """Rows of veRL's RLHF dataset, one per instance (``agent_name: harts_tool_agent``).

    ``extra_info.tools_kwargs`` gives every SWE tool the same ``create_kwargs``
    (``instance_id``, ``fixture``, ``record``), so whichever tool runs first can start the
    sandbox; ``extra_info.swe_instance`` (JSON) is what :func:`compute_score` grades against.
    """
    rows = []
    for i, inst in enumerate(instances):
        if not isinstance(inst, SweInstance):
            raise TypeError(f"instances[{i}]: expected SweInstance, got {type(inst).__name__}")
        record = json.dumps(inst.record)
        create = {"instance_id": inst.instance_id, "fixture": inst.fixture or "", "record": record}
        rows.append(
            {
                "data_source": FIXTURE_DATA_SOURCE if inst.fixture else DATA_SOURCE,
                "prompt": [
                    {"role": "system", "content": system_prompt},
                    {"role": "user", "content": user_prompt(inst)},
                ],
                "agent_name": "harts_tool_agent",
                "ability": "swe",
                "reward_model": {"style": "rule", "ground_truth": inst.instance_id},
                "extra_info": {
                    "index": i,
                    "split": split,
                    "instance_id": inst.instance_id,
                    "swe_fixture": inst.fixture or "",
                    "swe_instance": record,
                    "tools_kwargs": {
                        name: {"create_kwargs": create}
                        for name in ("bash", "str_replace_editor", "submit")
                    },
                },
            }
        )
    return rows


# ---------------------------------------------------------------------- grading
_PYTEST_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+)")


def parse_pytest_report(log: str) -> dict[str, str]:
    """Test id → status from ``pytest -rA`` summary lines (``PASSED tests/x.py::t``); the
    same lines SWE-bench's pytest log parser reads."""
    status: dict[str, str] = {}
    for line in log.splitlines():
        m = _PYTEST_LINE.match(line.strip())
        if m:
            status[m.group(2)] = m.group(1)
    return status


def _junit_address(test_id: str) -> tuple[str, str]:
    """The (classname, name) pytest's JUnit XML writes for the test id ``test_id``
    (``tests/test_x.py::TestC::test_m[p]`` → ``("tests.test_x.TestC", "test_m[p]")``): its
    address as collected, also for a test defined in another file (an inherited method)."""
    path, bracket, params = test_id.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def parse_junit_report(xml_text: str, test_ids: Sequence[str]) -> dict[str, str]:
    """Status of each of ``test_ids`` (as SWE-bench lists them) that ran, from a pytest
    ``--junitxml`` file: ``PASSED``, or ``FAILED`` / ``ERROR`` / ``SKIPPED`` for a testcase with
    such a child (whatever else is printed), ``XFAIL`` for a skip of type ``pytest.xfail`` (an
    expected failure); a test that did not run is absent ({} for text that is no XML)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError:
        return {}
    ran: dict[tuple[str, str], str] = {}
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        state = "PASSED"
        for tag, word in (("skipped", "SKIPPED"), ("error", "ERROR"), ("failure", "FAILED")):
            if tag in kinds:
                state = word
        skip = case.find("skipped")
        if state == "SKIPPED" and skip is not None and skip.get("type") == "pytest.xfail":
            state = "XFAIL"
        ran[(case.get("classname") or "", case.get("name") or "")] = state
    return {t: ran[a] for t in test_ids if (a := _junit_address(t)) in ran}


# Files through which a patch could change how pytest runs or reports rather than what the code
# does: graded as in the starting tree (reset, or removed when new), like the test files.
_TEST_HARNESS_FILES = frozenset(
    {
        "conftest.py",
        "pytest.py",
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "sitecustomize.py",
        "usercustomize.py",
    }
)


_PASSED = ("PASSED", "XFAIL")  # SWE-bench's test_passed


def _report(inst: SweInstance, status: dict[str, str], applied: bool, note: str = "") -> dict:
    """The grade of a test ``status`` map as SWE-bench computes it from a ``pytest -rA`` log:
    resolved iff the patch applied and every FAIL_TO_PASS / PASS_TO_PASS test passed
    (``PASSED``, or ``XFAIL``: an expected failure). Anything else fails it: absent,
    ``FAILED``, ``ERROR``, ``SKIPPED`` (its ``-rA`` line carries no test id, so SWE-bench finds
    the test absent) and ``XPASS`` (no status SWE-bench parses)."""
    f2p = sum(status.get(t) in _PASSED for t in inst.fail_to_pass)
    p2p = sum(status.get(t) in _PASSED for t in inst.pass_to_pass)
    tests = (*inst.fail_to_pass, *inst.pass_to_pass)
    resolved = applied and all(status.get(t) in _PASSED for t in tests)
    return {
        "score": 1.0 if resolved else 0.0,
        "resolved": bool(resolved),
        "patch_applied": bool(applied),
        "fail_to_pass_passed": int(f2p),
        "pass_to_pass_passed": int(p2p),
        "note": note,
    }


def _patch_paths(patch: str) -> list[str]:
    """The files a ``git diff`` patch touches (both sides of each ``diff --git`` header; paths
    with spaces only where the header is unambiguous), in order, without repeats."""
    out: list[str] = []
    for line in patch.splitlines():
        if not line.startswith("diff --git a/"):
            continue
        body = line[len("diff --git a/") :]
        half = len(body) // 2  # "X b/X": both halves equal unless the file is renamed
        if body[half : half + 3] == " b/" and body[:half] == body[half + 3 :]:
            names = [body[:half]]
        else:
            names = body.split(" b/", 1)
        out.extend(n for n in names if n and n not in out)
    return out


# The grading process: the installed pytest and its installed plugins (entry points, loaded
# here, autoload then off) are imported before the repository joins sys.path, so neither a
# pytest.py nor a package's metadata there (nor a `pythonpath` ini entry pointing into it) can
# stand in for or add one; the repository then joins sys.path first, as `python -m pytest`
# puts it. The ids of unexpectedly passing (XPASS) tests are written to argv[1]; the process ends
# with os._exit (bound before the code under test runs) once pytest returns: the report is
# written by then, and exit handlers of the code under test do not run after it.
_GRADE_RUNNER = """
import importlib.metadata, json, os, sys
import pytest

_exit = os._exit
plugins = [ep.load() for ep in importlib.metadata.entry_points(group="pytest11")]
autoload = os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"

class HartsGrade:
    def __init__(self):
        self.xpassed = []

    def pytest_configure(self, config):  # autoload is decided: the tests' own value back
        if autoload is None:
            os.environ.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.passed and hasattr(report, "wasxfail"):
            self.xpassed.append(report.nodeid)

grade = HartsGrade()
sys.path.insert(0, os.getcwd())
code = pytest.main(sys.argv[2:], plugins=[*plugins, grade])
with open(sys.argv[1], "w") as f:
    json.dump(grade.xpassed, f)
sys.stdout.flush()
sys.stderr.flush()
_exit(int(code))
"""


def grade_local(inst: SweInstance, patch: str, timeout: float = 120.0) -> dict[str, Any]:
    """Grade ``patch`` on a bundled fixture: copy the repository, ``git apply`` the patch,
    reset the files the task's ``test_patch`` touches to the starting tree (as the SWE-bench
    harness does: the model's edits of those test files do not count), and the test-harness
    files the patch touches (``conftest.py``, ``pytest.ini``, ``tox.ini``, ``setup.cfg``,
    ``pyproject.toml``, a ``pytest.py`` / ``sitecustomize.py`` module), ``git apply`` the
    ``test_patch``, run the FAIL_TO_PASS + PASS_TO_PASS tests with this Python's installed
    pytest and its installed plugins (both found before the repository joins ``sys.path``) and
    read the outcome from its JUnit XML, written outside the repository (printed lines cannot
    forge it). ``score`` is 1.0 iff the patch applies and every listed test passes or is an
    expected failure (:func:`_report`: skipped and unexpectedly passing tests fail, as in
    SWE-bench). Not a security boundary: the code under test runs in the pytest process."""
    if inst.fixture is None:
        raise ValueError(f"fixture: instance {inst.instance_id} is not a bundled fixture")
    if not isinstance(patch, str):
        raise TypeError(f"patch: expected a str, got {type(patch).__name__}")
    with LocalSandbox(fixture_repo(inst.fixture)) as box:
        for name, text in (("model patch", patch), ("test_patch", inst.test_patch)):
            paths = []
            if name == "test_patch":  # its files, and the harness files the model's patch touched
                paths = _patch_paths(text) if text.strip() else []
                paths += [
                    p
                    for p in _patch_paths(patch)
                    if os.path.basename(p) in _TEST_HARNESS_FILES and p not in paths
                ]
            if paths:  # back to the starting tree, or gone if new
                box.exec(
                    f"for p in {' '.join(map(shlex.quote, paths))}; do if git cat-file -e "
                    'HEAD:"$p" 2>/dev/null; then git checkout -q HEAD -- "$p"; '
                    'else rm -rf -- "$p"; fi; done',
                    30,
                )
            if not text.strip():
                continue
            box.write_file(".harts_patch.diff", text if text.endswith("\n") else text + "\n")
            res = box.exec("git apply --whitespace=nowarn .harts_patch.diff", 60)
            if res.exit_code != 0:
                return _report(inst, {}, False, f"{name} does not apply: {res.output[-500:]}")
        box.exec("rm -f .harts_patch.diff", 30)
        test_ids = (*inst.fail_to_pass, *inst.pass_to_pass)
        with tempfile.TemporaryDirectory(prefix="harts_grade_") as out:
            xml = os.path.join(out, f"{uuid.uuid4().hex}.xml")
            xpassed = os.path.join(out, f"{uuid.uuid4().hex}.json")
            args = ["-rA", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *test_ids]
            cmd = " ".join(
                map(shlex.quote, [sys.executable, "-P", "-c", _GRADE_RUNNER, xpassed, *args])
            )
            res = box.exec(cmd, timeout)
            if res.timed_out:
                return _report(inst, {}, True, f"tests timed out after {timeout:g} s")
            try:
                with open(xml, encoding="utf-8") as f:
                    report = parse_junit_report(f.read(), test_ids)
            except OSError:
                report = {}
            try:  # JUnit XML writes an unexpected pass as a plain pass
                with open(xpassed, encoding="utf-8") as f:
                    unexpected = set(json.load(f))
            except (OSError, ValueError):
                unexpected = set()
            report.update({t: "XPASS" for t in report if t in unexpected})
        note = "" if report else f"no test report: {res.output[-500:]}"
        return _report(inst, report, True, note)


def grade_swebench(
    inst: SweInstance, patch: str, timeout: float = 1800.0, namespace: str | None = "swebench"
) -> dict[str, Any]:
    """Grade ``patch`` with the SWE-bench harness (``swebench`` 4.x,
    :func:`~harts_verl.workers.envs.sandbox.swebench_harness`; needs docker and the instance
    image): ``run_instance`` applies the patch in the instance container, runs the task's eval
    script and reports ``resolved``. Each call uses a fresh ``run_id`` (the harness caches
    reports by run id); its logs (``logs/run_evaluation/<run_id>``) are removed once it
    completed, and kept, with a WARNING naming them, when it did not (a patch that does not
    apply, tests that timed out, or the harness or docker failing: the harness reports them
    alike, and all score 0)."""
    harness = swebench_harness()
    try:
        import docker
    except ImportError as exc:
        raise ImportError(
            "grading real SWE-bench instances needs the docker SDK (pip install docker)"
        ) from exc
    spec = harness.make_test_spec(inst.record, namespace=namespace)
    pred = {"instance_id": inst.instance_id, "model_name_or_path": "harts", "model_patch": patch}
    run_id = f"harts-{uuid.uuid4().hex[:12]}"
    out = harness.run_instance(
        spec,
        pred,
        rm_image=False,
        force_rebuild=False,
        client=docker.from_env(),
        run_id=run_id,
        timeout=timeout,
    )
    logs = os.path.join(str(harness.log_dir), run_id)
    if out.get("completed"):
        shutil.rmtree(logs, ignore_errors=True)
    else:
        logger.warning(
            "swebench: the harness did not complete instance %s (the patch does not apply, the "
            "tests timed out, or the harness / docker failed); it scores 0; logs: %s",
            inst.instance_id,
            logs,
        )
    resolved = bool(out.get("resolved"))
    return {
        "score": 1.0 if resolved else 0.0,
        "resolved": resolved,
        "patch_applied": bool(out.get("completed")),
        "fail_to_pass_passed": -1,
        "pass_to_pass_passed": -1,
        "note": "" if out.get("completed") else f"harness evaluation did not complete ({logs})",
    }


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """veRL reward function. Reads ``extra_info["swe_instance"]`` (from the dataset row) and
    ``extra_info["swe_patch"]`` (the sandbox diff recorded by the tools; absent = no change),
    and grades a SWE-bench instance in the image namespace the tools ran
    (``extra_info["swe_docker_namespace"]``, default ``swebench``).
    Returns veRL's dict form: ``score`` (1.0 iff resolved) plus numeric details
    (``resolved``, ``patch_applied``, ``fail_to_pass_passed``, ``pass_to_pass_passed``)."""
    info = extra_info or {}
    raw = info.get("swe_instance")
    if not raw:
        raise ValueError("extra_info.swe_instance: missing (build rows with swe.dataset_rows)")
    record = json.loads(raw) if isinstance(raw, str) else dict(raw)
    inst = SweInstance.from_record(record, fixture=info.get("swe_fixture") or None)
    patch = info.get("swe_patch") or ""
    if not patch.strip():
        report = _report(inst, {}, False, "empty patch")
    elif inst.fixture:
        report = grade_local(inst, patch)
    else:  # in the image namespace the sandbox ran (the tools' docker_namespace)
        report = grade_swebench(inst, patch, namespace=info.get(NAMESPACE_KEY, "swebench"))
    report.pop("note")  # veRL stacks the extra keys into arrays and metrics: numbers only
    return report
