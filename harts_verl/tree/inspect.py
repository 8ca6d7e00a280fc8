"""Forest inspection: shape statistics, planned microbatches, and a readable plot.

:func:`forest_statistics` returns a JSON-ready dict (numpy only); :func:`plot_statistics`
draws it with matplotlib (imported lazily, Agg backend). :func:`load_forest` reads a forest file
for a command line, :func:`plot_path` checks a plot destination before any work is done, and
:func:`json_text` prints a result as strict JSON. Used by ``harts-verl inspect`` (and the plot
and JSON helpers by ``harts-verl bench`` / ``check``).

Definitions:

* **depth** of a trajectory: the number of segments on its root-to-end path (1 = no fork above
  its end); the histogram counts trajectories per depth.
* **branching**: the number of children of every branch row (a row with >= 2 children); the
  histogram counts branch rows per child count. Roots are reported separately.
* **forks inside a chunk**: a fork is a child segment (any segment with a parent); its fork
  position is the depth of its first row. A fork whose position is not a multiple of
  ``chunk_size`` needs replay in chunked linear attention when it starts a new member (the child
  that continues its parent's member replays nothing). ``replay_tokens`` and ``linear_rounds``
  are the figures of the linear-attention call plan (:func:`plan_linear_calls`).
* **slot imbalance**: see :func:`harts_verl.tree.microbatch.slot_imbalance`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from harts_verl.tree._checks import check_input_file, check_int
from harts_verl.tree.forest import RolloutForest, attention_key_rows
from harts_verl.tree.linear_plan import plan_linear_calls
from harts_verl.tree.microbatch import (
    _Leaves,
    _oversize_groups,
    lower_bound_work,
    partition_works,
    plan_microbatches,
)

__all__ = [
    "forest_statistics",
    "json_text",
    "load_forest",
    "plot_path",
    "plot_statistics",
    "segment_depths",
]


def load_forest(path: str | os.PathLike[str]) -> RolloutForest:
    """The forest saved at ``path`` (:meth:`RolloutForest.load`), for a command line.

    Raises ``ValueError`` naming ``path`` when it does not exist or is a directory; any other
    problem is :meth:`RolloutForest.load`'s ValueError (which names the file and what is wrong,
    e.g. "not a forest file" for an ``.npz`` archive without a forest's arrays). An unreadable
    file raises the ``OSError`` of opening it."""
    name = os.fspath(path)
    check_input_file(name, "a forest file (.npz)")
    return RolloutForest.load(name)


def plot_path(path: str | os.PathLike[str]) -> str:
    """The file a plot requested at ``path`` is written to, checked before anything is drawn.

    ``path`` itself when it has a suffix; ``path + ".png"`` when it has none (what matplotlib
    would write, so the reported path is the real one). The suffix must be one of matplotlib's
    formats (``FigureCanvasBase.get_supported_filetypes``: png, pdf, svg, ...); the file must not
    be a directory, its directory must exist and be writable, and an existing file must be
    writable; ``.pgf`` needs matplotlib's LaTeX (``pgf.texsystem``) on PATH. Raises
    ``ValueError`` naming ``plot`` otherwise, or when matplotlib is not installed (it is in the
    ``bench`` extra). Nothing is created."""
    name = os.fspath(path)
    if not name:
        raise ValueError("plot: expected a file name, got ''")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as exc:
        raise ValueError(
            f"plot: matplotlib is needed to write {name!r} (pip install 'harts-verl[bench]')"
        ) from exc
    if os.path.isdir(name):
        raise ValueError(f"plot: {name!r} is a directory, expected a file name")
    suffix = os.path.splitext(name)[1]
    out = name if suffix else name + ".png"
    formats = FigureCanvasBase.get_supported_filetypes()
    fmt = os.path.splitext(out)[1][1:].lower()
    if fmt not in formats:
        raise ValueError(
            f"plot: unsupported format {suffix!r} of {name!r} (supported: "
            f"{', '.join('.' + f for f in sorted(formats))})"
        )
    if fmt == "pgf":  # matplotlib's pgf backend runs LaTeX to write it
        import shutil

        import matplotlib

        tex = matplotlib.rcParams["pgf.texsystem"]
        if shutil.which(tex) is None:
            raise ValueError(f"plot: {suffix!r} needs LaTeX ({tex}), which is not on PATH")
    if os.path.isdir(out):
        raise ValueError(f"plot: {out!r} (where {name!r} is written) is a directory")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ValueError(f"plot: cannot write {out!r} (no writable directory {parent!r})")
    if os.path.exists(out) and not os.access(out, os.W_OK):
        raise ValueError(f"plot: cannot write {out!r} (the file is not writable)")
    return out


def _non_finite(obj: Any, where: str = "") -> list[str]:
    """Paths (``a.b[2]``) of the non-finite floats in a JSON-ready object."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [where or "<value>"]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _non_finite(v, f"{where}.{k}" if where else k)]
    if isinstance(obj, list | tuple):
        return [p for i, v in enumerate(obj) for p in _non_finite(v, f"{where}[{i}]")]
    return []


