"""Run fla's Triton kernels on the CPU through Triton's interpreter (tests only).

``TRITON_INTERPRET=1`` makes ``@triton.jit`` kernels run as numpy programs, one grid cell at a
time. Triton 3.6's interpreter has three gaps that fla 0.6's KDA / GatedDeltaNet kernels hit;
:func:`install` closes them without touching what the kernels compute:

1. Autotuning times each config through the GPU driver (there is none): every config reports the
   same time, so the first config runs.
2. ``for i in range(n)`` inside a kernel yields Python ints, while compiled Triton yields int32
   scalars (fla calls ``i.to(tl.int64)``): while a kernel runs, its module's ``range`` yields
   int32 scalar tensors.
3. ``int(x)`` of a one-element block (a loop bound read from memory) needs a 0-d array: it reads
   the one element.

The pinned versions (``triton==3.6.0``, ``fla-core==0.6.0``) are the ones the shim was written
against; ``install`` raises if the private hooks it wraps are missing.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Iterator

import numpy as np

_installed = False


def install() -> None:
    """Patch triton's interpreter and autotuner (idempotent). Needs ``TRITON_INTERPRET=1`` set
    before fla is imported."""
    global _installed
    if _installed:
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("set TRITON_INTERPRET=1 before importing triton / fla")
    import triton.language as tl
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interp

    for obj, attr in (
        (autotuner.Autotuner, "_bench"),
        (interp, "_patch_lang"),
        (interp, "_patch_lang_tensor"),
        (interp, "TensorHandle"),
    ):
        if not hasattr(obj, attr):
            raise RuntimeError(f"triton {obj.__name__}.{attr} missing: pin triton==3.6.0")

    def bench(self, *args, config=None, **kwargs):
        return [0.0, 0.0, 0.0]

    def scalar(i: int):
        return tl.core.tensor(
            interp.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32
        )

    def kernel_range(*args) -> Iterator:
        for i in builtins.range(*(int(a) for a in args)):
            yield scalar(i)

    patch_lang, patch_tensor = interp._patch_lang, interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def patch_lang_with_range(fn):
        scope = patch_lang(fn)
        g = fn.__globals__
        missing = object()
        old = g.get("range", missing)
        g["range"] = kernel_range
        restore = scope.restore

        def restore_all() -> None:
            restore()
            if old is missing:
                g.pop("range", None)
            else:
                g["range"] = old

        scope.restore = restore_all
        return scope

    autotuner.Autotuner._bench = bench
    interp._patch_lang_tensor = patch_lang_tensor
    interp._patch_lang = patch_lang_with_range
    _installed = True
