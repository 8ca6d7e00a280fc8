"""Release numbers of installed packages, as comparable tuples."""

from __future__ import annotations

import re

__all__ = ["release_tuple"]


def release_tuple(version: str) -> tuple[int, ...]:
    """``"3.6.0+git1234"`` → ``(3, 6, 0)``, ``"2.14.0a0"`` → ``(2, 14, 0)``.

    Guarantees: the leading numeric release parts of a PEP 440 / local version string, stopping at
    the first part that is not a plain number (a pre-release or dev suffix ends the tuple after
    its digits); ``()`` when the string starts with no digit.
    """
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() != len(piece):
            break
    return tuple(parts)
