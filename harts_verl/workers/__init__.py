"""veRL integration (the only package that imports verl).

Modules: ``plugin`` (entry point, registers engine backend ``harts_fsdp2``), ``config``
(``HartsFSDPActorConfig`` with the ``harts:`` section), ``engine`` (the engine), ``positions``
(position ids vs tree depths), ``trainer`` (tree-aware DP balancing), ``check`` (fidelity
audit), ``cpu_platform`` (CPU shim for tests).
"""

# The engine backend name (``actor_rollout_ref.actor.strategy``). Defined here, free of veRL
# imports: ``config`` imports verl, which loads our plugin, which imports ``engine``; the engine
# must not need a half-initialised ``config`` for its name.
STRATEGY = "harts_fsdp2"
