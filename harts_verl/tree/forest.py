"""The rollout forest: the token trie of a batch of trajectories in DFS preorder.

Built by sorting trajectories lexicographically and taking adjacent longest common prefixes
(LCPs): in leaf order, trajectory j shares exactly its first ``lcp(j-1, j)`` tokens with the
trajectories before it, so its new trie nodes are positions ``[lcp, L_j)``. Concatenating those
blocks in leaf order yields the rows in DFS preorder (children visited in token order).
All work is vectorized numpy over arrays; the only Python loops are over trajectories.
"""

from __future__ import annotations

import math
import os
import tokenize
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import numpy as np

from harts_verl.tree._checks import (
    INT64_MAX,
    check_int,
    exact_integers,
    holds_bool,
    int_outside_int64,
)
from harts_verl.tree._rangemin import RangeMin
from harts_verl.tree._ranges import concat_ranges

__all__ = ["RolloutForest", "Segments", "Turn", "as_trajectory_array", "attention_key_rows"]

_FORMAT_VERSION = 1
# What reading a member of an opened .npz raises when the file is damaged: a bad CRC or deflate
# stream, a local header claiming encryption, an unknown method or flag, an offset past the end.
_DAMAGED_MEMBER = (
    EOFError,
    OSError,
    RuntimeError,
    NotImplementedError,
    zipfile.BadZipFile,
    zlib.error,
    tokenize.TokenError,  # a member header numpy's parser cannot read (unbalanced brackets)
)


class _CorruptedFile(ValueError):
    """A damaged forest file, its message whole (not wrapped again by the callers)."""


def _member(path: Any, z: Any, key: str) -> np.ndarray:
    """Array ``key`` of the opened .npz ``z``, after checking that the data its header claims
    fits in the member (a damaged header claiming a huge shape made numpy allocate it first:
    MemoryError); ValueError naming ``path`` and the array otherwise."""
    info = z.zip.getinfo(f"{key}.npy")
    with z.zip.open(info) as f:
        try:
            major, _minor = np.lib.format.read_magic(f)
            read = {1: np.lib.format.read_array_header_1_0, 2: np.lib.format.read_array_header_2_0}
            shape, _fortran, dtype = read.get(major, np.lib.format.read_array_header_2_0)(f)
        except (ValueError, SyntaxError, tokenize.TokenError) as exc:
            raise _CorruptedFile(f"{path}: corrupted forest file (array {key!r}: {exc})") from None
        need, have = math.prod(shape) * dtype.itemsize, info.file_size - f.tell()
    if need > have:
        raise _CorruptedFile(
            f"{path}: corrupted forest file (array {key!r} claims shape {shape} of {dtype}, "
            f"{need} bytes, the file holds {have})"
        )
    return z[key]


@dataclass(frozen=True)
class Turn:
    """One recorded generation turn: its tokens extend the parent turn's trajectory.

    A trajectory is the concatenated ``token_ids`` of a root-to-leaf chain of turns (a leaf is a
    turn no other turn names as parent), or of the chain ending at a turn marked
    ``is_trajectory_end`` (a trajectory that other turns continue).
    """

    turn_id: Any
    parent_turn_id: Any | None
    token_ids: Any
    is_trajectory_end: bool = False


@dataclass(frozen=True)
class Segments:
    """Maximal single-child chains of rows; each is a contiguous row range in preorder.

    Attributes (all int64, one entry per segment, in preorder of their first rows):
      first_row: first row of the segment.
      length: number of rows.
      parent_segment: segment holding ``parent[first_row]`` (-1 for a root segment).
      fork_position: depth of ``first_row`` (0 for a root segment).
    """

    first_row: np.ndarray
    length: np.ndarray
    parent_segment: np.ndarray
    fork_position: np.ndarray

    def __len__(self) -> int:
        return int(self.first_row.shape[0])


def attention_key_rows(forest: Any) -> int:
    """Σ over the segments of ``forest`` (anything with :class:`Segments`-like ``segments``) of
    ``fork_position + length``: the rows a full-attention layer gathers as keys (and as values)
    in tree mode, each segment's whole root path (a varlen attention plan's ``num_key_rows``;
    a bucketed plan adds its padding). ``capacity_tokens`` (compact rows) does not bound it;
    ``harts.attention_key_rows`` bounds what a layer keeps of it for backward."""
    seg = forest.segments
    return int(np.sum(np.asarray(seg.fork_position, np.int64) + np.asarray(seg.length, np.int64)))


def _plural(noun: str) -> str:
    return noun[:-1] + "ies" if noun.endswith("y") else noun + "s"


