"""One builder for the hand-made rollout batches of the model tests (``_forked`` is not a test
module): a shared prompt with forks, a prefix of another trajectory, an identical pair, a second
root and a one-token trajectory."""

from __future__ import annotations

import numpy as np


def forked_sequences(
    seed: int,
    vocab: int,
    *,
    prompt: int,
    extension: int,
    forks: list[tuple[int, int]],
    root: int,
) -> list[list[int]]:
    """``[a, *branches, p, copy of a, r, [p[0]]]`` where ``p`` is a ``prompt``-token prompt,
    ``a = p + extension`` fresh tokens, each branch ``p[:cut] + tail`` fresh tokens for
    ``(cut, tail)`` in ``forks`` (a fork at position ``cut``), and ``r`` a second root of ``root``
    tokens. Tokens in ``[0, vocab)`` from ``numpy.random.default_rng(seed)``, drawn in that order
    (deterministic)."""
    rng = np.random.default_rng(seed)
    p = rng.integers(0, vocab, prompt).tolist()
    a = p + rng.integers(0, vocab, extension).tolist()
    branches = [p[:cut] + rng.integers(0, vocab, tail).tolist() for cut, tail in forks]
    return [a, *branches, p, list(a), rng.integers(0, vocab, root).tolist(), [int(p[0])]]
