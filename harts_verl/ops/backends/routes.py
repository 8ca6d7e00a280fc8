"""A process-wide tally of which kernel each backend call ran: ``linear/<route>`` and
``attention/<route>`` (a fast backend's own name, or where ``auto`` sent the call instead, e.g.
``attention/sdpa (float32)`` for a dtype the varlen kernel does not take). ``harts-verl bench``
reports the calls of its timed iterations, so a result says what it measured."""

from __future__ import annotations

from collections import Counter

__all__ = ["count_route", "kernel_routes"]

_ROUTES: Counter[str] = Counter()


def count_route(route: str) -> None:
    """Count one kernel call along ``route``."""
    _ROUTES[route] += 1


def kernel_routes(*, reset: bool = False) -> dict[str, int]:
    """The calls counted so far per route (sorted by route); ``reset`` starts a new tally."""
    out = dict(sorted(_ROUTES.items()))
    if reset:
        _ROUTES.clear()
    return out
