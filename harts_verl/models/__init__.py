"""Models in tree mode: the native hybrid model and adapters for HF hybrids."""

from harts_verl.models.config import PRESETS, HybridConfig, preset
from harts_verl.models.hybrid import HybridForCausalLM

__all__ = ["PRESETS", "HybridConfig", "HybridForCausalLM", "preset"]