def as_trajectory_array(
    seq: Any, index: int, field: str = "sequences", item: str = "trajectory"
) -> np.ndarray:
    """Validate one trajectory's token ids and return them as a 1-D int64 array.

    Raises ValueError naming ``field[index]`` for ragged/nested input, non-integer or negative
    ids, and an empty ``item`` (a trajectory, or a turn of :meth:`RolloutForest.from_turns`).
    """
    if isinstance(seq, str | bytes | bytearray):
        raise ValueError(f"{field}[{index}]: expected a 1-D sequence of token ids, got a string")
    if isinstance(seq, np.ndarray) and seq.dtype == object and seq.ndim == 1:
        seq = seq.tolist()  # e.g. a row of a 2-D object array: judged item by item below
    if callable(getattr(seq, "detach", None)) and callable(getattr(seq, "cpu", None)):
        if getattr(getattr(seq, "device", None), "type", None) == "meta":
            raise ValueError(f"{field}[{index}]: a meta tensor holds no token ids")
        seq = seq.detach().cpu()  # a torch tensor (ids never carry gradients), on any device
    if holds_bool(seq):
        raise ValueError(f"{field}[{index}]: token ids must be integers, got a bool")
    try:
        arr = np.asarray(seq)
    except ValueError as exc:  # ragged nesting inside one trajectory
        raise ValueError(f"{field}[{index}]: ragged nesting, expected a flat list of ids") from exc
    except TypeError as exc:  # e.g. a bfloat16 tensor, which numpy cannot represent
        raise ValueError(f"{field}[{index}]: expected integer token ids ({exc})") from exc
    if arr.dtype == object or arr.dtype.kind == "f":
        # Python ints outside the int64 range make numpy fall back to objects or floats; so does
        # a list mixing numpy uint64 and signed integer scalars (uint64 + int64 -> float64).
        wide = int_outside_int64(seq)
        if wide is not None:
            what = "negative token id" if wide < 0 else "token id"
            raise ValueError(f"{field}[{index}]: {what} {wide} does not fit in int64")
        exact = exact_integers(seq)
        if exact is not None:
            arr = exact
    if arr.dtype == object:
        raise ValueError(f"{field}[{index}]: expected integer token ids, got objects/ragged data")
    if arr.ndim == 0:
        raise ValueError(
            f"{field}[{index}]: expected a 1-D sequence of token ids, got the single value "
            f"{seq!r} ({field} is a list of {_plural(item)}: wrap one {item} in a list)"
        )
    if arr.ndim != 1:
        raise ValueError(
            f"{field}[{index}]: expected a 1-D sequence of token ids, got shape {arr.shape}"
        )
    if arr.size == 0:
        raise ValueError(f"{field}[{index}]: empty {item} (a {item} needs >= 1 token)")
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        raise ValueError(f"{field}[{index}]: token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError(f"{field}[{index}]: negative token id {int(arr.min())}")
    if arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{field}[{index}]: token id {int(arr.max())} does not fit in int64")
    return arr.astype(np.int64, copy=False)


def _leaf_order_and_lcp(flat: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stable lexicographic order of the trajectories and LCP of each adjacent pair."""
    n = offsets.shape[0] - 1
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # Big-endian unsigned bytes compare like the integer sequences (a prefix sorts first).
    width = ">u4" if int(flat.max(initial=0)) < 2**32 else ">u8"
    itemsize = 4 if width == ">u4" else 8
    buf = flat.astype(width).tobytes()
    starts = (offsets[:-1] * itemsize).tolist()
    ends = (offsets[1:] * itemsize).tolist()
    keys = [buf[s:e] for s, e in zip(starts, ends)]
    order = np.array(sorted(range(n), key=keys.__getitem__), dtype=np.int64)
    lengths = np.diff(offsets)
    lcp = np.empty(max(n - 1, 0), dtype=np.int64)
    a_start = offsets[order[:-1]]
    b_start = offsets[order[1:]]
    m = np.minimum(lengths[order[:-1]], lengths[order[1:]])
    for j, (sa, sb, mm) in enumerate(zip(a_start.tolist(), b_start.tolist(), m.tolist())):
        diff = np.flatnonzero(flat[sa : sa + mm] != flat[sb : sb + mm])
        lcp[j] = diff[0] if diff.size else mm
    return order, lcp


class RolloutForest:
    """Token trie of a batch of trajectories; compact rows in DFS preorder (invariant 1).

    Row attributes (numpy, length C): ``token_ids``, ``parent`` (-1 at roots), ``depth``
    (= position id, invariant 2), ``multiplicity`` (trajectories through the row),
    ``subtree_size`` (row k is an ancestor-or-self of q iff ``k <= q < k + subtree_size[k]``),
    ``num_children``.
    Trajectory attributes (length N): ``lengths``, ``group_ids``, ``leaf_order`` (stable
    lexicographic order of trajectory indices), ``adjacent_lcp`` (N-1 LCPs of leaf-order
    neighbours). CSR map: rows of trajectory i are
    ``semantic_rows[row_offsets[i]:row_offsets[i+1]]`` — every semantic position maps to exactly
    one row, in the original order (invariant 3).
    """

    def __init__(
        self,
        flat_tokens: np.ndarray,
        row_offsets: np.ndarray,
        group_ids: np.ndarray,
        leaf_order: np.ndarray,
        adjacent_lcp: np.ndarray,
        *,
        check: bool = True,
    ) -> None:
        """A forest from its file arrays (as :meth:`save` writes them): every trajectory's
        tokens concatenated, ``row_offsets`` [N + 1], ``group_ids`` [N], ``leaf_order`` (a
        permutation) and ``adjacent_lcp`` [N - 1] (leaf-order neighbours share at least that
        many first tokens: fewer gives a valid non-trie layout). ValueError naming the array
        when they are inconsistent; ``check=False`` (the builders, whose arrays are right by
        construction) skips the O(S) check; ``group_ids=None`` is all zeros either way (the
        default of :meth:`from_sequences`). Prefer :meth:`from_sequences`."""
        if group_ids is None:  # saved as None, load would refuse the file; subset would fail
            group_ids = np.zeros(max(np.asarray(row_offsets).shape[0] - 1, 0), np.int64)
        if check:
            arrays = (flat_tokens, row_offsets, group_ids, leaf_order, adjacent_lcp)
            flat_tokens, row_offsets, group_ids, leaf_order, adjacent_lcp = _checked_file_arrays(
                "RolloutForest", *arrays
            )
        self.row_offsets = row_offsets
        self.lengths = np.diff(row_offsets)
        self.group_ids = group_ids
        self.leaf_order = leaf_order
        self.adjacent_lcp = adjacent_lcp
        self._build(flat_tokens)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequences(
        cls, sequences: Sequence[Any], *, group_ids: Sequence[int] | np.ndarray | None = None
    ) -> RolloutForest:
        """Build the forest of ``sequences`` (1-D integer token-id arrays or lists, one per
        trajectory; a 2-D integer array is read as one trajectory per row, while a 1-D array,
        even an empty one, is refused as being one sequence, not a batch: the empty batch is
        ``[]``). Trajectories may be identical, prefixes of others, or one token long;
        different first tokens give several roots. ``group_ids`` (int, one per trajectory,
        default: all 0) is carried along for planners.
        """
        flat, row_offsets, gids = cls._parse(sequences, group_ids)
        order, lcp = _leaf_order_and_lcp(flat, row_offsets)
        return cls(flat, row_offsets, gids, order, lcp, check=False)

    @classmethod
    def _parse(
        cls, sequences: Sequence[Any], group_ids: Sequence[int] | np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``sequences`` (as :meth:`from_sequences` reads them) checked and concatenated:
        ``(flat tokens, row offsets [N + 1], group ids [N])``."""
        if isinstance(sequences, np.ndarray) and sequences.dtype != object:
            if sequences.ndim != 2:
                raise ValueError(
                    f"sequences: expected a list of 1-D token arrays, got an array of shape {sequences.shape}"
                )
            sequences = list(sequences)
        elif not isinstance(sequences, Sequence) or isinstance(sequences, str | bytes):
            # A mapping iterates over its keys and a set has no order: neither is a batch.
            unordered = isinstance(sequences, Mapping | AbstractSet)
            if isinstance(sequences, Iterable) and not (
                unordered or isinstance(sequences, str | bytes)
            ):
                sequences = list(sequences)
            else:
                raise TypeError(
                    f"sequences: expected a list of 1-D token-id arrays, got {type(sequences).__name__}"
                )
        arrays = [as_trajectory_array(s, i) for i, s in enumerate(sequences)]
        n = len(arrays)
        lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=n)
        row_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=row_offsets[1:])
        flat = np.concatenate(arrays) if n else np.zeros(0, np.int64)
        return flat, row_offsets, cls._check_group_ids(group_ids, n)

    @classmethod
    def expanded(
        cls, sequences: Sequence[Any], *, group_ids: Sequence[int] | np.ndarray | None = None
    ) -> RolloutForest:
        """The trajectory-wise layout of ``sequences``: every trajectory is its own root chain,
        nothing is shared (C = S), rows in the original trajectory order.

        Not a trie (equal prefixes stay duplicated); it has every attribute of a forest, so the
        same ops and planners run on it. This is the baseline/oracle layout.
        """
        flat, row_offsets, gids = cls._parse(sequences, group_ids)
        n = row_offsets.shape[0] - 1
        # no trie is built: each trajectory its own chain, in the original order
        order, lcp = np.arange(n, dtype=np.int64), np.zeros(max(n - 1, 0), np.int64)
        return cls(flat, row_offsets, gids, order, lcp, check=False)

    @classmethod
    def from_turns(cls, turns: Iterable[Any]) -> RolloutForest:
        """Build the forest from recorded turns with parent links.

        Each turn is a :class:`Turn`, a mapping with keys ``turn_id``, ``parent_turn_id``,
        ``token_ids`` (optional ``is_trajectory_end``), or a tuple in that field order.
        Trajectories, in the order their end turns appear: every leaf turn and every turn marked
        ``is_trajectory_end``. Equals ``from_sequences`` of the flattened trajectories.

        Raises TypeError naming ``turns[i]`` for an unhashable ``turn_id``/``parent_turn_id`` or
        an ``is_trajectory_end`` that is not a bool, and ValueError naming the turn for a
        duplicate ``turn_id``, a mapping with a missing or unknown key (a misspelt
        ``is_trajectory_end`` is refused, not read as False), an unknown parent, bad token ids,
        or parent links that do not
        lead to a root (a cycle, e.g. a turn that is its own parent, whether or not other turns
        hang off it): every turn must be reached from a turn without parent.
        """
        if not hasattr(turns, "__iter__"):
            raise TypeError(f"turns: expected an iterable of turns, got {type(turns).__name__}")
        records = [_as_turn(t, i) for i, t in enumerate(turns)]
        index: dict[Any, int] = {}
        for i, t in enumerate(records):
            try:
                known = t.turn_id in index
            except TypeError as exc:
                raise TypeError(
                    f"turns[{i}].turn_id: expected a hashable id, got {type(t.turn_id).__name__}"
                ) from exc
            if known:
                raise ValueError(f"turns[{i}]: duplicate turn_id {t.turn_id!r}")
            index[t.turn_id] = i
            if not isinstance(t.is_trajectory_end, bool | np.bool_):
                raise TypeError(
                    f"turns[{i}].is_trajectory_end: expected a bool, got {t.is_trajectory_end!r}"
                )
        parent_idx = np.full(len(records), -1, dtype=np.int64)
        has_child = np.zeros(len(records), dtype=bool)
        for i, t in enumerate(records):
            if t.parent_turn_id is not None:
                try:
                    p = index.get(t.parent_turn_id)
                except TypeError as exc:
                    raise TypeError(
                        f"turns[{i}].parent_turn_id: expected a hashable id or None, got "
                        f"{type(t.parent_turn_id).__name__}"
                    ) from exc
                if p is None:
                    raise ValueError(
                        f"turns[{i}] (turn_id {t.turn_id!r}): unknown parent_turn_id {t.parent_turn_id!r}"
                    )
                parent_idx[i] = p
                has_child[p] = True
        _check_turns_reach_a_root(records, parent_idx)
        token_arrays = [
            as_trajectory_array(t.token_ids, i, field="turns", item="turn")
            for i, t in enumerate(records)
        ]
        ends = [i for i, t in enumerate(records) if t.is_trajectory_end or not has_child[i]]
        sequences = []
        parents = parent_idx.tolist()
        for e in ends:  # every chain ends at a root (checked above)
            chain = []
            node = e
            while node >= 0:
                chain.append(node)
                node = parents[node]
            sequences.append(np.concatenate([token_arrays[c] for c in reversed(chain)]))
        return cls.from_sequences(sequences)

    @staticmethod
    def _check_group_ids(group_ids: Any, n: int) -> np.ndarray:
        """``group_ids`` as int64 of shape ``(n,)`` (zeros for None); ValueError naming
        ``group_ids`` for another shape, non-integers, or values outside int64 (as
        :meth:`load` refuses them), never a silent wrap-around."""
        if group_ids is None:
            return np.zeros(n, dtype=np.int64)
        try:
            g = np.asarray(group_ids)
        except (ValueError, TypeError) as exc:  # ragged / unconvertible
            raise ValueError(f"group_ids: expected {n} integers ({exc})") from exc
        if g.shape != (n,):
            raise ValueError(f"group_ids: expected shape ({n},), got {g.shape}")
        if holds_bool(group_ids):
            raise ValueError("group_ids: expected integers, got a bool")
        if n and (g.dtype == object or g.dtype.kind == "f"):  # Python ints past int64
            wide = int_outside_int64(group_ids)
            if wide is not None:
                raise ValueError(f"group_ids: value {wide} does not fit in int64")
        if n and (g.dtype.kind not in "iu" or g.dtype == np.bool_):
            raise ValueError(f"group_ids: expected integers, got dtype {g.dtype}")
        if n and g.dtype == np.uint64 and int(g.max()) > INT64_MAX:
            raise ValueError(f"group_ids: value {int(g.max())} does not fit in int64")
        return g.astype(np.int64, copy=True)  # the forest owns its arrays

    def _build(self, flat: np.ndarray) -> None:
        n = self.lengths.shape[0]
        order = self.leaf_order
        lens_sorted = self.lengths[order]
        shared = np.zeros(n, dtype=np.int64)  # tokens each leaf-order trajectory shares before it
        shared[1:] = self.adjacent_lcp
        new_counts = lens_sorted - shared
        block_end = np.cumsum(new_counts)
        block_start = block_end - new_counts
        c = int(block_end[-1]) if n else 0

        # Rows: leaf-order trajectory j creates rows for its positions [shared_j, L_j).
        creator = np.repeat(np.arange(n, dtype=np.int64), new_counts)
        row_ids = np.arange(c, dtype=np.int64)
        depth = shared[creator] + (row_ids - block_start[creator])
        src = self.row_offsets[order][creator] + depth
        self.token_ids = flat[src] if c else np.zeros(0, np.int64)
        self.depth = depth

        # Semantic rows, written in the original CSR order while walking the leaf order: a
        # trajectory copies its shared prefix from its leaf-order predecessor, then its new rows.
        sem = np.empty(self.num_semantic_tokens, dtype=np.int64)
        starts = self.row_offsets[order].tolist()
        prev_start = 0
        for s0, sh, b0, e0 in zip(
            starts, shared.tolist(), block_start.tolist(), block_end.tolist()
        ):
            if sh:
                sem[s0 : s0 + sh] = sem[prev_start : prev_start + sh]
            sem[s0 + sh : s0 + sh + (e0 - b0)] = row_ids[b0:e0]
            prev_start = s0
        self.semantic_rows = sem

        # Parent: previous row inside a block; the path's row at depth shared-1 at a block start.
        parent = row_ids - 1
        has_new = new_counts > 0
        firsts = block_start[has_new]
        sh_new = shared[has_new]
        parent[firsts] = np.where(
            sh_new > 0, sem[self.row_offsets[order][has_new] + np.maximum(sh_new - 1, 0)], -1
        )
        self.parent = parent

        self.multiplicity = np.bincount(sem, minlength=c).astype(np.int64)
        # Trajectories through a row are a contiguous leaf-order range starting at its creator.
        last_traj = creator + self.multiplicity - 1
        self.subtree_size = block_end[last_traj] - row_ids if c else np.zeros(0, np.int64)
        self.num_children = np.bincount(parent[parent >= 0], minlength=c).astype(np.int64)
        self._creator = creator
        self._segments: Segments | None = None

    # ------------------------------------------------------------------ sizes
    @property
    def num_trajectories(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_semantic_tokens(self) -> int:
        return int(self.row_offsets[-1])

    @property
    def num_compact_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def compression(self) -> float:
        """S / C (1.0 for an empty forest)."""
        c = self.num_compact_tokens
        return self.num_semantic_tokens / c if c else 1.0

    @property
    def roots(self) -> np.ndarray:
        """Rows without parent, in preorder."""
        return np.flatnonzero(self.parent < 0)

    def __len__(self) -> int:
        return self.num_trajectories

    def __repr__(self) -> str:
        return (
            f"RolloutForest(trajectories={self.num_trajectories}, semantic={self.num_semantic_tokens}, "
            f"compact={self.num_compact_tokens}, compression={self.compression:.3f})"
        )

    # ------------------------------------------------------------------ access
    def _check_index(self, i: int) -> int:
        if not isinstance(i, int | np.integer) or isinstance(i, bool):
            raise TypeError(f"trajectory index must be an int, got {type(i).__name__}")
        if not -self.num_trajectories <= i < self.num_trajectories:
            raise ValueError(
                f"trajectory index {i} out of range for {self.num_trajectories} trajectories"
            )
        return int(i) % self.num_trajectories

    def rows_of(self, i: int) -> np.ndarray:
        """Compact rows of trajectory ``i`` in token order (a root-to-endpoint path), as a new
        int64 array (like ``tokens_of``: writing to it leaves the forest intact)."""
        i = self._check_index(i)
        return self.semantic_rows[self.row_offsets[i] : self.row_offsets[i + 1]].copy()

    def tokens_of(self, i: int) -> np.ndarray:
        """Token ids of trajectory ``i`` (reconstructed from the rows)."""
        return self.token_ids[self.rows_of(i)]

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise ValueError naming the first trajectory (in trajectory order), the position and
        the id of a token id ``>= vocab_size`` (ids are ``>= 0`` by construction); nothing
        when every id is below it. Vectorized over the compact rows. ``vocab_size`` must be an
        int >= 1 (ValueError naming it)."""
        vocab_size = check_int("vocab_size", vocab_size, 1)
        bad = self.token_ids >= vocab_size
        if not bad.any():
            return
        pos = int(np.flatnonzero(bad[self.semantic_rows])[0])
        i = int(np.searchsorted(self.row_offsets, pos, side="right")) - 1
        tok = int(self.token_ids[self.semantic_rows[pos]])
        raise ValueError(
            f"sequences[{i}]: token id {tok} at position {pos - int(self.row_offsets[i])} "
            f"is outside the model's vocabulary (size {vocab_size})"
        )

    @property
    def sequences(self) -> list[np.ndarray]:
        """All trajectories' token ids, in the original order."""
        if self.num_trajectories == 0:
            return []
        flat = self.token_ids[self.semantic_rows]
        return np.split(flat, self.row_offsets[1:-1])

    @property
    def leaf_position(self) -> np.ndarray:
        """int64 ``[N]``: each trajectory's position in :attr:`leaf_order` (its inverse)."""
        pos = np.empty(self.num_trajectories, dtype=np.int64)
        pos[self.leaf_order] = np.arange(self.num_trajectories, dtype=np.int64)
        return pos

    @property
    def segments(self) -> Segments:
        """Maximal single-child chains; a new segment starts at a root or at a child of a row
        with != 1 children. Each segment is a contiguous preorder row range."""
        if self._segments is None:
            c = self.num_compact_tokens
            starts = np.ones(c, dtype=bool)
            has_parent = self.parent >= 0
            starts[has_parent] = self.num_children[self.parent[has_parent]] != 1
            first = np.flatnonzero(starts)
            length = np.diff(np.append(first, c))
            seg_of_row = np.cumsum(starts) - 1
            p = self.parent[first]
            parent_segment = np.where(p >= 0, seg_of_row[np.maximum(p, 0)], -1)
            self._segments = Segments(first, length, parent_segment, self.depth[first])
            self._segment_of_row = seg_of_row
        return self._segments

    @property
    def segment_of_row(self) -> np.ndarray:
        """Segment index of every row."""
        _ = self.segments
        return self._segment_of_row

    def is_ancestor_or_self(self, k: np.ndarray | int, q: np.ndarray | int) -> np.ndarray:
        """Vectorized preorder ancestor test ``k <= q < k + subtree_size[k]`` (broadcast over
        ``k`` and ``q``). Both must be integer rows in ``[0, num_compact_tokens)``: ValueError
        naming ``k`` or ``q`` otherwise (no negative indexing from the end)."""
        k = self._check_rows("k", k)
        q = self._check_rows("q", q)
        return (k <= q) & (q < k + self.subtree_size[k])

    def _check_rows(self, name: str, rows: Any) -> np.ndarray:
        r = np.asarray(rows)
        if holds_bool(rows):
            raise ValueError(f"{name}: expected integer row indices, got a bool")
        if r.dtype.kind not in "iu" or r.dtype == np.bool_:
            raise ValueError(f"{name}: expected integer row indices, got dtype {r.dtype}")
        c = self.num_compact_tokens
        if r.size and (int(r.min()) < 0 or int(r.max()) >= c):
            bad = int(r.min()) if int(r.min()) < 0 else int(r.max())
            raise ValueError(f"{name}: row {bad} out of range for {c} compact rows")
        return r

    # ------------------------------------------------------------------ derived forests
    def subset(self, trajectory_indices: Sequence[int] | np.ndarray) -> RolloutForest:
        """The forest of the given trajectories (trajectory ``i`` of the result is
        ``trajectory_indices[i]``), keeping this forest's layout: leaf order and LCPs are
        restricted, rows keep this forest's order. For a trie (:meth:`from_sequences`,
        :meth:`from_turns`) it equals building one from their sequences; a subset of an
        :meth:`expanded` layout stays expanded (nothing shared), its rows in this forest's
        order, equal to :meth:`expanded` of their sequences for strictly increasing indices.
        A repeated index is the same trajectory twice: in every layout its two copies share all
        their rows (a forest does not record whether it was built expanded, and an expanded
        layout without common prefixes is also a trie)."""
        idx = np.asarray(trajectory_indices)
        if (
            idx.ndim != 1
            or (idx.size and idx.dtype.kind not in "iu")
            or holds_bool(trajectory_indices)
        ):
            raise ValueError("trajectory_indices: expected a 1-D array of integer indices")
        idx = idx.astype(np.int64, copy=False)
        n = self.num_trajectories
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise ValueError(f"trajectory_indices: index out of range for {n} trajectories")
        m = idx.shape[0]
        lengths = self.lengths[idx]
        row_offsets = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(lengths, out=row_offsets[1:])
        flat = self.token_ids[
            self.semantic_rows[
                concat_ranges(
                    self.row_offsets[idx], self.row_offsets[idx + 1] - self.row_offsets[idx]
                )
            ]
        ]
        # Order of the subset: leaf positions of the chosen trajectories; identical trajectories
        # (one class) are ordered by their new index, as a stable sort would.
        pos = self.leaf_position
        lens_leaf = self.lengths[self.leaf_order]
        identical = (self.adjacent_lcp == lens_leaf[1:]) & (self.adjacent_lcp == lens_leaf[:-1])
        leaf_class = np.concatenate([[0], np.cumsum(~identical)]) if n else np.zeros(0, np.int64)
        sub_pos = pos[idx]
        order = np.lexsort((np.arange(m), leaf_class[sub_pos]))
        sp = sub_pos[order]
        # LCP of leaf-order positions a < b is min(adjacent_lcp[a:b]); equal positions: full length.
        if m > 1:
            a, b = sp[:-1], sp[1:]
            cls_sorted = leaf_class[sp]
            same = cls_sorted[:-1] == cls_sorted[1:]
            lcp = lengths[order[1:]].copy()
            if (~same).any():
                lcp[~same] = RangeMin(self.adjacent_lcp).query(a[~same], b[~same])
        else:
            lcp = np.zeros(0, np.int64)
        gids = self.group_ids[idx].copy()
        return RolloutForest(flat, row_offsets, gids, order.astype(np.int64), lcp, check=False)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike[str] | Any) -> None:
        """Write the forest to ``path`` (numpy ``.npz`` format, written to exactly that name: no
        suffix is appended) or to an open binary file; :meth:`load` rebuilds an identical
        forest."""
        arrays = {
            "format_version": np.int64(_FORMAT_VERSION),
            "flat_tokens": self.token_ids[self.semantic_rows],
            "row_offsets": self.row_offsets,
            "group_ids": self.group_ids,
            "leaf_order": self.leaf_order,
            "adjacent_lcp": self.adjacent_lcp,
        }
        if isinstance(path, str | os.PathLike):
            with open(path, "wb") as fh:  # np.savez_compressed(str) would append ".npz"
                np.savez_compressed(fh, **arrays)
        else:
            np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | Any) -> RolloutForest:
        """Read a forest written by :meth:`save`.

        Raises ValueError naming the file and the array when it is not a forest file or its
        arrays are inconsistent (wrong shapes or dtypes, offsets that do not tile the tokens, a
        leaf order that is not a permutation, an LCP longer than what two neighbours share).
        Any leaf order with consistent LCPs is a forest (an :meth:`expanded` layout's is the
        trajectory order with LCPs 0), so the file need not be in lexicographic leaf order.
        """
        try:
            z = np.load(path)
        except (ValueError, EOFError, zipfile.BadZipFile, NotImplementedError) as exc:
            # pickled/text/truncated; a damaged zip header claims an unknown zip version
            # numpy reads any file that is not .npy / .npz as a pickle, which it refuses
            why = "expected an .npz archive" if "allow_pickle" in str(exc) else str(exc)
            raise ValueError(f"{path}: not a forest file ({why})") from exc
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise ValueError(f"{path}: not a forest file (expected an .npz archive)")
        # np.load reads only the zip directory; a damaged member fails when it is decompressed.
        try:
            with z:
                version = _file_format_version(path, z)
                if version != _FORMAT_VERSION:
                    raise ValueError(f"{path}: unsupported forest format version {version}")
                missing = [k for k in _FILE_ARRAYS if k not in z]
                if missing:
                    raise ValueError(
                        f"{path}: not a complete forest file, missing array {missing[0]!r}"
                    )
                try:
                    arrays = [_member(path, z, k) for k in _FILE_ARRAYS]
                except _CorruptedFile:
                    raise
                except ValueError as exc:  # object arrays
                    raise ValueError(f"{path}: not a forest file ({exc})") from exc
        except _DAMAGED_MEMBER as exc:
            raise ValueError(
                f"{path}: corrupted forest file ({type(exc).__name__}: {exc})"
            ) from exc
        return cls(*_checked_file_arrays(path, *arrays), check=False)

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict[str, Any]:
        """Sizes and shape statistics as a JSON-ready dict (``branch_rows``: rows with
        two or more children)."""
        seg = self.segments
        return {
            "trajectories": self.num_trajectories,
            "roots": int(self.roots.shape[0]),
            "semantic_tokens": self.num_semantic_tokens,
            "compact_tokens": self.num_compact_tokens,
            "compression": round(self.compression, 4),
            "segments": len(seg),
            "max_depth": int(self.depth.max(initial=-1)) + 1,
            "branch_rows": int((self.num_children >= 2).sum()),
        }

    def equals(self, other: RolloutForest, *, group_ids: bool = True) -> bool:
        """True iff both forests have identical rows, CSR maps and trajectory attributes
        (lengths, leaf order, adjacent LCPs and, unless ``group_ids=False``, group ids; a forest
        whose ``group_ids`` is None counts as all zeros, the default of
        :meth:`from_sequences`). False for an object that is not a forest."""
        if not isinstance(other, RolloutForest):
            return False
        if group_ids:
            mine, theirs = self._group_ids_or_zeros(), other._group_ids_or_zeros()
            if mine.shape != theirs.shape or not np.array_equal(mine, theirs):
                return False
        names = (
            "token_ids",
            "parent",
            "depth",
            "multiplicity",
            "subtree_size",
            "row_offsets",
            "semantic_rows",
            "leaf_order",
            "adjacent_lcp",
        )
        return all(np.array_equal(getattr(self, a), getattr(other, a)) for a in names)

    def _group_ids_or_zeros(self) -> np.ndarray:
        g = self.group_ids
        return np.zeros(self.num_trajectories, np.int64) if g is None else np.asarray(g)


