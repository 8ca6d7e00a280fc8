"""Trajectories from JSON and JSON Lines files (numpy only), for the command line.

A *token file* holds the token ids of a step's trajectories, one list per trajectory:

* JSON Lines (``.jsonl`` / ``.ndjson``): one trajectory per non-blank line, either a list of
  token ids (``[1, 2, 3]``) or an object whose ``input_ids`` is that list (other keys, e.g.
  rewards or masks, are not read);
* JSON (``.json``): a list of such items, or an object whose ``input_ids`` is a list of
  token-id lists.

Token ids are validated as :meth:`RolloutForest.from_sequences` validates them (integers, not
bools or floats, non-negative, within int64, no empty trajectory).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from harts_verl.tree.forest import as_trajectory_array

__all__ = ["JSON_LINES_SUFFIXES", "TOKEN_FILE_SUFFIXES", "is_token_file", "read_token_lists"]

JSON_LINES_SUFFIXES = (".jsonl", ".ndjson")
TOKEN_FILE_SUFFIXES = (".json", *JSON_LINES_SUFFIXES)
_KEY = "input_ids"


def is_token_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a token file by its suffix (case-insensitive)."""
    return os.fspath(path).lower().endswith(TOKEN_FILE_SUFFIXES)


def _input_ids(obj: dict, where: str, expected: str) -> Any:
    """``obj["input_ids"]``; a ValueError naming ``where``, ``expected`` and the keys found
    when it has none."""
    if _KEY not in obj:
        keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
        raise ValueError(
            f"{where}: expected {expected} or an object with {_KEY!r}, got an object with keys "
            f"{keys}"
        )
    return obj[_KEY]


def _ids_of(item: Any, where: str) -> Any:
    """The token-id list of one trajectory item (a list, or an object with ``input_ids``)."""
    if isinstance(item, dict):
        return _input_ids(item, where, "a list of token ids")
    if not isinstance(item, list):
        hint = (
            " (the file is a list of trajectories: wrap one trajectory in a list)"
            if isinstance(item, int) and not isinstance(item, bool)
            else ""
        )
        raise ValueError(
            f"{where}: expected a list of token ids or an object with {_KEY!r}, got "
            f"{type(item).__name__} {_short(item)}{hint}"
        )
    return item


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _trajectory(ids: Any, where: str) -> np.ndarray:
    """``ids`` as :func:`as_trajectory_array` checks them, its errors named by ``where``."""
    try:
        return as_trajectory_array(ids, 0)
    except ValueError as exc:
        raise ValueError(f"{where}: {str(exc).partition(': ')[2]}") from None


def _read_text(name: str) -> str:
    if not os.path.exists(name):
        raise ValueError(f"{name}: no such file")
    if os.path.isdir(name):
        raise ValueError(f"{name}: is a directory, expected a token file (.json / .jsonl)")
    try:
        with open(name, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None


def read_token_lists(path: str | os.PathLike[str]) -> list[np.ndarray]:
    """The trajectories of a token file (see module doc), in file order.

    Returns one 1-D int64 array per trajectory (each non-empty, ids >= 0). Raises
    ``ValueError`` naming the file and the line (JSON Lines) or trajectory (JSON) when the
    file does not exist, is a directory, is not UTF-8 / JSON, an item is neither a list of ids
    nor an object with ``input_ids``, an id is not a non-negative integer within int64, a
    trajectory is empty, or the file holds no trajectory; and for a suffix that is not a
    token file's.
    """
    name = os.fspath(path)
    if not is_token_file(name):
        raise ValueError(f"{name}: expected a token file ({' / '.join(TOKEN_FILE_SUFFIXES)})")
    text = _read_text(name)
    seqs: list[np.ndarray] = []
    if name.lower().endswith(JSON_LINES_SUFFIXES):
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                where = f"{name}: line {n}"
                seqs.append(_trajectory(_ids_of(_parse(line, where), where), where))
    else:
        obj = _parse(text, name)
        if isinstance(obj, dict):
            obj = _input_ids(obj, name, "a list of trajectories")
            if not isinstance(obj, list) or not all(isinstance(t, list) for t in obj):
                raise ValueError(f"{name}: {_KEY}: expected a list of token-id lists")
        if not isinstance(obj, list):
            raise ValueError(
                f"{name}: expected a list of trajectories or an object with {_KEY!r}, got "
                f"{type(obj).__name__}"
            )
        for i, item in enumerate(obj):
            where = f"{name}: trajectory {i}"
            seqs.append(_trajectory(_ids_of(item, where), where))
    if not seqs:
        raise ValueError(f"{name}: the file holds no trajectories")
    return seqs
