"""Cost models: pure functions returning a number, one per decision.

Kept free of state and I/O (like ``distributed.stealing.steal_time_ratio``) so each
can be read, tested and tuned on its own.
"""
from __future__ import annotations


def eviction_score(hits: int, idle_s: float, nbytes: int, half_life_s: float) -> float:
    """How much a KV block deserves to stay in a fast tier; the lowest goes first.

    AAFLOW+ 4.4 scores a state by reuse and size. Here: reuse frequency, discounted by
    how long the block has sat unused (half-life decay), per byte it occupies::

        score = (1 + hits) * 0.5 ** (idle_s / half_life_s) / nbytes

    A block read by many branches outlives one read once; among equals the one idle
    longest goes first (LRU as the tie-breaker); a large partial-use block gives way
    to several small ones of equal value.

    Examples
    --------
    >>> hot = eviction_score(hits=8, idle_s=5.0, nbytes=1_000, half_life_s=60.0)
    >>> cold = eviction_score(hits=0, idle_s=5.0, nbytes=1_000, half_life_s=60.0)
    >>> stale = eviction_score(hits=8, idle_s=600.0, nbytes=1_000, half_life_s=60.0)
    >>> cold < hot and stale < hot
    True
    """
    assert nbytes >= 0 and half_life_s > 0, "nbytes must be >= 0 and half_life_s > 0"
    return (1 + hits) * 0.5 ** (max(idle_s, 0.0) / half_life_s) / max(nbytes, 1)