def json_text(obj: Any, *, indent: int | None = 2) -> str:
    """``obj`` as strict JSON text (``allow_nan=False``): NaN and infinities are never printed.

    Raises ``ValueError`` listing the paths of the non-finite values when there are any (a
    result with such a figure is a bug to surface, not valid JSON), and ``TypeError`` for a
    value JSON cannot hold."""
    try:
        return json.dumps(obj, indent=indent, allow_nan=False)
    except ValueError:
        bad = _non_finite(obj)
        if not bad:
            raise
        raise ValueError(f"non-finite values in the result: {', '.join(bad)}") from None


def segment_depths(forest: RolloutForest) -> np.ndarray:
    """Number of segments from the root down to and including each segment (roots: 1)."""
    parent = forest.segments.parent_segment
    has = parent >= 0
    safe = np.maximum(parent, 0)
    depth = np.ones(parent.shape[0], dtype=np.int64)
    while True:  # one pass per level: at most the maximum depth passes
        new = np.where(has, depth[safe] + 1, 1)
        if np.array_equal(new, depth):
            return depth
        depth = new


def _hist(values: np.ndarray) -> dict[str, int]:
    if values.size == 0:
        return {}
    u, c = np.unique(values, return_counts=True)
    return {str(int(a)): int(b) for a, b in zip(u, c)}


