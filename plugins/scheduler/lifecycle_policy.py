"""The pure rules of the KV lifecycle: predicted idle time, move costs, offload or prefetch.

Nalar 4.5 / Algorithm 3, AAFLOW+ 4.4. Each is a documented function of numbers the
``kv-lifecycle`` extension (:mod:`dask_kvstate.plugins.scheduler.lifecycle`) measured,
so a rule is checked by its examples and by cases in the tests, apart from a cluster.
"""

from __future__ import annotations


def move_seconds(nbytes: int, rate: float | None, latency_s: float) -> float:
    """Seconds to move ``nbytes`` at a measured ``rate`` (bytes/s), plus a message latency.

    An unmeasured move (``rate`` None) is priced infinite: the policy never bets on it.

    Examples
    --------
    >>> move_seconds(1_000_000, 1e9, 0.001)
    0.002
    >>> move_seconds(10, None, 0.0)
    inf
    """
    return nbytes / rate + latency_s if rate else float("inf")


def predict_idle(waits: list[tuple[float | None, float]]) -> float | None:
    """Predicted seconds until runnable: the max over unresolved dependencies of (mean - elapsed).

    ``waits`` holds, per unresolved dependency, its component's mean duration (None if never
    seen) and how long it has run so far (0 if not started). None when nothing is awaited
    or a component was never seen: without history there is no prediction.

    Examples
    --------
    >>> predict_idle([(2.0, 0.5), (1.0, 0.0)])
    1.5
    >>> predict_idle([(2.0, 3.0)])   # overran its mean: due any moment
    0.0
    >>> predict_idle([(2.0, 0.5), (None, 0.0)]) is None
    True
    """
    if not waits or any(mean is None for mean, _ in waits):
        return None
    return max(max(mean - elapsed, 0.0) for mean, elapsed in waits if mean is not None)


def lifecycle_action(
    predicted_s: float | None, device_bytes: int, lower_bytes: int, costs: dict, margin_s: float, host_room: bool = True
) -> tuple[str | None, str | None]:
    """The lifecycle rule for one suspended session's KV on one worker (Nalar Algorithm 3).

    Parameters
    ----------
    predicted_s : float or None
        Predicted seconds until the session is runnable (:func:`predict_idle`).
    device_bytes, lower_bytes : int
        The session's own KV bytes in the device tier, and in host + disk.
    costs : dict
        ``{"host": (offload_s, restore_s), "disk": (offload_s, restore_s)}`` for these bytes.
    margin_s : float
        Prefetch this long before the restore would have to start.
    host_room : bool
        Whether the host tier can take the bytes; if not, offload goes to disk.

    Returns
    -------
    ("offload", tier), ("prefetch", None) or (None, None).

    Examples
    --------
    >>> costs = {"host": (0.01, 0.01), "disk": (0.05, 0.1)}
    >>> lifecycle_action(5.0, 1000, 0, costs, 0.05)            # long idle: out to host
    ('offload', 'host')
    >>> lifecycle_action(5.0, 1000, 0, costs, 0.05, host_room=False)
    ('offload', 'disk')
    >>> lifecycle_action(0.015, 1000, 0, costs, 0.05)          # back too soon to pay the move
    (None, None)
    >>> lifecycle_action(0.1, 0, 1000, costs, 0.05)            # due within restore + margin: fetch
    ('prefetch', None)
    >>> lifecycle_action(None, 1000, 0, costs, 0.05)           # no prediction: leave it
    (None, None)
    """
    if predicted_s is None:
        return None, None
    if lower_bytes > 0:
        restore = max(costs[t][1] for t in costs)  # the blocks may lie in either lower tier
        if predicted_s <= restore + margin_s:
            return "prefetch", None
    if device_bytes > 0:
        tier = "host" if host_room else "disk"
        offload_s, restore_s = costs[tier]
        if predicted_s > offload_s + restore_s + margin_s:
            return "offload", tier
    return None, None


def pressure_victims(idle: list[tuple[float, str, int]], need_bytes: float) -> list[str]:
    """Sessions to offload for device pressure: the longest idle first, until ``need_bytes`` are freed.

    ``idle`` holds ``(last activity time, session, device bytes)`` of suspended sessions.

    Examples
    --------
    >>> pressure_victims([(5.0, "b", 300), (1.0, "a", 100), (3.0, "c", 200)], 250)
    ['a', 'c']
    >>> pressure_victims([(1.0, "a", 100)], 0)
    []
    """
    out = []
    for _, sid, nbytes in sorted(idle):
        if need_bytes <= 0:
            break
        out.append(sid)
        need_bytes -= nbytes
    return out


def uses_kv(ts) -> bool:
    """Whether a scheduler task reads or builds KV: an operator task, or one fed a state.

    A session is suspended while only its other tasks (tools, tests) run; those are
    what its KV waits on.
    """
    return str(ts.key).startswith("kvs-") or any("KVStateRef" in (d.type or "") for d in ts.dependencies)
