"""The dtype the ops compute reductions in (shared by the router, log-prob and model code)."""

from __future__ import annotations

import torch

__all__ = ["compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 for every other dtype (bf16 / fp16 hold integers
    only to 256 / 2048 and lose softmax and log-sum-exp precision)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
