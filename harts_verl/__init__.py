"""harts-verl: HARTS rollout-tree training for veRL."""

__version__ = "0.1.0"
