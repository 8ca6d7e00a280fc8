"""Makes the shared test helpers in this folder importable (the folder is not a package)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
