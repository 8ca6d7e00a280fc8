"""Environment adapters for agentic RL recipes (``recipes/swebench``, ``recipes/tau3bench``).

* :mod:`.sandbox` — repository sandboxes (local temp copy, docker container); no veRL.
* :mod:`.swe` — SWE-bench records → veRL rows, test-based reward; no veRL.
* :mod:`.swe_tools` — veRL tools ``bash``, ``str_replace_editor``, ``submit``.
* :mod:`.tau` — τ-bench style domains (bundled fixture, ``tau2`` package), replay reward,
  user simulators; no veRL.
* :mod:`.tau_agent` — veRL tool ``TauTool`` and agent loop ``harts_tau_agent``.

Bundled task fixtures live in ``fixtures/`` (package data). Nothing here is imported by the
plugin; veRL imports the tool modules from the recipes' tool configs.
"""