_FILE_ARRAYS = ("flat_tokens", "row_offsets", "group_ids", "leaf_order", "adjacent_lcp")


def _file_format_version(path: Any, z: Any) -> int:
    """The file's ``format_version``. ValueError naming the path: "not a forest file" when it
    is absent, and naming the field unless it is one integer (a 0-d integer array, as
    :meth:`RolloutForest.save` writes): no shapes, strings, objects or floats (``1.5`` must not
    read as version 1)."""
    if "format_version" not in z and any(k.rpartition("/")[2] == "data.pkl" for k in z.files):
        # a torch.save zip (what `harts-verl check --batch` reads), listed as its pickle's
        # members ('batch/data.pkl', 'batch/byteorder', ...) it read as some foreign archive
        raise ValueError(
            f"{path}: not a forest file (a torch.save file; a forest is written by "
            "RolloutForest.save, e.g. RolloutForest.from_sequences(token_id_lists).save(path))"
        )
    if "format_version" not in z:
        names = ", ".join(repr(k) for k in z.files[:8]) + (", ..." if len(z.files) > 8 else "")
        raise ValueError(
            f"{path}: not a forest file (an .npz archive with arrays {names or 'none'}; forests "
            "are written by RolloutForest.save)"
        )
    try:
        v = _member(path, z, "format_version")
    except _CorruptedFile:
        raise
    except ValueError as exc:  # an object array (needs pickle)
        raise ValueError(f"{path}: format_version: expected one integer ({exc})") from exc
    v = np.asarray(v)
    if v.shape != () or v.dtype.kind not in "iu" or v.dtype == np.bool_:
        raise ValueError(
            f"{path}: format_version: expected one integer, got dtype {v.dtype} shape {v.shape}"
        )
    return int(v)


