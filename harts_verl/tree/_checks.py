"""Small input checks shared across the package (numpy only)."""

from __future__ import annotations

from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool (``True`` is no count)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)
