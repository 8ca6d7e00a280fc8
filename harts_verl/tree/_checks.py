"""Small input checks shared across the package (numpy only)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

INT64_MAX = int(np.iinfo(np.int64).max)
SEED_MAX = 2**64 - 1  # the largest seed torch.manual_seed takes


def check_input_file(name: str, expected: str) -> None:
    """ValueError naming ``name`` when no file is there: it does not exist, or it is a
    directory (the message says ``expected``, e.g. "a forest file (.npz)")."""
    if not os.path.exists(name):
        raise ValueError(f"{name}: no such file")
    if os.path.isdir(name):
        raise ValueError(f"{name}: is a directory, expected {expected}")


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool (``True`` is no count)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def exact_integers(seq: Any) -> np.ndarray | None:
    """A flat list/tuple whose items are all integers (Python or numpy, not bool) within the
    int64 range, as int64 (exact, whatever numpy's promotion of the mixed scalar types); None
    for anything else."""
    if not isinstance(seq, list | tuple):
        return None
    ok = all(isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_) for x in seq)
    if not ok:
        return None
    values = [int(x) for x in seq]
    info = np.iinfo(np.int64)
    if any(not (info.min <= v <= info.max) for v in values):
        return None
    return np.array(values, dtype=np.int64)


def int_outside_int64(seq: Any) -> int | None:
    """The first value of a flat list/tuple of Python ints that lies outside the int64 range
    (too large first: that is what turns the array into floats/objects); None when ``seq`` is
    not such a list or every value fits."""
    if not isinstance(seq, list | tuple) or not all(is_int(x) for x in seq):
        return None
    for x in seq:
        if x > INT64_MAX:
            return int(x)
    for x in seq:
        if x < -INT64_MAX - 1:
            return int(x)
    return None


def holds_bool(values: Any) -> bool:
    """Whether a list / tuple holds a bool (Python or numpy) among its items: numpy turns
    ``[True, 5]`` into int64 ``[1, 5]``, so a dtype check after ``np.asarray`` cannot see it.
    False for anything else (arrays carry their dtype)."""
    if not isinstance(values, list | tuple):
        return False
    kinds = set(map(type, values))
    return bool in kinds or np.bool_ in kinds


def check_int(name: str, value: Any, minimum: int, maximum: int | None = INT64_MAX) -> int:
    """``value`` as a Python int after checking it is an integer (:func:`is_int`) in
    ``[minimum, maximum]`` (``maximum=None``: no upper bound; by default the int64 range, so
    numpy arithmetic never overflows). Raises ValueError naming ``name``."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected an int <= {maximum}, got {value!r}")
    return int(value)


def finite_float(value: Any) -> float | None:
    """``value`` as a float when it is a finite real number (Python or numpy, not a bool), else
    None: a Python int too large for a float (``10**400``) is None, not an OverflowError."""
    if not isinstance(value, int | float | np.integer | np.floating) or isinstance(value, bool):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def check_positive(name: str, value: Any, *, none_ok: bool = False) -> float | None:
    """``value`` as a float after checking it is a finite real number > 0 (Python or numpy, not a
    bool); None stays None with ``none_ok``. Raises ValueError naming ``name``."""
    if value is None and none_ok:
        return None
    f = finite_float(value)
    if f is None or f <= 0:
        also = " or None" if none_ok else ""
        raise ValueError(f"{name}: expected a finite positive number{also}, got {value!r}")
    return f


def int_arg(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """argparse ``type=``: an int >= ``lo`` (and <= ``hi`` when given; ``ArgumentTypeError``
    "expected an int >= lo" / "expected an int in [lo, hi]")."""
    want = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {want}, got {v}")
        return v

    parse.__name__ = f"int>={lo}"
    return parse


def finite_float_arg(
    lo: float, *, inclusive: bool, hi: float | None = None, hi_inclusive: bool = True
) -> Callable[[str], float]:
    """argparse ``type=``: a finite float ``>= lo`` (``inclusive``) or ``> lo``, and with ``hi``
    also ``<= hi`` (``hi_inclusive``) or ``< hi``."""
    want = f"{'>=' if inclusive else '>'} {lo}"
    if hi is not None:
        want = f"in {'[' if inclusive else '('}{lo}, {hi}{']' if hi_inclusive else ')'}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a finite number {want}, got {text!r}"
            ) from None
        bad = not math.isfinite(v) or (v < lo if inclusive else v <= lo)
        if hi is not None:
            bad = bad or (v > hi if hi_inclusive else v >= hi)
        if bad:
            raise argparse.ArgumentTypeError(f"expected a finite number {want}, got {text!r}")
        return v

    parse.__name__ = f"float {want}"
    return parse
