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

from harts_verl.tree._checks import check_input_file
from harts_verl.tree.forest import as_trajectory_array

__all__ = [
    "JSON_LINES_SUFFIXES",
    "TOKEN_FILE_SUFFIXES",
    "is_token_file",
    "read_token_lists",
    "trajectory_arrays",
    "trajectory_lines",
]

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
        ids = _input_ids(item, where, "a list of token ids")
        if not isinstance(ids, list):  # null, a number, a string, an object
            raise ValueError(f"{where}: {_KEY}: expected a list of token ids, got {_short(ids)}")
        return ids
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
    try:
        text = json.dumps(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."


def _trajectory(ids: Any, where: str) -> np.ndarray:
    """``ids`` as :func:`as_trajectory_array` checks them, its errors named by ``where``; a
    JSON number that is no integer (``2.0``, ``1e3``, ``NaN``, ``Infinity``) is named with its
    position (numpy's "float64" would be all the reader says of it)."""
    try:
        return as_trajectory_array(ids, 0)
    except ValueError as exc:
        for j, x in enumerate(ids if isinstance(ids, list) else ()):  # the error path only
            if isinstance(x, float):
                raise ValueError(
                    f"{where}: token ids must be integers, got {_short(x)} at position {j}"
                ) from None
        raise ValueError(f"{where}: {str(exc).partition(': ')[2]}") from None


def trajectory_arrays(seqs: Any, name: str | os.PathLike[str]) -> list[np.ndarray]:
    """The trajectories ``seqs`` read from the file ``name`` (e.g. by ``check --batch``'s
    reader), each validated as :meth:`RolloutForest.from_sequences` validates it, as a 1-D
    int64 array; a ValueError names ``name: trajectory i`` (the forest's own names its
    argument, ``sequences[i]``, not the file)."""
    name = os.fspath(name)
    return [_trajectory(t, f"{name}: trajectory {i}") for i, t in enumerate(seqs)]


def _read_text(name: str) -> str:
    check_input_file(name, "a token file (.json / .jsonl)")
    try:
        with open(name, encoding="utf-8-sig") as fh:  # a leading byte-order mark is skipped
            return fh.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _parse(text: str, where: str, lines: bool = False) -> Any:
    """``text`` parsed; a ValueError naming ``where`` (and the line of a whole file's error,
    unless ``lines``: ``where`` names it) for what is not JSON, an integer past Python's digit
    limit and nesting too deep for the parser."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        at = f"column {exc.colno}" if lines else f"line {exc.lineno} column {exc.colno}"
        raise ValueError(f"{where}: not JSON ({exc.msg} at {at})") from None
    except ValueError as exc:  # int('9' * 5000): past sys.get_int_max_str_digits()
        raise ValueError(f"{where}: not readable JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{where}: not readable JSON (nested too deeply)") from None


def _json_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of each non-blank line of a JSON Lines text."""
    # lines end at "\n" alone (a "\r" before it is JSON whitespace): str.splitlines also
    # splits at U+2028, U+0085, form feeds, ..., which JSON strings may hold as they are
    return [(n, line) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]


def trajectory_lines(path: str | os.PathLike[str]) -> list[int] | None:
    """The line of each trajectory of a JSON Lines token file (1-based, in
    :func:`read_token_lists`' order), to name a trajectory found wrong later (e.g. an id
    outside a model's vocabulary) by its line; None for any other file."""
    name = os.fspath(path)
    if not name.lower().endswith(JSON_LINES_SUFFIXES):
        return None
    return [n for n, _ in _json_lines(_read_text(name))]


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
        for n, line in _json_lines(text):
            where = f"{name}: line {n}"
            seqs.append(_trajectory(_ids_of(_parse(line, where, True), where), where))
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
