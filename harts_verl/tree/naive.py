"""Naive dict-of-children trie: the readable reference for :class:`RolloutForest`.

Inserts token by token into nested dicts, then numbers nodes by a DFS visiting children in
ascending token order. Slow by design (Python per token); used by tests and the benchmark.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class NaiveForest:
    """Rows in DFS preorder (children in ascending token order) and per-trajectory row lists."""

    token_ids: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    multiplicity: np.ndarray
    subtree_size: np.ndarray
    trajectory_rows: list[np.ndarray]


def build_naive_trie(sequences: Sequence[Sequence[int]]) -> NaiveForest:
    """Reference trie of ``sequences`` (see module docstring)."""
    root: dict = {}
    counts: dict[int, int] = {}
    paths: list[list[int]] = []
    for seq in sequences:
        node = root
        path = []
        for tok in seq:
            tok = int(tok)
            child = node.get(tok)
            if child is None:
                child = {}
                node[tok] = child
            counts[id(child)] = counts.get(id(child), 0) + 1
            path.append(id(child))
            node = child
        paths.append(path)

    number: dict[int, int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    sizes: list[int] = []
    # Iterative DFS: (dict, token, parent_row, depth, exit_marker_row)
    stack: list[tuple] = [(root[t], t, -1, 0) for t in sorted(root, reverse=True)]
    exits: list[tuple[int, int]] = []
    while stack:
        item = stack.pop()
        if item[0] is None:  # exit marker: subtree of row item[1] is complete
            r = item[1]
            sizes[r] = len(tokens) - r
            continue
        node, tok, par, dep = item
        r = len(tokens)
        number[id(node)] = r
        tokens.append(tok)
        parents.append(par)
        depths.append(dep)
        sizes.append(0)
        stack.append((None, r))
        for t in sorted(node, reverse=True):
            stack.append((node[t], t, r, dep + 1))
    del exits
    mult = np.zeros(len(tokens), dtype=np.int64)
    for key, cnt in counts.items():
        mult[number[key]] = cnt
    rows = [np.array([number[k] for k in p], dtype=np.int64) for p in paths]
    return NaiveForest(
        np.array(tokens, dtype=np.int64),
        np.array(parents, dtype=np.int64),
        np.array(depths, dtype=np.int64),
        mult,
        np.array(sizes, dtype=np.int64),
        rows,
    )
