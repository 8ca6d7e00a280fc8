"""Cut linear-attention members so that every materialized boundary state is a *final* state.

Why. The planner (:mod:`harts_verl.tree.linear_plan`) may ask to keep a member's state at a chunk
boundary *inside* the member (``save_src`` pointing into the chunk-start states): that is where a
branch forks off the middle of a continuing member. Our torch reference returns exact chunk-start
states (:class:`~harts_verl.ops.linear_attention.ChunkStates`), but fla's ``chunk_kda`` /
``chunk_gated_delta_rule`` only return the **final** state of each sequence in float32; their
per-chunk states ``h`` are stored in the input dtype (bf16 for bf16 inputs) and are internal.
Handing a branch a bf16-rounded state would break invariant 5 (fp32, exact state handoff).

What. :func:`split_members_at_saved_boundaries` rewrites the array form of a plan: a member with
saved boundaries at local chunks ``c1 < … < ck`` becomes ``k + 1`` *pieces* ``[0, c1·B)``,
``[c1·B, c2·B)``, …, ``[ck·B, L)``. Piece ``j`` ends exactly at a saved boundary, so that state
is its final state (fp32); piece ``j + 1`` starts from it (an ordinary state slot). Every cut is a
multiple of the chunk size ``B`` past the member start, which is itself an absolute chunk
boundary, so each piece starts on an absolute chunk boundary and the chunk partition of every
path is unchanged (invariant 5). Replay (``< B`` rows) stays at the head of piece 0 because every
cut is at ``≥ B``.

Schedule. A piece depends on its predecessor piece (same member) or, for piece 0, on the piece
that produced its initial state. Pieces are put in the earliest round their dependencies allow
(longest-path levels of that DAG), so the rewritten plan has the fewest rounds for these cuts;
inside a round, pieces keep the original (round, member, piece) order. Slots are renumbered round
by round, as :class:`~harts_verl.tree.linear_plan.LinearCallArrays` requires.

Cost. No token is added or recomputed: only more (smaller) varlen sequences and possibly more
rounds. With the exact reference kernel the rewritten plan gives bitwise the same outputs and
states in float32 (checked in ``tests/test_backends.py``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from harts_verl.tree.linear_plan import LinearCallArrays, LinearRoundArrays

__all__ = ["split_members_at_saved_boundaries"]


@dataclass
class _Piece:
    level: int
    round: int
    t0: int  # token range inside the original round
    t1: int
    start_position: int
    init_old_slot: int  # old slot of its initial state, -1 for zeros
    saves: list[int]  # old slots that are this piece's final state


def split_members_at_saved_boundaries(arrays: LinearCallArrays) -> LinearCallArrays:
    """Rewrite ``arrays`` so that every kept state is the final state of some member.

    Args:
      arrays: the array form of a :class:`~harts_verl.tree.linear_plan.LinearCallPlan`.

    Returns:
      A new :class:`LinearCallArrays` over the same compact rows, with
      ``needs_chunk_states == False`` in every round and every ``save_src`` pointing at a final
      state (``>= chunk_offsets[-1]``). Returns ``arrays`` itself when nothing needs cutting.
      Deterministic (invariant 9).

    Raises:
      ValueError: a kept state lies at local chunk 0 of its member (that is the member's
        initial state; the planner never asks for it) or beyond the member's last chunk.
    """
    if not any(ra.needs_chunk_states for ra in arrays.rounds):
        return arrays
    b = int(arrays.chunk_size)
    num_states = int(arrays.num_states)
    slot_level = np.full(num_states, -1, dtype=np.int64)
    pieces: list[_Piece] = []

    for r, ra in enumerate(arrays.rounds):
        cu = ra.cu_seqlens.tolist()
        co = ra.chunk_offsets
        total_chunks = int(co[-1])
        n_mem = len(cu) - 1
        src = np.asarray(ra.save_src, dtype=np.int64)
        slots = np.asarray(ra.save_slot, dtype=np.int64)
        is_final = src >= total_chunks
        member = np.where(is_final, src - total_chunks, np.searchsorted(co, src, side="right") - 1)
        local = np.where(is_final, -1, src - co[np.clip(member, 0, n_mem - 1)])
        # Per member: {local chunk (-1 = end): [old slots]} in slot order.
        per_member: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for m, c, s in zip(member.tolist(), local.tolist(), slots.tolist()):
            per_member[m][c].append(s)
        starts = ra.start_positions.tolist()
        init_slots = ra.initial_slot.tolist()
        for n in range(n_mem):
            length = cu[n + 1] - cu[n]
            n_chunks = -(-length // b)
            saves = per_member.get(n, {})
            cuts = sorted(c for c in saves if c >= 0)
            if cuts and (cuts[0] < 1 or cuts[-1] >= n_chunks):
                raise ValueError(
                    f"round {r} member {n}: kept state at local chunk {cuts[0]}..{cuts[-1]}, "
                    f"expected 1..{n_chunks - 1}"
                )
            init = int(init_slots[n])
            level = int(slot_level[init]) + 1 if init >= 0 else 0
            if init >= 0 and level == 0:  # pragma: no cover - plan invariant
                raise ValueError(
                    f"round {r} member {n}: initial slot {init} is not produced earlier"
                )
            bounds = [0, *(c * b for c in cuts), length]
            ends = [*cuts, -1]
            for j in range(len(bounds) - 1):
                piece_saves = list(saves.get(ends[j], []))
                pieces.append(
                    _Piece(
                        level=level,
                        round=r,
                        t0=cu[n] + bounds[j],
                        t1=cu[n] + bounds[j + 1],
                        start_position=int(starts[n]) + bounds[j],
                        init_old_slot=init,
                        saves=piece_saves,
                    )
                )
                for s in piece_saves:
                    slot_level[s] = level
                if j + 1 < len(bounds) - 1:
                    init = piece_saves[0]
                    level += 1

    # Rounds = levels; stable order (original round, member, piece) inside a level.
    order = sorted(range(len(pieces)), key=lambda i: pieces[i].level)
    num_rounds = (max(p.level for p in pieces) + 1) if pieces else 0
    new_slot = np.full(num_states, -1, dtype=np.int64)
    nxt = 0
    for i in order:
        for s in pieces[i].saves:
            new_slot[s] = nxt
            nxt += 1
    if nxt != num_states:  # pragma: no cover - plan invariant
        raise AssertionError(f"split plan keeps {nxt} states, the plan has {num_states}")

    by_level: list[list[_Piece]] = [[] for _ in range(num_rounds)]
    for i in order:
        by_level[pieces[i].level].append(pieces[i])
    rounds: list[LinearRoundArrays] = []
    state_offsets = np.zeros(num_rounds + 1, dtype=np.int64)
    for lv, group in enumerate(by_level):
        lens = np.asarray([p.t1 - p.t0 for p in group], dtype=np.int64)
        cu = np.zeros(len(group) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        chunk_off = np.zeros(len(group) + 1, dtype=np.int64)
        np.cumsum(-(-lens // b), out=chunk_off[1:])
        src_rounds = arrays.rounds
        token_rows = np.concatenate([src_rounds[p.round].token_rows[p.t0 : p.t1] for p in group])
        output_mask = np.concatenate([src_rounds[p.round].output_mask[p.t0 : p.t1] for p in group])
        init = np.asarray(
            [new_slot[p.init_old_slot] if p.init_old_slot >= 0 else -1 for p in group],
            dtype=np.int64,
        )
        save_src = np.asarray(
            [chunk_off[-1] + n for n, p in enumerate(group) for _ in p.saves], dtype=np.int64
        )
        s0 = int(state_offsets[lv])
        state_offsets[lv + 1] = s0 + save_src.shape[0]
        rounds.append(
            LinearRoundArrays(
                cu_seqlens=cu,
                token_rows=token_rows.astype(np.int64, copy=False),
                output_mask=output_mask.astype(bool, copy=False),
                start_positions=np.asarray([p.start_position for p in group], dtype=np.int64),
                initial_slot=init,
                chunk_offsets=chunk_off,
                save_src=save_src,
                save_slot=np.arange(s0, int(state_offsets[lv + 1]), dtype=np.int64),
                needs_chunk_states=False,
            )
        )
    return LinearCallArrays(
        chunk_size=b,
        rounds=tuple(rounds),
        num_states=num_states,
        state_offsets=state_offsets,
    )
