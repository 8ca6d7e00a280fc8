"""veRL integration (the only package that imports verl).

Modules: ``plugin`` (entry point, registers engine backend ``harts_fsdp2``), ``config``
(``HartsFSDPActorConfig`` with the ``harts:`` section), ``engine`` (the engine), ``trainer``
(tree-aware DP balancing), ``check`` (fidelity audit), ``cpu_platform`` (CPU shim for tests).
"""
