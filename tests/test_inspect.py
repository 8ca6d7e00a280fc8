"""Forest inspection statistics, PNG plot, and the ``harts-verl inspect`` command."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from _strategies import sequence_lists
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_verl.cli import main
from harts_verl.tree import RolloutForest, plan_linear_calls
from harts_verl.tree.inspect import forest_statistics, plot_statistics, segment_depths

# Root 1: [1,2] forks at depth 2 into [3,4] (forks at depth 4 into [5,6] / [7,8]) and [9].
# Root 2: [5,5].
SEQS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [1, 2, 9], [5, 5]]


def test_statistics_of_a_known_forest():
    f = RolloutForest.from_sequences(SEQS)
    st = forest_statistics(f, chunk_size=4)
    assert st["summary"]["compact_tokens"] == f.num_compact_tokens == 11
    assert st["roots"] == 2
    assert st["depth_histogram"] == {"1": 1, "2": 1, "3": 2}
    assert st["branching_histogram"] == {"2": 2}
    assert st["summary"]["branch_rows"] == 2 and "forks" not in st["summary"]  # one name each
    forks = st["forks"]
    assert forks["count"] == 4  # child segments at depths 2, 4, 4, 2
    assert forks["inside_chunk"] == 2 and forks["inside_chunk_fraction"] == pytest.approx(0.5)
    # Replay is the linear plan's: of the two depth-2 children of [1, 2], one continues the
    # root's member (no replay) and the other starts a member at boundary 0 and replays rows
    # [0, 2): 2 tokens. The depth-4 forks sit on a chunk boundary. (Σ fork % chunk over all
    # child segments, 2 + 0 + 0 + 2 = 4, charged the continuing child too.)
    assert forks["replay_tokens"] == 2 == plan_linear_calls(f, chunk_size=4).replay_tokens
    # key rows: each segment's root path, [1,2] 2 + [3,4] 4 + [5,6] 6 + [7,8] 6 + [9] 3 + [5,5] 2
    assert st["attention"]["key_rows"] == 23
    assert st["attention"]["key_rows_per_compact_row"] == round(23 / 11, 4)
    assert forks["linear_rounds"] == plan_linear_calls(f, chunk_size=4).num_rounds == 2
    assert forest_statistics(f, chunk_size=2)["forks"]["inside_chunk_fraction"] == 0.0
    assert forest_statistics(f, chunk_size=64)["forks"]["inside_chunk_fraction"] == 1.0
    assert "plan" not in st
    np.testing.assert_array_equal(segment_depths(f), [1, 2, 3, 3, 2, 1])


def test_statistics_with_plan_are_json_ready():
    f = RolloutForest.from_sequences(SEQS)
    st = forest_statistics(f, capacity_tokens=7, dp_size=2)
    text = json.dumps(st)
    plan = json.loads(text)["plan"]
    assert plan["dp_size"] == 2
    assert len(plan["slot_work"]) == plan["slots"]
    assert sum(map(sum, plan["slot_work"])) == plan["total_compact_tokens"]
    assert plan["lower_bound_compact_tokens"] <= plan["total_compact_tokens"]
    assert plan["natural_partition_compact_tokens"] >= plan["total_compact_tokens"]


def test_statistics_oversize_runs_alone_by_default():
    f = RolloutForest.from_sequences(SEQS)
    st = forest_statistics(f, capacity_tokens=4)
    assert st["plan"]["total_compact_tokens"] >= f.num_compact_tokens


def test_bad_chunk_size():
    f = RolloutForest.from_sequences(SEQS)
    for bad in (0, -1, 2.0, True, None, 2**63, 2**64):
        with pytest.raises(ValueError, match="chunk_size"):
            forest_statistics(f, chunk_size=bad)
    # numpy integers are ints, as in plan_linear_calls
    st = forest_statistics(f, chunk_size=np.int64(2))
    assert st["forks"]["chunk_size"] == 2 and isinstance(st["forks"]["chunk_size"], int)
    assert st["forks"]["replay_tokens"] == plan_linear_calls(f, chunk_size=2).replay_tokens
    json.dumps(st)


def test_not_a_forest_is_a_type_error():
    with pytest.raises(TypeError, match="forest"):
        forest_statistics([[1, 2]])  # type: ignore[arg-type]


def test_replay_is_the_linear_plans():
    """One fork at depth 3 with chunk 2: the continuing child replays nothing, the other one
    replays row [2, 3) — 1 token (Σ fork % chunk over both children said 2)."""
    g = RolloutForest.from_sequences([[0, 1, 2, 3, 4], [0, 1, 2, 9, 9]])
    assert forest_statistics(g, chunk_size=2)["forks"]["replay_tokens"] == 1
    assert plan_linear_calls(g, chunk_size=2).replay_tokens == 1


def test_lower_bound_counts_oversize_copies_once():
    """Two copies of an oversize trajectory share one microbatch (7 = 6 + 1 planned): the bound
    charges one copy (it charged both: 13 > 7)."""
    f = RolloutForest.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [7]])
    plan = forest_statistics(f, capacity_tokens=4)["plan"]
    assert plan["total_compact_tokens"] == 7
    assert plan["lower_bound_compact_tokens"] == 7
    assert plan["oversize_trajectories"] == 2 and plan["oversize_microbatches"] == 1
    fits = forest_statistics(f, capacity_tokens=6)["plan"]
    assert fits["oversize_trajectories"] == 0 and fits["oversize_microbatches"] == 0


@settings(max_examples=40, deadline=None)
@given(sequence_lists(max_traj=8), st.integers(1, 8), st.sampled_from([1, 2, 3]))
def test_statistics_match_the_planners(seqs, cap, chunk):
    """With copies, prefixes and capacities below the longest trajectory: the lower bound never
    exceeds the planned total, and the replay is the linear call plan's."""
    f = RolloutForest.from_sequences(seqs)
    st_ = forest_statistics(f, chunk_size=chunk, capacity_tokens=cap, dp_size=2)
    plan = st_["plan"]
    assert f.num_compact_tokens <= plan["lower_bound_compact_tokens"]
    assert plan["lower_bound_compact_tokens"] <= plan["total_compact_tokens"]
    linear = plan_linear_calls(f, chunk_size=chunk)
    assert st_["forks"]["replay_tokens"] == linear.replay_tokens
    assert st_["forks"]["linear_rounds"] == linear.num_rounds


