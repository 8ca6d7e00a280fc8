"""harts_verl.workers.positions.token_sequences on every nested layout a batch can carry."""

from __future__ import annotations

import pytest
import torch

from harts_verl.workers.positions import token_sequences


def _want(t: torch.Tensor) -> list[list[int]]:
    return [r.tolist() for r in t.unbind()]


def test_token_sequences_equal_unbind_for_every_layout():
    parts = [torch.arange(3), torch.arange(5) + 10, torch.tensor([7])]
    jagged = torch.nested.nested_tensor(parts, layout=torch.jagged)
    strided = torch.nested.as_nested_tensor(parts, layout=torch.strided)
    base = torch.arange(20).reshape(4, 5)
    holes = torch.nested.narrow(  # non-contiguous jagged: values() has the gaps
        base, 1, torch.tensor([0, 1, 2, 0]), torch.tensor([2, 3, 1, 5]), layout=torch.jagged
    )
    dense = torch.arange(12).reshape(3, 4).to(torch.int32)
    for t in (jagged, strided, holes, dense):
        assert [s.tolist() for s in token_sequences(t)] == _want(t)
    with pytest.raises(TypeError, match="input_ids: expected integer"):
        token_sequences(torch.zeros(2, 3))
