"""``python -m harts_verl.cli`` as ``scripts/gpu_check.sh`` runs it: ``--preset NAME`` is read
from ``$BENCH_PRESET_JSON`` when the package defines no preset of that name (the check's larger
GPU model), and with ``$HARTS_COMPILE_LOG`` set, the Triton compiles the run makes are counted
into that JSON file (:class:`harts_verl.ops.backends.triton_cache.CompileLog`)."""

from __future__ import annotations

import atexit
import json
import os
import sys


def main(argv: list[str]) -> int:
    from harts_verl.models.config import PRESETS

    if "--preset" in argv:
        name = argv[argv.index("--preset") + 1]
        if name not in PRESETS:
            PRESETS[name] = json.loads(os.environ["BENCH_PRESET_JSON"])
    path = os.environ.get("HARTS_COMPILE_LOG")
    if path:
        try:  # HARTS_TRITON_AUTOTUNE itself is applied by the backends when fla loads
            from harts_verl.ops.backends.triton_cache import CompileLog

            log = CompileLog().install()

            def dump() -> None:
                with open(path, "w") as f:
                    json.dump(log.summary(), f)

            atexit.register(dump)
        except (ImportError, RuntimeError) as exc:
            print(f"gpu_check.sh: no Triton compile log ({exc})", file=sys.stderr)
    from harts_verl.cli import main as cli

    return cli(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