def test_plot_cost_does_not_grow_with_replicas(tmp_path, monkeypatch):
    """Many replicas, few microbatches: the slot panel draws the non-empty microbatches in one
    bar call (one call per replica took ~3 ms each: minutes at --dp 65536)."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4, 5], [1, 2, 3]])
    st = forest_statistics(f, capacity_tokens=4, dp_size=4096)
    drawn: list[int] = []
    real = Axes.bar

    def bar(self, x, height, *args, **kwargs):
        drawn.append(int(np.size(x)))
        return real(self, x, height, *args, **kwargs)

    monkeypatch.setattr(Axes, "bar", bar)
    plot_statistics(st, tmp_path / "p.png")
    assert len(drawn) <= 8 and sum(drawn) <= 20, drawn


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(0)
    seqs = []
    for g in range(3):
        prompt = [g + 10, *rng.integers(0, 50, 200).tolist()]
        for _ in range(6):
            seqs.append(prompt + rng.integers(0, 50, int(rng.integers(50, 400))).tolist())
    f = RolloutForest.from_sequences(seqs)
    for cap in (None, 1500):
        st = forest_statistics(f, capacity_tokens=cap, dp_size=4)
        out = tmp_path / f"plot_{cap}.png"
        plot_statistics(st, out, title="test")
        data = out.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) > 20_000


def test_cli_inspect(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    f = RolloutForest.from_sequences(SEQS)
    path = tmp_path / "forest.npz"
    f.save(path)
    png = tmp_path / "out.png"
    rc = main(["inspect", str(path), "--capacity", "7", "--dp", "2", "--plot", str(png)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["trajectories"] == 4
    assert out["plan"]["capacity_tokens"] == 7
    assert out["plot"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
    rc = main(["inspect", str(path), "--chunk-size", "2"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["forks"]["inside_chunk_fraction"] == 0.0 and "plan" not in out


def _one_line_error(capsys, argv: list[str], msg: str) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harts-verl inspect: "), (argv, err)
    assert msg in err[0], (argv, err)
    return err[0]


def test_cli_inspect_input_errors(tmp_path, capsys, monkeypatch):
    """Missing, directory, junk and foreign files, bad planner values and bad plot paths: exit
    status 2 and one line naming the file or the flag."""
    monkeypatch.delenv("HARTS_VERL_DEBUG", raising=False)
    good = tmp_path / "f.npz"
    RolloutForest.from_sequences(SEQS).save(good)
    (tmp_path / "junk.npz").write_bytes(b"junk\n")
    (tmp_path / "trunc.npz").write_bytes(good.read_bytes()[:300])
    np.savez(tmp_path / "other.npz", a=np.arange(3))
    (tmp_path / "plots").mkdir()
    for argv, msg in [
        ([str(tmp_path / "missing.npz")], "missing.npz: no such file"),
        ([str(tmp_path)], "is a directory"),
        ([str(tmp_path / "junk.npz")], "junk.npz: not a forest file"),
        ([str(tmp_path / "trunc.npz")], "trunc.npz: not a forest file"),
        ([str(tmp_path / "other.npz")], "other.npz: not a forest file (an .npz archive with"),
        ([str(good), "--dp", "2"], "--dp needs --capacity"),
        ([str(good), "--work-slack", "0.1"], "--work-slack needs --capacity"),
        ([str(good), "--plot", str(tmp_path / "plots")], "--plot: "),
        ([str(good), "--plot", str(tmp_path / "x.nope")], "--plot: unsupported format '.nope'"),
        ([str(good), "--plot", str(tmp_path / "no" / "x.png")], "--plot: cannot write"),
        ([str(good), "--plot", ""], "--plot: expected a file name"),  # was silently no plot
        # the plot destination is checked before the forest is read
        ([str(tmp_path / "missing.npz"), "--plot", str(tmp_path / "x.nope")], "--plot"),
    ]:
        _one_line_error(capsys, ["inspect", *argv], msg)
    assert list((tmp_path / "plots").iterdir()) == []


def test_cli_errors_keep_paths_as_given_and_seed_needs_restarts(tmp_path, capsys, monkeypatch):
    """A path holding a field's name (``chunk_size``, ``dp_size``, ``seed``) is named as
    written, not with flags spliced in (``runs/--chunk-size_64/--dp_8.npz``); ``--seed`` acts
    only through ``--restarts`` (it was accepted and ignored), which needs ``--capacity``; with
    both, the seed reaches the planner."""
    monkeypatch.delenv("HARTS_VERL_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs" / "chunk_size_64"
    runs.mkdir(parents=True)
    (runs / "dp_size_8.npz").write_text("junk\n")
    _one_line_error(
        capsys,
        ["inspect", "runs/chunk_size_64/dp_size_8.npz"],
        ("inspect: runs/chunk_size_64/dp_size_8.npz: not a forest file"),
    )
    _one_line_error(capsys, ["inspect", "seed"], "inspect: seed: no such file")
    good = tmp_path / "f.npz"
    RolloutForest.from_sequences(SEQS).save(good)
    _one_line_error(capsys, ["inspect", str(good), "--seed", "3"], "--seed needs --restarts")
    _one_line_error(capsys, ["inspect", str(good), "--restarts", "2"], "--restarts needs")
    outs = []
    for seed in ("0", "5"):
        argv = ["inspect", str(good), "--capacity", "7", "--restarts", "2", "--seed", seed]
        assert main(argv) == 0
        outs.append(json.loads(capsys.readouterr().out)["plan"])
    assert outs[0]["total_compact_tokens"] == outs[1]["total_compact_tokens"] > 0
    from harts_verl.cli import _phrase

    flags = {"capacity_tokens": "--capacity"}
    assert _phrase(ValueError("x: more than capacity_tokens=7"), flags) == (
        "x: more than --capacity=7"
    )
    assert _phrase(ValueError("/a/capacity_tokens_1/f: no"), flags) == "/a/capacity_tokens_1/f: no"
    assert _phrase(ValueError("x must divide capacity_tokens."), flags) == (
        "x must divide --capacity."
    )


def test_cli_inspect_planner_values_are_named_as_the_flags(tmp_path, capsys, monkeypatch):
    """Planner settings argparse cannot bound are checked before planning, named as flags."""
    monkeypatch.delenv("HARTS_VERL_DEBUG", raising=False)
    path = tmp_path / "f.npz"
    RolloutForest.from_sequences(SEQS).save(path)
    big = str(2**64)
    for argv, msg in [
        (["--capacity", big], "--capacity: expected an int"),
        (["--capacity", "4", "--dp", str(2**17)], "--dp: expected an int"),
        (["--chunk-size", big], "--chunk-size: expected an int"),
    ]:
        _one_line_error(capsys, ["inspect", str(path), *argv], msg)


def test_cli_inspect_internal_errors_keep_their_traceback(tmp_path, capsys, monkeypatch):
    """An error of the statistics or planning themselves (past reading the inputs) is a bug:
    raised as it is (exit status 1 with a traceback), never a one-line user error."""
    import harts_verl.tree.inspect as insp

    monkeypatch.delenv("HARTS_VERL_DEBUG", raising=False)

    def fail(*a, **k):
        raise ValueError("capacity_tokens: a planner bug")

    monkeypatch.setattr(insp, "forest_statistics", fail)
    path = tmp_path / "f.npz"
    RolloutForest.from_sequences(SEQS).save(path)
    with pytest.raises(ValueError, match="a planner bug"):
        main(["inspect", str(path), "--capacity", "3"])
    assert capsys.readouterr().err == ""


def test_cli_inspect_keeps_statistics_when_the_plot_fails(tmp_path, capsys, monkeypatch):
    """A plot that fails after the statistics were computed is reported as ``plot_error``; the
    JSON is printed and the exit status is 0."""
    import harts_verl.tree.inspect as insp

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(insp, "plot_statistics", broken)
    path = tmp_path / "f.npz"
    RolloutForest.from_sequences(SEQS).save(path)
    assert main(["inspect", str(path), "--plot", str(tmp_path / "p.png")]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["plot_error"] == "OSError: disk full" and "plot" not in out
    assert out["summary"]["trajectories"] == 4
    assert "plot failed" in captured.err


def test_cli_inspect_reports_the_written_plot_path(tmp_path, capsys):
    """``--plot X`` without a suffix writes X.png and reports it."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "f.npz"
    RolloutForest.from_sequences(SEQS).save(path)
    assert main(["inspect", str(path), "--plot", str(tmp_path / "fig")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plot"] == str(tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "fig").exists()


def test_empty_forest_statistics_and_plot(tmp_path, capsys):
    """The empty forest has statistics (zero counts, a plan without slots) and a plot."""
    pytest.importorskip("matplotlib")
    f = RolloutForest.from_sequences([])
    st_ = forest_statistics(f, capacity_tokens=4, dp_size=2)
    assert st_["plan"]["slots"] == 0 and st_["plan"]["slot_work"] == []
    assert st_["summary"]["trajectories"] == 0 and st_["depth_histogram"] == {}
    out = plot_statistics(st_, tmp_path / "empty.png")
    assert out == str(tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes()[:4] == b"\x89PNG"
    path = tmp_path / "empty.npz"
    f.save(path)
    png = tmp_path / "cli.png"
    args = ["inspect", str(path), "--capacity", "4", "--dp", "2", "--plot", str(png)]
    assert main(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["plot"] == str(png) and "plot_error" not in res
    assert res["plan"]["microbatches"] == 0


def test_plot_path_checks(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from harts_verl.tree.inspect import plot_path

    assert plot_path(tmp_path / "a") == str(tmp_path / "a.png")
    assert plot_path(str(tmp_path / "a.PDF")) == str(tmp_path / "a.PDF")
    (tmp_path / "d").mkdir()
    (tmp_path / "e.png").mkdir()
    for bad, msg in [
        (tmp_path / "d", "is a directory"),
        (tmp_path / "e", "is a directory"),  # e -> e.png, a directory
        (tmp_path / "x.foo", "unsupported format '.foo'"),
        (tmp_path / "none" / "x.png", "cannot write"),
        ("", "expected a file name"),
    ]:
        with pytest.raises(ValueError, match=msg) as info:
            plot_path(bad)
        assert str(info.value).startswith("plot: ")
    # .pgf: matplotlib runs LaTeX to write it (it failed after the whole measurement)
    monkeypatch.setenv("PATH", str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"'\.pgf' needs LaTeX \(xelatex\)"):
        plot_path(tmp_path / "a.pgf")


def test_json_text_is_strict():
    from harts_verl.tree.inspect import json_text

    assert json.loads(json_text({"a": [1.0, 2]})) == {"a": [1.0, 2]}
    with pytest.raises(ValueError, match=r"non-finite values in the result: a\[1\], b\.c"):
        json_text({"a": [1.0, float("nan")], "b": {"c": float("inf")}})


def test_load_forest_errors(tmp_path):
    from harts_verl.tree.inspect import load_forest

    good = tmp_path / "f.npz"
    RolloutForest.from_sequences(SEQS).save(good)
    assert load_forest(good).equals(RolloutForest.from_sequences(SEQS))
    np.savez(tmp_path / "other.npz", a=np.arange(3), b=np.arange(2))
    # a torch.save zip (a batch for `check --batch`): said so, not listed as its pickle's
    # members ("an .npz archive with arrays 'batch/data.pkl', 'batch/byteorder', ...")
    import zipfile

    with zipfile.ZipFile(tmp_path / "batch.pt", "w") as z:  # torch.save's layout, no torch
        for name in ("data.pkl", "byteorder", "version", ".data/serialization_id"):
            z.writestr(f"batch/{name}", b"0")
    for bad, msg in [
        (tmp_path / "nope.npz", "no such file"),
        (tmp_path, "is a directory"),
        (tmp_path / "other.npz", r"not a forest file \(an \.npz archive with arrays 'a', 'b'"),
        (tmp_path / "batch.pt", r"batch\.pt: not a forest file \(a torch\.save file; a forest "),
    ]:
        with pytest.raises(ValueError, match=msg):
            load_forest(bad)


def test_inspect_command_does_not_import_torch(tmp_path):
    """``harts-verl inspect`` builds only its own parser: it reads numpy, never torch (the other
    commands' option lists imported it, seconds before any inspect output or error)."""
    forest = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4]])
    path = str(tmp_path / "f.npz")
    forest.save(path)
    code = (
        "import json, sys; from harts_verl.cli import main\n"
        f"assert main(['inspect', {path!r}, '--capacity', '4']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["summary"]["trajectories"] == 2


def test_cli_inspect_notes_oversize_trajectories_and_reports_progress(tmp_path, capsys):
    """A capacity below the longest trajectory is no error (each runs whole in a microbatch of
    its own, counted in the JSON) but is said on stderr, as ``bench`` says it (inspect printed
    nothing); a plan of many trajectories, which can take a minute, announces itself and its
    time on stderr (``--no-progress``: not), and stdout stays the JSON alone."""
    path = tmp_path / "f.npz"
    RolloutForest.from_sequences(SEQS).save(path)
    assert main(["inspect", str(path), "--capacity", "4"]) == 0
    captured = capsys.readouterr()
    plan = json.loads(captured.out)["plan"]
    assert plan["oversize_trajectories"] == 2 and plan["oversize_microbatches"] == 2
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harts-verl inspect: note: 2 trajectories")
    assert "--capacity 4" in err[0]
    assert main(["inspect", str(path), "--capacity", "8"]) == 0
    assert capsys.readouterr().err == ""  # nothing to say
    rng = np.random.default_rng(0)
    many = [[int(rng.integers(3)), *rng.integers(0, 50, 5).tolist()] for _ in range(1000)]
    RolloutForest.from_sequences(many).save(tmp_path / "many.npz")
    assert main(["inspect", str(tmp_path / "many.npz"), "--capacity", "64", "--dp", "2"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    err = captured.err.strip().splitlines()
    assert len(err) == 2 and "planning 1,000 trajectories" in err[0], err
    assert "planned" in err[1] and " s" in err[1], err
    argv = ["inspect", str(tmp_path / "many.npz"), "--capacity", "64", "--no-progress"]
    assert main(argv) == 0
    assert capsys.readouterr().err == ""


def test_cli_inspect_reports_a_slow_plan_of_few_trajectories(tmp_path, capsys, monkeypatch):
    """Fewer trajectories than the announcing threshold, but a plan that takes a while (many
    replicas, restarts, work slack): announced once it has taken ``_PROGRESS_AFTER_S``, with
    its time; a quick one says nothing; one oversize trajectory is said in the singular."""
    import harts_verl.cli as cli
    import harts_verl.tree.inspect as inspect_module

    path = tmp_path / "f.npz"
    RolloutForest.from_sequences(SEQS).save(path)
    statistics = inspect_module.forest_statistics

    def slow(*a, **kw):
        time.sleep(0.6)
        return statistics(*a, **kw)

    monkeypatch.setattr(inspect_module, "forest_statistics", slow)
    monkeypatch.setattr(cli, "_PROGRESS_AFTER_S", 0.05)
    assert main(["inspect", str(path), "--capacity", "8", "--dp", "2"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    err = captured.err.strip().splitlines()
    assert len(err) == 2 and f"planning {len(SEQS)} trajectories" in err[0], err
    assert err[1].startswith("harts-verl inspect: planned "), err
    assert main(["inspect", str(path), "--capacity", "8", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(cli, "_PROGRESS_AFTER_S", 30.0)
    assert main(["inspect", str(path), "--capacity", "8"]) == 0
    assert capsys.readouterr().err == ""
    RolloutForest.from_sequences([[1, 2, 3], [1, 2, 3, 4, 5, 6, 7]]).save(tmp_path / "one.npz")
    assert main(["inspect", str(tmp_path / "one.npz"), "--capacity", "4"]) == 0
    assert "note: 1 trajectory is longer than --capacity 4" in capsys.readouterr().err


def test_token_files_read_as_the_forest_of_their_trajectories(tmp_path, capsys):
    """JSON Lines (lists or objects with input_ids, blank lines skipped), JSON (a list, or an
    object with input_ids) and a torch batch dump give ``inspect`` the same statistics as the
    saved forest of the same trajectories; ``check --batch`` reads the token files too."""
    import torch

    from harts_verl.tree.token_files import read_token_lists
    from harts_verl.workers.check import load_sequences

    forest = RolloutForest.from_sequences(SEQS)
    forest.save(tmp_path / "f.npz")
    lines = [
        json.dumps(s) if i % 2 else json.dumps({"input_ids": s, "reward": 0.5})
        for i, s in enumerate(SEQS)
    ]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:2]) + "\n\n  \n" + "\n".join(lines[2:]))
    (tmp_path / "b.ndjson").write_text("\n".join(json.dumps(s) for s in SEQS) + "\n")
    (tmp_path / "c.json").write_text(json.dumps(SEQS))
    (tmp_path / "d.JSON").write_text(json.dumps({"input_ids": SEQS, "rewards": [1, 2, 3, 4]}))
    torch.save([torch.tensor(s) for s in SEQS], tmp_path / "e.pt")

    def stats() -> dict:
        out = json.loads(capsys.readouterr().out)
        assert out["plan"].pop("planning_seconds") >= 0
        return out

    assert main(["inspect", str(tmp_path / "f.npz"), "--capacity", "8"]) == 0
    want = stats()
    for name in ("a.jsonl", "b.ndjson", "c.json", "d.JSON", "e.pt"):
        path = tmp_path / name
        if name != "e.pt":
            got = read_token_lists(path)
            assert [a.tolist() for a in got] == SEQS and all(a.dtype == np.int64 for a in got)
            assert load_sequences(str(path)) == SEQS
        assert main(["inspect", str(path), "--capacity", "8"]) == 0
        assert stats() == want, name


@pytest.mark.parametrize(
    "name,text,msg",
    [
        ("bool.jsonl", "[1, 2]\n[1, true]\n", r"line 2: token ids must be integers, got a bool"),
        ("float.jsonl", "[1, 2.5]\n", r"line 1: token ids must be integers"),
        ("neg.jsonl", "\n[1, -4]\n", r"line 2: negative token id -4"),
        ("huge.jsonl", "[1, 9223372036854775808]\n", r"line 1: token id 9223372036854775808 "),
        ("empty.jsonl", "[1]\n[]\n", r"line 2: empty trajectory"),
        ("nested.jsonl", "[1, [2]]\n", r"line 1: ragged nesting"),
        ("notjson.jsonl", "[1, 2]\n[1, 2,\n", r"line 2: not JSON \(Expecting value at column"),
        (
            "keys.jsonl",
            '{"ids": [1]}\n',
            r"line 1: expected a list of token ids or an object "
            r"with 'input_ids', got an object with keys 'ids'",
        ),
        ("str.jsonl", '"hello"\n', r"line 1: expected a list of token ids .* got str \"hello\""),
        ("blank.jsonl", "\n \n", r"blank\.jsonl: the file holds no trajectories"),
        (
            "one.json",
            "[1, 2, 3]",
            r"trajectory 0: .* got int 1 \(the file is a list of "
            r"trajectories: wrap one trajectory in a list\)",
        ),
        (
            "obj.json",
            '{"ids": []}',
            r"obj\.json: expected a list of trajectories or an object "
            r"with 'input_ids', got an object with keys 'ids'",
        ),
        ("flat.json", '{"input_ids": [1, 2]}', r"input_ids: expected a list of token-id lists"),
        ("scalar.json", "7", r"scalar\.json: expected a list of trajectories .* got int"),
        ("none.json", "[]", r"none\.json: the file holds no trajectories"),
        ("bad.json", "[[1, 2]", r"bad\.json: not JSON"),
        ("idx.json", '[[1], {"input_ids": [2, "x"]}]', r"trajectory 1: token ids must be integers"),
        # Python's json reads NaN / Infinity and floats: named with their position
        (
            "nan.jsonl",
            "[1, NaN, 3]\n",
            r"line 1: token ids must be integers, got NaN at position 1",
        ),
        ("inf.json", "[[1], [-Infinity]]", r"trajectory 1: .* got -Infinity at position 0"),
        ("whole.jsonl", "[7]\n[1, 1e3]\n", r"line 2: token ids must be integers, got 1000\.0 at"),
        ("null.jsonl", '{"input_ids": null}\n', r"line 1: input_ids: expected a list .* got null"),
        ("num.jsonl", '{"input_ids": 5}\n', r"line 1: input_ids: expected a list .*, got 5$"),
        # past the parser: Python's digit limit for int(), nesting deeper than its recursion
        ("digits.jsonl", "[1, " + "9" * 5000 + "]\n", r"line 1: not readable JSON \(Exceeds"),
        ("deep.json", "[" * 100_000 + "]" * 100_000, r"deep\.json: not readable JSON \(nested"),
        # a JSON file's error says its line, not only the column
        (
            "lines.json",
            "[\n [1, 2],\n [3,, 4]\n]\n",
            r"not JSON \(Expecting value at line 3 column",
        ),
        # a form feed is no line break of JSON Lines (str.splitlines took it for one)
        ("ff.jsonl", "[1]\f[2]\n", r"line 1: not JSON \(Extra data at column 4\)"),
    ],
)
def test_token_file_errors_name_the_file_and_line(tmp_path, capsys, name, text, msg):
    from harts_verl.tree.token_files import read_token_lists

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=msg):
        read_token_lists(path)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"harts-verl inspect: {path}: ") and len(err.splitlines()) == 1, err


def test_token_file_reader_refuses_what_is_not_one(tmp_path):
    from harts_verl.tree.token_files import is_token_file, read_token_lists

    assert is_token_file("a.JSONL") and is_token_file("b.json") and not is_token_file("c.npz")
    (tmp_path / "dir.jsonl").mkdir()
    for path, msg in [
        (tmp_path / "nope.jsonl", "nope.jsonl: no such file"),
        (tmp_path / "dir.jsonl", r"dir\.jsonl: is a directory"),
        (tmp_path / "x.txt", r"x\.txt: expected a token file \(\.json / \.jsonl / \.ndjson\)"),
    ]:
        with pytest.raises(ValueError, match=msg):
            read_token_lists(path)
    (tmp_path / "latin.jsonl").write_bytes(b"[1, 2]\n\xff\n")
    with pytest.raises(ValueError, match=r"latin\.jsonl: not UTF-8 text"):
        read_token_lists(tmp_path / "latin.jsonl")


def test_token_file_lines_end_at_newlines_only_and_a_bom_is_skipped(tmp_path):
    """JSON strings may hold U+2028, U+2029 and U+0085 unescaped (json.dumps with
    ensure_ascii=False writes them so): they do not end a JSON Lines line, and the line numbers
    of the errors after them stay the file's; CRLF ends a line; a UTF-8 byte-order mark at the
    start (Windows editors, PowerShell) is skipped."""
    from harts_verl.tree.token_files import read_token_lists

    text = "".join(
        json.dumps({"text": f"a{sep}b", "input_ids": [1, 2, n]}, ensure_ascii=False) + "\r\n"
        for n, sep in enumerate(["\u2028", "\u2029", "\x85", "\x1e"])
    )
    path = tmp_path / "sep.jsonl"
    path.write_text(text, encoding="utf-8", newline="")
    assert [a.tolist() for a in read_token_lists(path)] == [[1, 2, n] for n in range(4)]
    path.write_text(text + "[1, -1]\n", encoding="utf-8", newline="")
    with pytest.raises(ValueError, match=r"sep\.jsonl: line 5: negative token id -1"):
        read_token_lists(path)
    for name, body in [("bom.jsonl", "[1, 2]\n[3]"), ("bom.json", "[[1, 2], [3]]")]:
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + body.encode())
        assert [a.tolist() for a in read_token_lists(tmp_path / name)] == [[1, 2], [3]]


@pytest.mark.parametrize(
    "seqs,msg",
    [([[1, 2], []], "trajectory 1: empty trajectory"), ([[1, -2]], "trajectory 0: negative")],
)
def test_inspect_dump_errors_name_the_file(tmp_path, capsys, seqs, msg):
    """A .pt dump's bad trajectory is named with the file (was the forest's argument:
    'sequences[1]: empty trajectory', no file)."""
    import torch

    path = tmp_path / "b.pt"
    torch.save(seqs, path)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"harts-verl inspect: {path}: {msg}"), err
