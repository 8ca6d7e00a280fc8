"""Hypothesis strategies for random rollout forests, shared by the op tests (imported through
``tests/conftest.py``, which puts this folder on ``sys.path``; not a test module)."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def sequence_lists(draw: st.DrawFn, max_traj: int = 8, alphabet: int = 4) -> list[list[int]]:
    """Trajectories built by extending, forking, copying and truncating earlier ones (several
    roots, identical trajectories, prefixes of others, length-1 trajectories)."""
    tok = st.integers(0, alphabet - 1)
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_traj))):
        kind = draw(st.sampled_from(["new", "extend", "fork", "copy", "prefix"])) if seqs else "new"
        if kind == "new":
            seqs.append(draw(st.lists(tok, min_size=1, max_size=10)))
            continue
        base = seqs[draw(st.integers(0, len(seqs) - 1))]
        if kind == "extend":
            seqs.append(base + draw(st.lists(tok, min_size=1, max_size=6)))
        elif kind == "fork":
            cut = draw(st.integers(0, len(base)))
            seqs.append(base[:cut] + draw(st.lists(tok, min_size=1, max_size=6)))
        elif kind == "copy":
            seqs.append(list(base))
        else:
            seqs.append(base[: draw(st.integers(1, len(base)))])
    return seqs


@st.composite
def shared_sequences(
    draw: st.DrawFn, max_new: int = 7, short_tail: int = 6, max_ext: int = 8
) -> list[list[int]]:
    """Roots with distinct first tokens; each new sequence extends a prefix of an earlier one
    (possibly by nothing) with a small alphabet: forks, prefixes, duplicates, long chains."""
    n_roots = draw(st.integers(1, 3))
    seqs: list[list[int]] = []
    for r in range(n_roots):
        long_chain = draw(st.booleans())
        tail = draw(
            st.lists(st.integers(0, 2), min_size=0, max_size=40 if long_chain else short_tail)
        )
        seqs.append([10 + r, *tail])
    for _ in range(draw(st.integers(0, max_new))):
        base = seqs[draw(st.integers(0, len(seqs) - 1))]
        cut = draw(st.integers(1, len(base)))
        ext = draw(st.lists(st.integers(0, 2), min_size=0, max_size=max_ext))
        seqs.append(base[:cut] + ext)
    return seqs