def _quantiles(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {}
    qs = (0.0, 0.5, 0.9, 0.99, 1.0)
    return {f"p{round(q * 100)}": float(np.quantile(values, q)) for q in qs}


def forest_statistics(
    forest: RolloutForest,
    *,
    chunk_size: int = 64,
    capacity_tokens: int | None = None,
    dp_size: int = 1,
    seed: int = 0,
    allow_oversize: bool = True,
    **plan_options: Any,
) -> dict[str, Any]:
    """Statistics of ``forest`` as a JSON-ready dict; with ``capacity_tokens`` also the planned
    microbatches (:func:`plan_microbatches`; an oversize trajectory, its copies and its
    prefixes get a microbatch of their own).

    Keys: ``summary`` (sizes, compression), ``trajectory_length`` (quantiles),
    ``depth_histogram`` (segments per trajectory path), ``branching_histogram`` (children per
    branch row), ``roots``, ``forks`` (count, inside-chunk fraction, fork-position quantiles,
    and the linear-attention call plan's ``replay_tokens`` and ``linear_rounds``),
    ``attention`` (the ``key_rows`` a full-attention layer gathers,
    :func:`~harts_verl.tree.forest.attention_key_rows`, and per compact row), and ``plan``
    (summary, per-slot works and imbalance, P0 size, lower bound, ``oversize_trajectories``
    longer than the capacity and the ``oversize_microbatches`` that run them) when planned:
    ``plan.slot_work`` is a ``[slots][dp_size]`` list (``[]`` when the plan has no slots, e.g.
    for the empty forest, which is described like any other: zero counts, empty histograms).

    Guarantees: ``forks.replay_tokens`` equals ``plan_linear_calls(forest,
    chunk_size=chunk_size).replay_tokens``; ``plan.lower_bound_compact_tokens`` is at most the
    total work of any plan that runs each maximal oversize path (in a trie: each distinct
    oversize sequence) in a microbatch of its own, with the trajectories that share all their
    rows with it, as the planner does (hence at most ``plan.total_compact_tokens``): the
    :func:`lower_bound_work` of the other trajectories that fit plus each such path's length.

    Raises TypeError naming ``forest`` when it is not a :class:`RolloutForest`, ValueError
    naming ``chunk_size`` unless it is an int (Python or numpy) in ``[1, 2**63 - 1]``, and the
    planner's errors for the planning arguments.
    """
    if not isinstance(forest, RolloutForest):
        raise TypeError(f"forest: expected a RolloutForest, got {type(forest).__name__}")
    chunk_size = check_int("chunk_size", chunk_size, 1)
    seg = forest.segments
    n = forest.num_trajectories
    depth = segment_depths(forest)
    if n:
        last_rows = forest.semantic_rows[forest.row_offsets[1:] - 1]
        traj_depth = depth[forest.segment_of_row[last_rows]]
    else:
        traj_depth = np.zeros(0, np.int64)
    branch = forest.num_children[forest.num_children >= 2]
    forks = seg.fork_position[seg.parent_segment >= 0]
    inside = forks % chunk_size != 0
    linear = plan_linear_calls(forest, chunk_size=chunk_size)
    key_rows = attention_key_rows(forest)
    out: dict[str, Any] = {
        "summary": forest.summary(),
        "trajectory_length": _quantiles(forest.lengths.astype(np.float64)),
        "depth_histogram": _hist(traj_depth),
        "branching_histogram": _hist(branch),
        "roots": int(forest.roots.shape[0]),
        "forks": {
            "definition": "child segments; position = depth of the first row",
            "count": int(forks.shape[0]),
            "chunk_size": chunk_size,
            "inside_chunk": int(inside.sum()),
            "inside_chunk_fraction": float(inside.mean()) if forks.size else 0.0,
            "position": _quantiles(forks.astype(np.float64)),
            "replay_tokens": linear.replay_tokens,
            "linear_rounds": linear.num_rounds,
        },
        "attention": {
            "definition": "key rows a full-attention layer gathers: each segment's root path",
            "key_rows": key_rows,
            "key_rows_per_compact_row": round(key_rows / forest.num_compact_tokens, 4)
            if forest.num_compact_tokens
            else 0.0,
        },
    }
    if capacity_tokens is not None:
        plan = plan_microbatches(
            forest,
            capacity_tokens=capacity_tokens,
            dp_size=dp_size,
            seed=seed,
            allow_oversize=allow_oversize,
            **plan_options,
        )
        sw = plan.slot_work
        imb = plan.slot_imbalance()
        keep = forest.lengths <= capacity_tokens
        # Copies of one oversize sequence share a microbatch, with the prefixes it holds for
        # free: count each distinct one once, and bound the rest.
        big, big_works, absorbed = _oversize_groups(forest, np.flatnonzero(~keep), keep)
        rest = keep.copy()
        rest[absorbed] = False
        out["plan"] = {
            **plan.summary(),
            # the leaf view of the rest, not its forest (a subset forest cost 3 s of 4 at 32M
            # semantic tokens; the bound reads only lengths and LCPs in leaf order)
            "lower_bound_compact_tokens": lower_bound_work(
                _Leaves.of(forest, rest), capacity_tokens
            )
            + int(big_works.sum()),
            "oversize_trajectories": int((~keep).sum()),
            "oversize_microbatches": len(big),
            "expansion_vs_forest": plan.total_compact_tokens / max(forest.num_compact_tokens, 1),
            "slot_work": sw.tolist(),
            "slot_imbalance": [round(float(x), 6) for x in imb],
            "replica_work": plan.replica_work.tolist(),
            "natural_partition_compact_tokens": int(
                partition_works(forest, plan.natural_partition).sum()
            ),
        }
    return out


def plot_statistics(stats: dict[str, Any], path: str | os.PathLike[str], title: str = "") -> str:
    """Write a multi-panel figure of :func:`forest_statistics` output and return the file written.

    The file is :func:`plot_path` of ``path`` (checked before drawing: ``ValueError`` naming
    ``plot`` for a directory, an unwritable location or a format matplotlib cannot write; no
    suffix writes a PNG at ``path + ".png"``). Any forest can be drawn, the empty one included
    (its panels say there is nothing to show)."""
    out = plot_path(path)
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    plan = stats.get("plan")
    fig, axes = plt.subplots(2, 3, figsize=(16, 9.5), constrained_layout=True)
    s = stats["summary"]
    fig.suptitle(
        (title + "\n" if title else "")
        + f"{s['trajectories']} trajectories · {s['semantic_tokens']:,} semantic → "
        f"{s['compact_tokens']:,} compact tokens · compression {s['compression']:.2f}×",
        fontsize=13,
    )

    def integer_xticks(ax: Any, xs: list[int]) -> None:
        """One tick per bar for few bars (a locator puts fractions around one bar), else
        integer ticks."""
        if len(xs) <= 20:
            ax.set_xticks(xs)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    def bars(ax: Any, hist: dict[str, int], xlabel: str, ylabel: str, ttl: str) -> None:
        if not hist:
            ax.text(0.5, 0.5, "none", ha="center", va="center", transform=ax.transAxes)
        else:
            xs = [int(k) for k in hist]
            ax.bar(xs, list(hist.values()), color="#4C72B0", width=0.8)
            integer_xticks(ax, xs)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(ttl)
        ax.grid(axis="y", alpha=0.3)

    # 1: sizes
    ax = axes[0, 0]
    labels = ["semantic", "compact"]
    vals = [s["semantic_tokens"], s["compact_tokens"]]
    if plan:
        labels.append("planned")
        vals.append(plan["total_compact_tokens"])
    ax.bar(labels, vals, color=["#999999", "#4C72B0", "#DD8452"][: len(vals)])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:,}", ha="center", va="bottom", fontsize=9)
    ax.set_title("tokens: trajectory-wise vs compact vs planned microbatches")
    ax.set_ylabel("tokens")
    ax.grid(axis="y", alpha=0.3)

    bars(
        axes[0, 1],
        stats["depth_histogram"],
        "segments on the path (depth)",
        "trajectories",
        "depth histogram",
    )
    bars(
        axes[0, 2],
        stats["branching_histogram"],
        "children of a branch row",
        "branch rows",
        f"branching histogram ({stats['roots']} roots)",
    )

    # 4: forks vs chunk boundaries
    ax = axes[1, 0]
    f = stats["forks"]
    ax.bar(
        ["on a chunk boundary", "inside a chunk"],
        [f["count"] - f["inside_chunk"], f["inside_chunk"]],
        color=["#55A868", "#C44E52"],
    )
    ax.set_title(
        f"forks vs chunk size {f['chunk_size']}: {100 * f['inside_chunk_fraction']:.1f}% inside"
    )
    ax.set_ylabel("forks (child segments)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="y", alpha=0.3)

    # 5-6: plan
    ax5, ax6 = axes[1, 1], axes[1, 2]
    if plan and plan["slots"]:
        dp = int(plan["dp_size"])
        sw = np.asarray(plan["slot_work"], dtype=np.float64).reshape(-1, dp)
        slots = sw.shape[0]
        width = 0.8 / max(dp, 1)
        # One bar call, only for the non-empty microbatches (a call per replica, empty ones
        # included, took seconds per thousand replicas); replica r keeps the r-th colour of
        # the cycle, as one call per replica gave it.
        cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["#4C72B0"])
        s_idx, r_idx = np.nonzero(sw > 0)
        ax5.bar(
            s_idx + (r_idx - (dp - 1) / 2) * width,
            sw[s_idx, r_idx],
            width=width,
            color=[cycle[r % len(cycle)] for r in r_idx.tolist()],
        )
        ax5.axhline(plan["capacity_tokens"], color="k", ls="--", lw=1, label="capacity")
        ax5.set_xlabel("slot")
        ax5.set_ylabel("compact tokens")
        ax5.set_title(
            f"{plan['microbatches']} microbatch{'es' * (plan['microbatches'] != 1)} on {dp} replica{'s' * (dp != 1)} × "
            f"{slots} slot{'s' * (slots != 1)} "
            f"(bars = replicas)"
        )
        ax5.legend(loc="lower left", fontsize=8)
        ax5.grid(axis="y", alpha=0.3)
        imb = 100 * np.asarray(plan["slot_imbalance"])
        ax6.bar(np.arange(imb.shape[0]), imb, color="#8172B2")
        ax6.axhline(2.0, color="k", ls=":", lw=1, label="2%")
        ax6.set_xlabel("slot")
        ax6.set_ylabel("(max − mean) / max  [%]")
        ax6.set_title(
            f"within-slot imbalance: P50 {100 * plan['slot_imbalance_p50']:.1f}%, "
            f"P95 {100 * plan['slot_imbalance_p95']:.1f}%"
        )
        ax6.legend(loc="upper left", fontsize=8)
        ax6.grid(axis="y", alpha=0.3)
        for ax in (ax5, ax6):
            integer_xticks(ax, list(range(slots)))
    else:
        for ax in (ax5, ax6):
            ax.text(
                0.5,
                0.5,
                "no microbatches (empty forest)" if plan else "no plan (pass --capacity)",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
            ax.set_axis_off()
    try:
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out
