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


def prefill_seconds(missing_tokens: int, cached_tokens: int, per_token_s: float, per_pair_s: float) -> float:
    """Time to prefill ``missing_tokens`` on top of ``cached_tokens`` already in the cache.

    Each new token pays a fixed cost (the MLPs and projections) and attends to every
    token before it::

        t = m * per_token_s + m * (c + m / 2) * per_pair_s

    with ``m`` missing and ``c`` cached tokens. The two coefficients are measured on
    each worker (a probe at start, then every real prefill), never assumed.

    Examples
    --------
    >>> round(prefill_seconds(100, 0, 1e-3, 1e-6), 4)
    0.105
    >>> prefill_seconds(100, 1000, 1e-3, 1e-6) > prefill_seconds(100, 0, 1e-3, 1e-6)
    True
    """
    m, c = max(missing_tokens, 0), max(cached_tokens, 0)
    return m * per_token_s + m * (c + m / 2) * per_pair_s


def transfer_seconds(missing_bytes: int, bandwidth: float, latency: float) -> float:
    """T_transfer = missing_bytes / bandwidth + latency (AAFLOW+ eq. 27).

    Examples
    --------
    >>> transfer_seconds(100_000_000, bandwidth=1e9, latency=0.001)
    0.101
    """
    if missing_bytes <= 0:
        return 0.0
    return missing_bytes / max(bandwidth, 1.0) + latency


def transfer_or_recompute(
    missing_bytes: int,
    missing_tokens: int,
    cached_tokens: int,
    *,
    bandwidth: float,
    latency: float,
    per_token_s: float,
    per_pair_s: float,
) -> tuple[str, float, float]:
    """The AAFLOW+ rule (eq. 30): move the missing KV if that beats recomputing it.

    Returns ``(choice, t_transfer, t_recompute)`` with choice ``"pull"`` or
    ``"recompute"`` (``"local"`` when nothing is missing).

    Examples
    --------
    >>> transfer_or_recompute(50_000_000, 1000, 0, bandwidth=1.25e6, latency=1e-3,
    ...                       per_token_s=1e-3, per_pair_s=1e-6)[0]   # 10 Mbit/s: recompute
    'recompute'
    >>> transfer_or_recompute(50_000_000, 1000, 0, bandwidth=1.25e9, latency=1e-3,
    ...                       per_token_s=1e-3, per_pair_s=1e-6)[0]   # 10 Gbit/s: pull
    'pull'
    """
    if missing_tokens <= 0:
        return "local", 0.0, 0.0
    t_transfer = transfer_seconds(missing_bytes, bandwidth, latency)
    t_recompute = prefill_seconds(missing_tokens, cached_tokens, per_token_s, per_pair_s)
    return ("pull" if t_transfer < t_recompute else "recompute"), t_transfer, t_recompute