def _checked_file_arrays(path: Any, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The arrays of a forest file as int64, after checking that they describe a valid layout:
    offsets tile the tokens (every trajectory >= 1 token), ids are non-negative, the leaf
    order is a permutation, and leaf-order neighbours really share their first
    ``adjacent_lcp`` tokens (sharing fewer is a valid non-trie layout, e.g. the expanded one)."""

    def bad(name: str, what: str) -> ValueError:
        return ValueError(f"{path}: {name}: {what}")

    out = []
    for name, a in zip(_FILE_ARRAYS, arrays):
        a = np.asarray(a)
        if a.ndim != 1 or (a.size and (a.dtype.kind not in "iu" or a.dtype == np.bool_)):
            raise bad(name, f"expected a 1-D integer array, got dtype {a.dtype} shape {a.shape}")
        if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
            raise bad(name, f"value {int(a.max())} does not fit in int64")
        out.append(a.astype(np.int64))
    flat, offsets, gids, order, lcp = out
    n = offsets.shape[0] - 1
    if n < 0 or offsets[0] != 0 or offsets[-1] != flat.shape[0] or (np.diff(offsets) < 1).any():
        raise bad(
            "row_offsets",
            f"expected increasing offsets from 0 to {flat.shape[0]} (every trajectory has >= 1 "
            f"token), got {offsets.tolist()[:8]}{' ...' if offsets.shape[0] > 8 else ''}",
        )
    if flat.size and int(flat.min()) < 0:
        raise bad("flat_tokens", f"negative token id {int(flat.min())}")
    if gids.shape != (n,):
        raise bad("group_ids", f"expected shape ({n},), got {gids.shape}")
    if order.shape != (n,) or (
        n and (order.min() < 0 or order.max() >= n or (np.bincount(order, minlength=n) != 1).any())
    ):
        raise bad("leaf_order", f"expected a permutation of the {n} trajectory indices")
    if lcp.shape != (max(n - 1, 0),):
        raise bad("adjacent_lcp", f"expected shape ({max(n - 1, 0)},), got {lcp.shape}")
    lens = np.diff(offsets)[order]
    over = np.flatnonzero((lcp < 0) | (lcp > np.minimum(lens[:-1], lens[1:])))
    if over.size:
        j = int(over[0])
        raise bad(f"adjacent_lcp[{j}]", f"{int(lcp[j])} is not in [0, min of the two lengths]")
    if n > 1:
        a = concat_ranges(offsets[order[:-1]], lcp)
        b = concat_ranges(offsets[order[1:]], lcp)
        differ = np.flatnonzero(flat[a] != flat[b])
        if differ.size:
            j = int(np.searchsorted(np.cumsum(lcp), differ[0], side="right"))
            raise bad(
                f"adjacent_lcp[{j}]",
                f"claims {int(lcp[j])} shared tokens, but trajectories {int(order[j])} and "
                f"{int(order[j + 1])} differ before that",
            )
    return flat, offsets, gids, order, lcp


_TURN_KEYS = frozenset({"turn_id", "parent_turn_id", "token_ids", "is_trajectory_end"})


def _as_turn(t: Any, i: int) -> Turn:
    if isinstance(t, Turn):
        return t
    if isinstance(t, dict):
        missing = {"turn_id", "parent_turn_id", "token_ids"} - set(t)
        if missing:
            raise ValueError(f"turns[{i}]: missing keys {sorted(missing)}")
        unknown = set(t) - _TURN_KEYS  # a misspelt is_trajectory_end would drop an end
        if unknown:
            raise ValueError(
                f"turns[{i}]: unknown keys {sorted(map(str, unknown))}; expected "
                f"{sorted(_TURN_KEYS)}"
            )
        return Turn(
            t["turn_id"],
            t["parent_turn_id"],
            t["token_ids"],
            t.get("is_trajectory_end", False),  # type-checked by from_turns
        )
    if isinstance(t, tuple | list) and len(t) in (3, 4):
        return Turn(*t[:3], t[3] if len(t) == 4 else False)
    raise ValueError(
        f"turns[{i}]: expected a Turn, a dict or a (turn_id, parent_turn_id, token_ids) tuple, got {type(t).__name__}"
    )


def _check_turns_reach_a_root(records: list[Turn], parent_idx: np.ndarray) -> None:
    """ValueError naming a turn on a parent-link cycle unless every turn is reached from a
    root (a turn without parent). Linear time: one pass down the children lists from the
    roots."""
    n = len(records)
    if n == 0:
        return
    order = np.argsort(parent_idx, kind="stable")  # children grouped by parent; roots first
    counts = np.bincount(parent_idx[parent_idx >= 0], minlength=n)
    num_roots = n - int(counts.sum())
    child_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=child_off[1:])
    children = order[num_roots:]
    reached = np.zeros(n, dtype=bool)
    frontier = order[:num_roots]
    while frontier.size:  # one vectorized step per turn-tree level
        reached[frontier] = True
        lo, hi = child_off[frontier], child_off[frontier + 1]
        frontier = children[concat_ranges(lo, hi - lo)]
    if reached.all():
        return
    # Walk up from the first unreached turn until a turn repeats: that loop is a cycle.
    node = int(np.flatnonzero(~reached)[0])
    seen: dict[int, int] = {}
    path: list[int] = []
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = int(parent_idx[node])
    cycle = path[seen[node] :]
    i = min(cycle)
    shown = [*cycle, cycle[0]]
    if len(shown) > 9:  # a long cycle: its start and end, not every turn
        head = " -> ".join(repr(records[c].turn_id) for c in shown[:4])
        tail = " -> ".join(repr(records[c].turn_id) for c in shown[-2:])
        ids = f"{head} -> ... ({len(cycle) - 5} more) -> {tail}"
    else:
        ids = " -> ".join(repr(records[c].turn_id) for c in shown)
    raise ValueError(
        f"turns[{i}] (turn_id {records[i].turn_id!r}): parent links form a cycle ({ids}); "
        "every turn must lead to a root turn (parent_turn_id None)"
    )
