"""Linear-attention call planner: packed varlen rounds over a rollout forest (numpy only).

Chunkwise linear attention (KDA, GatedDeltaNet) carries a recurrent state across chunks of
``B = chunk_size`` tokens aligned to absolute positions. In tree mode the forest's compact rows are
run as **members** of packed varlen calls: a member runs down one root-to-leaf path and owns whole
segments. At a fork one child segment continues inside the parent's member; every other child
starts a new member at the chunk boundary ``b = ⌊f/B⌋·B`` of its fork position ``f``, first
*replaying* the ancestor rows at depths ``[b, f)`` (outputs discarded, ``< B`` tokens) from the
path's state at ``b``. That state is produced by the member owning the path's row at depth
``b − 1`` (zeros when ``b = 0``), so the new member runs in the round after its producer's. Calls
are sequential **rounds**; this module finds a plan with the fewest rounds, in time linear in the
number of rows (vectorized numpy over rows; Python loops only over segments and members).

Why the plan is minimal (checked against a brute force over all continuation choices in
``tests/test_linear_plan.py``):

* Along a path, member rounds never decrease, and a new child member ``s`` of a segment owned by
  member ``M`` (started at boundary ``β_M``) runs in ``round(M)`` if ``b_s = β_M`` (same
  producer as ``M``) and in ``round(M) + 1`` otherwise (then ``M`` itself owns depth ``b_s − 1``).
* ``β_M ≤ b_t ≤ b_s`` for a segment ``t`` of ``M`` (``b_t`` = boundary of ``t``'s first depth),
  so all a subtree needs to know about the member it continues is one bit
  ``eq = (β_M == b_t)``. With ``E = eq ∧ (b_t == b_children)``: ``h(t, eq)`` (the fewest extra
  rounds below ``t``) is ``max_c h(c, True)`` if ``E``, else
  ``min_{c*} max(h(c*, False), 1 + max_{c ≠ c*} h(c, True))``; leaves have ``h = 0``.
  ``num_rounds = 1 + max over roots of h(root, True)``. Continuing one child is never worse than
  continuing none (``h(c, False) ≤ 1 + h(c, True)``), and replay tokens, member count and
  materialized states do not depend on which child continues, so only the rounds are optimized.
* Ties are broken deterministically: the child with the most rows in its subtree continues
  (earliest in preorder among equals).

Every plan is a deterministic function of ``(forest, chunk_size)`` (invariant 9).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from harts_verl.tree._checks import check_int
from harts_verl.tree._ranges import concat_ranges
from harts_verl.tree.forest import RolloutForest

__all__ = [
    "InitialState",
    "LinearCall",
    "LinearCallArrays",
    "LinearCallPlan",
    "LinearMember",
    "LinearRoundArrays",
    "MaterializedState",
    "plan_linear_calls",
]


# ------------------------------------------------------------------------------ data classes
@dataclass(frozen=True)
class InitialState:
    """The state a member starts from: the producer member's state at absolute ``position``.

    ``slot`` indexes :attr:`LinearCallPlan.materialized_states` (and the state slots of the
    array form).
    """

    producer: int
    position: int
    slot: int


@dataclass(frozen=True)
class MaterializedState:
    """A boundary state that must be kept: the state of ``producer``'s path at ``position``.

    It is the producer's state at the start of its local chunk ``local_chunk`` =
    ``(position − producer.start_position) / chunk_size`` (``>= 1``); when that equals the
    producer's chunk count, it is the producer's final state (the producer ends exactly at
    ``position − 1``). ``round`` is the producer's round; ``slot`` this state's index.
    """

    slot: int
    producer: int
    position: int
    local_chunk: int
    round: int


@dataclass(frozen=True, eq=False)
class LinearMember:
    """One varlen sequence of a call.

    Attributes:
      index: global member id (members are numbered round-major, see :class:`LinearCallPlan`).
      round: 0-based round (call) index.
      start_position: absolute position (depth) of its first token, a multiple of chunk_size.
      fork_position: depth of ``rows[0]`` (``start_position + len(replay_rows)``).
      replay_rows: compact rows at depths ``[start_position, fork_position)`` of its path, re-run
        first, outputs discarded (``len < chunk_size``).
      rows: compact rows it outputs, in path order (depths ``fork_position, fork_position+1, …``).
      segments: the segments it owns, in path order.
      initial_state: None when ``start_position == 0`` (zeros), else the producer and slot.
    """

    index: int
    round: int
    start_position: int
    fork_position: int
    replay_rows: np.ndarray
    rows: np.ndarray
    segments: np.ndarray
    initial_state: InitialState | None

    @property
    def length(self) -> int:
        """Tokens processed: replay plus own rows."""
        return int(self.replay_rows.shape[0] + self.rows.shape[0])


@dataclass(frozen=True, eq=False)
class LinearCall:
    """One packed varlen call (a round): its members in order and its ``cu_seqlens`` (int64,
    ``[len(members) + 1]``; member ``n`` covers tokens ``[cu_seqlens[n], cu_seqlens[n+1])`` =
    its replay rows then its own rows)."""

    index: int
    members: tuple[LinearMember, ...]
    cu_seqlens: np.ndarray


@dataclass(frozen=True, eq=False)
class LinearRoundArrays:
    """Flat arrays of one round, consumed by a linear-attention op without per-member loops.

    With ``N`` members and ``T`` tokens in the round (all int64 unless noted):

      cu_seqlens ``[N + 1]``: packed varlen offsets (``cu_seqlens[0] == 0``, ``[-1] == T``).
      token_rows ``[T]``: compact row of every token, member by member, replay rows first.
      output_mask ``[T]`` (bool): True for own rows (write the output to ``token_rows``), False
        for replay (discard).
      start_positions ``[N]``: absolute start depth of each member (multiple of chunk_size).
      initial_slot ``[N]``: state slot of each member's initial state, −1 for zeros. Always a slot
        saved in an earlier round (``< state_offsets[r]`` of the plan).
      chunk_offsets ``[N + 1]``: exclusive cumsum of ``ceil(len_n / chunk_size)``, as the
        kernel's :class:`ChunkStates.chunk_offsets`.
      save_src ``[M]``: the states to keep after this round, as indices into
        ``cat([chunk_states, final_state])`` (``[chunk_offsets[-1] + N, HV, K, V]``): an index
        ``< chunk_offsets[-1]`` is the chunk-start state ``chunk_offsets[n] + c`` (state at local
        chunk ``c`` of member ``n``), an index ``chunk_offsets[-1] + n`` is member ``n``'s final
        state (a boundary exactly at the member's end).
      save_slot ``[M]``: the slot each kept state goes to, ``arange(state_offsets[r],
        state_offsets[r+1])`` (slots are numbered round by round).
      needs_chunk_states (bool): some ``save_src`` points into the chunk-start states.
    """

    cu_seqlens: np.ndarray
    token_rows: np.ndarray
    output_mask: np.ndarray
    start_positions: np.ndarray
    initial_slot: np.ndarray
    chunk_offsets: np.ndarray
    save_src: np.ndarray
    save_slot: np.ndarray
    needs_chunk_states: bool


@dataclass(frozen=True, eq=False)
class LinearCallArrays:
    """Array form of a plan.

    ``rounds[r]`` is :class:`LinearRoundArrays` of round ``r``; ``num_states`` state slots in all;
    ``state_offsets`` (int64 ``[R + 1]``): round ``r`` saves slots
    ``[state_offsets[r], state_offsets[r+1])``. An op runs::

        saved = []                                     # per-round kept states, in slot order
        for ra in arrays.rounds:
            x = q/k/v/g/beta[ra.token_rows]
            states = cat(saved)                        # slots [0, state_offsets[r])
            init = where(ra.initial_slot >= 0, states[ra.initial_slot], 0)
            o, final, cs = kernel(x, cu_seqlens=ra.cu_seqlens, initial_state=init,
                                  output_chunk_states=ra.needs_chunk_states)
            out[ra.token_rows[ra.output_mask]] = o[ra.output_mask]
            saved.append(cat([cs.states, final])[ra.save_src])

    Every compact row is written exactly once over all rounds.
    """

    chunk_size: int
    rounds: tuple[LinearRoundArrays, ...]
    num_states: int
    state_offsets: np.ndarray


class LinearCallPlan:
    """The rounds of packed linear-attention calls for one forest (see the module docstring).

    Members are numbered round-major: round ``r`` holds global members
    ``[member_offsets[r], member_offsets[r+1])``, ordered inside a round by the preorder of their
    first segment. Member-level numpy attributes (length = number of members):
    ``member_round``, ``member_start`` (start position b), ``member_fork`` (depth of the first own
    row f), ``member_producer`` (−1 for zeros), ``member_slot`` (initial-state slot, −1 for
    zeros). ``segment_member`` maps each forest segment to its member.

    Guarantees: every compact row is output by exactly one member; members start on chunk
    boundaries; replay is ``< chunk_size`` rows and equals the path's rows ``[b, f)``; every
    initial state is produced in an earlier round; ``num_rounds`` is the minimum over all
    continuation choices.
    """

    def __init__(
        self,
        *,
        chunk_size: int,
        compact_tokens: int,
        arrays: LinearCallArrays,
        member_offsets: np.ndarray,
        member_round: np.ndarray,
        member_start: np.ndarray,
        member_fork: np.ndarray,
        member_producer: np.ndarray,
        member_slot: np.ndarray,
        member_seg_offsets: np.ndarray,
        member_segments: np.ndarray,
        segment_member: np.ndarray,
        state_producer: np.ndarray,
        state_position: np.ndarray,
    ) -> None:
        self.chunk_size = chunk_size
        self.compact_tokens = compact_tokens
        self.arrays = arrays
        self.member_offsets = member_offsets
        self.member_round = member_round
        self.member_start = member_start
        self.member_fork = member_fork
        self.member_producer = member_producer
        self.member_slot = member_slot
        self.segment_member = segment_member
        self._member_seg_offsets = member_seg_offsets
        self._member_segments = member_segments
        self._state_producer = state_producer
        self._state_position = state_position

    # ------------------------------------------------------------------ sizes
    @property
    def num_rounds(self) -> int:
        return int(self.member_offsets.shape[0] - 1)

    @property
    def num_members(self) -> int:
        return int(self.member_round.shape[0])

    @property
    def replay_tokens(self) -> int:
        """Total replayed tokens (Σ over members of ``fork − start``)."""
        return int((self.member_fork - self.member_start).sum())

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"LinearCallPlan(chunk_size={self.chunk_size}, rounds={s['rounds']}, "
            f"members={s['members']}, replay_tokens={s['replay_tokens']}, "
            f"compact_tokens={s['compact_tokens']})"
        )

    # ------------------------------------------------------------------ object view (lazy)
    @cached_property
    def materialized_states(self) -> tuple[MaterializedState, ...]:
        """One entry per distinct (producer member, boundary position), in slot order."""
        b = self.chunk_size
        prod = self._state_producer.tolist()
        pos = self._state_position.tolist()
        start = self.member_start
        rnd = self.member_round
        return tuple(
            MaterializedState(
                slot=i,
                producer=p,
                position=x,
                local_chunk=(x - int(start[p])) // b,
                round=int(rnd[p]),
            )
            for i, (p, x) in enumerate(zip(prod, pos))
        )

    @cached_property
    def members(self) -> tuple[LinearMember, ...]:
        """All members, in global (round-major) order."""
        out: list[LinearMember] = []
        for r, ra in enumerate(self.arrays.rounds):
            lo = int(self.member_offsets[r])
            cu = ra.cu_seqlens.tolist()
            for n in range(len(cu) - 1):
                m = lo + n
                start, fork = int(self.member_start[m]), int(self.member_fork[m])
                t0, t1 = cu[n], cu[n + 1]
                rep = fork - start
                prod = int(self.member_producer[m])
                init = (
                    None
                    if prod < 0
                    else InitialState(producer=prod, position=start, slot=int(self.member_slot[m]))
                )
                so = self._member_seg_offsets
                out.append(
                    LinearMember(
                        index=m,
                        round=r,
                        start_position=start,
                        fork_position=fork,
                        replay_rows=ra.token_rows[t0 : t0 + rep],
                        rows=ra.token_rows[t0 + rep : t1],
                        segments=self._member_segments[so[m] : so[m + 1]],
                        initial_state=init,
                    )
                )
        return tuple(out)

    @cached_property
    def rounds(self) -> tuple[LinearCall, ...]:
        """The packed calls, in execution order."""
        mem = self.members
        mo = self.member_offsets.tolist()
        return tuple(
            LinearCall(index=r, members=mem[mo[r] : mo[r + 1]], cu_seqlens=ra.cu_seqlens)
            for r, ra in enumerate(self.arrays.rounds)
        )

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict[str, Any]:
        """JSON-ready sizes: rounds, members, replay_tokens, compact_tokens, replay_fraction
        (replay / compact), materialized_states, members_per_round, tokens_per_round."""
        c = self.compact_tokens
        rep = self.replay_tokens
        return {
            "chunk_size": self.chunk_size,
            "rounds": self.num_rounds,
            "members": self.num_members,
            "replay_tokens": rep,
            "compact_tokens": c,
            "replay_fraction": rep / c if c else 0.0,
            "materialized_states": self.arrays.num_states,
            "members_per_round": np.diff(self.member_offsets).tolist(),
            "tokens_per_round": [int(ra.token_rows.shape[0]) for ra in self.arrays.rounds],
        }


# ------------------------------------------------------------------------------ planning
def _check_chunk_size(chunk_size: Any) -> int:
    """``chunk_size`` as an int in ``[1, 2**63 - 1]`` (ValueError naming it otherwise)."""
    return check_int("chunk_size", chunk_size, 1)


def _choose_continuations(
    fork: list[int],
    length: list[int],
    parent_seg: list[int],
    weight: list[int],
    chunk: int,
) -> tuple[list[int], int]:
    """Bottom-up DP over the segment tree, then the top-down choice.

    Returns ``cont`` (per segment: the child segment that continues its member, −1 at leaves)
    and the minimal number of rounds.
    """
    n = len(fork)
    children: list[list[int]] = [[] for _ in range(n)]
    for s in range(n):
        p = parent_seg[s]
        if p >= 0:
            children[p].append(s)
    # same[t]: t's first depth and its children's fork lie in the same chunk.
    same = [fork[t] // chunk == (fork[t] + length[t]) // chunk for t in range(n)]
    ht = [0] * n  # h(t, eq=True)
    hf = [0] * n  # h(t, eq=False)
    best_t = [-1] * n  # continuing child when E is True (any is optimal: tie-break)
    best_f = [-1] * n  # continuing child when E is False
    for t in range(n - 1, -1, -1):
        ch = children[t]
        if not ch:
            continue
        # Tie-break child: most rows in its subtree, earliest in preorder.
        top = ch[0]
        for c in ch[1:]:
            if weight[c] > weight[top]:
                top = c
        best_t[t] = top
        # E = False: cost(c*) = max(hf[c*], 1 + max_{c != c*} ht[c]).
        m1 = m2 = -1  # two largest ht among children
        i1 = -1
        for c in ch:
            v = ht[c]
            if v > m1:
                m2, m1, i1 = m1, v, c
            elif v > m2:
                m2 = v
        best_cost = None
        best_c = -1
        for c in ch:
            others = m2 if c == i1 else m1
            cost = hf[c] if others < 0 else max(hf[c], 1 + others)
            if (
                best_cost is None
                or cost < best_cost
                or (cost == best_cost and weight[c] > weight[best_c])
            ):
                best_cost, best_c = cost, c
        best_f[t] = best_c
        hf[t] = best_cost if best_cost is not None else 0
        ht[t] = m1 if same[t] else hf[t]
    # Top-down: roots start members with eq = True.
    eq = [True] * n
    cont = [-1] * n
    rounds = 0
    for t in range(n):
        if parent_seg[t] < 0:
            rounds = max(rounds, 1 + ht[t])
        if not children[t]:
            continue
        e = eq[t] and same[t]
        c = best_t[t] if e else best_f[t]
        cont[t] = c
        eq[c] = e  # new children keep the default eq = True
    return cont, rounds


def plan_linear_calls(forest: RolloutForest, *, chunk_size: int = 64) -> LinearCallPlan:
    """Plan the packed varlen linear-attention rounds of ``forest`` with the fewest rounds.

    Args:
      forest: the rollout forest (rows in DFS preorder), or any other layout built as a
        :class:`RolloutForest`, e.g. :meth:`RolloutForest.expanded` (one round, no replay).
      chunk_size: chunk length ``B`` of the kernel (positive int).

    Returns:
      A :class:`LinearCallPlan` (array form in ``.arrays``, object view in ``.rounds``).

    Raises:
      TypeError: ``forest`` is not a :class:`RolloutForest`.
      ValueError: ``chunk_size`` is not an int in ``[1, 2**63 - 1]``.

    Time is linear in the number of rows (plus ``O(chunk_size)`` vectorized steps and a Python
    loop over segments and members). Deterministic.
    """
    if not isinstance(forest, RolloutForest):
        raise TypeError(f"forest: expected a RolloutForest, got {type(forest).__name__}")
    chunk = _check_chunk_size(chunk_size)
    seg = forest.segments
    num_seg = len(seg)
    c_rows = forest.num_compact_tokens
    seg_first = seg.first_row.astype(np.int64, copy=False)
    seg_len = seg.length.astype(np.int64, copy=False)
    seg_fork = seg.fork_position.astype(np.int64, copy=False)
    seg_parent = seg.parent_segment.astype(np.int64, copy=False)
    weight = forest.subtree_size[seg_first] if num_seg else np.zeros(0, np.int64)

    cont, num_rounds = _choose_continuations(
        seg_fork.tolist(), seg_len.tolist(), seg_parent.tolist(), weight.tolist(), chunk
    )

    # Members: a segment that is a root or not its parent's continuation starts one.
    cont_arr = np.asarray(cont, dtype=np.int64)
    continued = np.zeros(num_seg, dtype=bool)
    continued[cont_arr[cont_arr >= 0]] = True
    starts_member = ~continued
    # Member of each segment (temporary ids in preorder of first segment): propagate down
    # continuation edges; a continued segment comes after its parent in preorder.
    tmp_first_seg = np.flatnonzero(starts_member)
    num_mem = int(tmp_first_seg.shape[0])
    seg_mem_tmp = np.full(num_seg, -1, dtype=np.int64)
    seg_mem_tmp[tmp_first_seg] = np.arange(num_mem, dtype=np.int64)
    smt = seg_mem_tmp.tolist()
    par = seg_parent.tolist()
    for s in range(num_seg):
        if smt[s] < 0:
            smt[s] = smt[par[s]]
    seg_mem_tmp = np.asarray(smt, dtype=np.int64)

    # Start boundary, fork, replay and the row at depth b-1 of every member (vectorized walk).
    mem_fork = seg_fork[tmp_first_seg]
    mem_start = (mem_fork // chunk) * chunk
    rep_len = mem_fork - mem_start
    has_state = mem_start > 0
    # Walk up from the row at depth f-1 by (f - b) steps: visits depths f-1 .. b-1.
    first_rows = seg_first[tmp_first_seg]
    cur = np.where(has_state | (rep_len > 0), forest.parent[first_rows], -1)
    rep_off = np.zeros(num_mem + 1, dtype=np.int64)
    np.cumsum(rep_len, out=rep_off[1:])
    replay_flat = np.empty(int(rep_off[-1]), dtype=np.int64)
    order = np.argsort(-rep_len, kind="stable")  # active members form a prefix at every step
    cur_o = cur[order]
    len_o = rep_len[order]
    base_o = rep_off[order]
    max_rep = int(len_o[0]) if num_mem else 0
    for j in range(max_rep):
        k = int(np.searchsorted(-len_o, -j, side="left"))  # members with len > j: a prefix
        act = cur_o[:k]
        replay_flat[base_o[:k] + len_o[:k] - 1 - j] = act
        cur_o[:k] = forest.parent[act]
    # After the walk cur_o holds the row at depth b-1 (or -1 / unused where b == 0).
    anc_row = np.full(num_mem, -1, dtype=np.int64)
    anc_row[order] = cur_o
    anc_row[~has_state] = -1
    seg_of_row = forest.segment_of_row
    producer_tmp = np.full(num_mem, -1, dtype=np.int64)
    producer_tmp[has_state] = seg_mem_tmp[seg_of_row[anc_row[has_state]]]

    # Rounds by the model's definition (producer precedes in preorder of first segments).
    rnd = [0] * num_mem
    pt = producer_tmp.tolist()
    for m in range(num_mem):
        p = pt[m]
        if p >= 0:
            rnd[m] = rnd[p] + 1
    mem_round_tmp = np.asarray(rnd, dtype=np.int64)
    got = int(mem_round_tmp.max()) + 1 if num_mem else 0
    if got != num_rounds:  # pragma: no cover - internal consistency
        raise AssertionError(f"linear plan: DP predicted {num_rounds} rounds, schedule has {got}")

    # Global ids: round-major, preorder of first segment inside a round.
    perm = np.argsort(mem_round_tmp, kind="stable")  # global -> tmp
    inv = np.empty(num_mem, dtype=np.int64)
    inv[perm] = np.arange(num_mem, dtype=np.int64)  # tmp -> global
    member_round = mem_round_tmp[perm]
    member_start = mem_start[perm]
    member_fork = mem_fork[perm]
    member_rep_len = rep_len[perm]
    member_producer = np.where(producer_tmp[perm] >= 0, inv[np.maximum(producer_tmp[perm], 0)], -1)
    segment_member = inv[seg_mem_tmp] if num_seg else np.zeros(0, np.int64)
    member_offsets = np.searchsorted(member_round, np.arange(num_rounds + 1), side="left").astype(
        np.int64
    )

    # Own rows: segments grouped by member (path order = preorder within a member).
    seg_order = np.argsort(segment_member, kind="stable")
    seg_count = np.bincount(segment_member, minlength=num_mem).astype(np.int64)
    member_seg_offsets = np.zeros(num_mem + 1, dtype=np.int64)
    np.cumsum(seg_count, out=member_seg_offsets[1:])
    own_len = np.bincount(segment_member, weights=seg_len, minlength=num_mem).astype(np.int64)

    # Token layout: per member replay then own rows, global member order. Own rows of a segment
    # are a contiguous row range, so ``token_rows`` starts as ``arange(T)`` and each piece is
    # shifted in place (one O(T) allocation); the Python loop runs over members and segments.
    tot_len = member_rep_len + own_len
    tok_off = np.zeros(num_mem + 1, dtype=np.int64)
    np.cumsum(tot_len, out=tok_off[1:])
    token_rows = np.arange(int(tok_off[-1]), dtype=np.int64)
    rep_lo = rep_off[:-1][perm].tolist()
    rep_n = member_rep_len.tolist()
    so = member_seg_offsets.tolist()
    first_l = seg_first[seg_order].tolist()
    len_l = seg_len[seg_order].tolist()
    tok_l = tok_off.tolist()
    for m in range(num_mem):
        pos = tok_l[m]
        if rep_n[m]:
            token_rows[pos : pos + rep_n[m]] = replay_flat[rep_lo[m] : rep_lo[m] + rep_n[m]]
            pos += rep_n[m]
        for i in range(so[m], so[m + 1]):
            if first_l[i] != pos:
                token_rows[pos : pos + len_l[i]] += first_l[i] - pos
            pos += len_l[i]
    output_mask = np.ones(int(tok_off[-1]), dtype=bool)
    output_mask[concat_ranges(tok_off[:-1], member_rep_len)] = False

    # Materialized states: one per distinct (producer, b) = one per distinct row at depth b-1
    # (a member owns one row per depth), slots ordered by (producer, b), hence round by round.
    with_state = np.flatnonzero(member_producer >= 0)
    span = int(member_start.max(initial=0)) + 1
    keys = member_producer[with_state] * span + member_start[with_state]
    uniq = np.unique(keys)
    st_prod = uniq // span
    st_pos = uniq % span
    num_states = int(uniq.shape[0])
    member_slot = np.full(num_mem, -1, dtype=np.int64)
    member_slot[with_state] = np.searchsorted(uniq, keys)
    state_round = member_round[st_prod] if num_states else np.zeros(0, np.int64)
    state_offsets = np.searchsorted(state_round, np.arange(num_rounds + 1), side="left").astype(
        np.int64
    )

    # Per-round arrays.
    n_chunks = -(-tot_len // chunk)
    local_chunk = (st_pos - member_start[st_prod]) // chunk
    round_arrays = []
    for r in range(num_rounds):
        m0, m1 = int(member_offsets[r]), int(member_offsets[r + 1])
        t0, t1 = int(tok_off[m0]), int(tok_off[m1])
        cu = tok_off[m0 : m1 + 1] - t0
        chunk_off = np.zeros(m1 - m0 + 1, dtype=np.int64)
        np.cumsum(n_chunks[m0:m1], out=chunk_off[1:])
        s0, s1 = int(state_offsets[r]), int(state_offsets[r + 1])
        p_local = st_prod[s0:s1] - m0
        lc = local_chunk[s0:s1]
        is_final = lc >= n_chunks[st_prod[s0:s1]]
        save_src = np.where(is_final, chunk_off[-1] + p_local, chunk_off[p_local] + lc)
        round_arrays.append(
            LinearRoundArrays(
                cu_seqlens=cu,
                token_rows=token_rows[t0:t1],
                output_mask=output_mask[t0:t1],
                start_positions=member_start[m0:m1],
                initial_slot=member_slot[m0:m1],
                chunk_offsets=chunk_off,
                save_src=save_src.astype(np.int64, copy=False),
                save_slot=np.arange(s0, s1, dtype=np.int64),
                needs_chunk_states=bool((~is_final).any()),
            )
        )
    arrays = LinearCallArrays(
        chunk_size=chunk,
        rounds=tuple(round_arrays),
        num_states=num_states,
        state_offsets=state_offsets,
    )
    return LinearCallPlan(
        chunk_size=chunk,
        compact_tokens=c_rows,
        arrays=arrays,
        member_offsets=member_offsets,
        member_round=member_round,
        member_start=member_start,
        member_fork=member_fork,
        member_producer=member_producer,
        member_slot=member_slot,
        member_seg_offsets=member_seg_offsets,
        member_segments=seg_order,
        segment_member=segment_member,
        state_producer=st_prod,
        state_position=st_pos,
    )
