"""Summarise local CPU recipe logs: per-step reward, mean turns (1 + assistant + tool turns) and
response length, HARTS compression and actor update time, HARTS steps against a stock-path
baseline step.

Usage: python summary.py BASELINE_LOG HARTS_LOG
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable

_STEP = re.compile(r"step:(\d+) - (.*)$")


def _number(value: str) -> float:
    """A console metric value, also when printed as ``np.float64(0.5)`` or ``np.int32(6)``."""
    return float(re.sub(r"^np\.\w+\((.*)\)$", r"\1", value.strip()))


def parse_lines(lines: Iterable[str]) -> dict[int, dict[str, float]]:
    """Numeric metrics of veRL's console ``step:N - key:value - ...`` lines, by step
    (non-numeric values are left out)."""
    steps: dict[int, dict[str, float]] = {}
    for line in lines:
        m = _STEP.search(line)
        if not m:
            continue
        metrics = {}
        for item in m.group(2).split(" - "):
            key, _, value = item.partition(":")
            try:
                metrics[key.strip()] = _number(value)
            except ValueError:
                pass
        steps[int(m.group(1))] = metrics
    return steps


def parse(path: str) -> dict[int, dict[str, float]]:
    """:func:`parse_lines` of a log file."""
    with open(path, errors="replace") as f:
        return parse_lines(f)


def row(label: str, m: dict[str, float]) -> str:
    path = "stock" if m.get("actor/harts/fallback", 1.0) else "harts"
    return (
        f"{label:<10} {path:<6} {m.get('critic/score/mean', float('nan')):>7.3f} "
        f"{m.get('num_turns/mean', float('nan')):>6.2f} {m.get('response_length/mean', float('nan')):>6.1f} "
        f"{m.get('actor/harts/compression', float('nan')):>8.2f} "
        f"{m.get('actor/loss', float('nan')):>9.4f} {m.get('actor/grad_norm', float('nan')):>9.4f} "
        f"{m.get('timing_s/update_actor', float('nan')):>9.3f} {m.get('timing_s/step', float('nan')):>8.2f}"
    )


def main(baseline_log: str, harts_log: str) -> int:
    base, harts = parse(baseline_log), parse(harts_log)
    if not harts:
        print(f"no step metrics in {harts_log}", file=sys.stderr)
        return 1
    print(
        f"{'step':<10} {'path':<6} {'reward':>7} {'turns':>6} {'resp':>6} {'compr':>8} {'loss':>9} {'grad_norm':>9} "
        f"{'update_s':>9} {'step_s':>8}"
    )
    for s, m in sorted(base.items()):
        print(row(f"base {s}", m))
    for s, m in sorted(harts.items()):
        print(row(f"harts {s}", m))
    if base:
        b = sum(m.get("timing_s/update_actor", 0.0) for m in base.values()) / len(base)
        h = sum(m.get("timing_s/update_actor", 0.0) for m in harts.values()) / len(harts)
        print(
            f"mean update_actor: baseline {b:.3f}s, harts {h:.3f}s (x{b / h if h else float('nan'):.2f})"
        )
        # like for like: both runs' first step (each includes the first-call warm-up)
        b1 = base[min(base)].get("timing_s/update_actor", float("nan"))
        h1 = harts[min(harts)].get("timing_s/update_actor", float("nan"))
        print(f"first-step update_actor: baseline {b1:.3f}s, harts {h1:.3f}s (x{b1 / h1:.2f})")
        print(
            "(a smoke test, not a benchmark: each step rolls out its own batch, the baseline "
            "runs padded rows (see demo.sh), and its mean holds only its first step with the "
            "first-call warm-up; `harts-verl bench` times both paths on one batch)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
