"""The split of role units with the fewest calls waiting (M/M/c, Erlang C), and when to move to it.

Pure functions: the capacity controller (:mod:`~dask_kvstate.plugins.scheduler.capacity`)
measures demand and moves units; the harness ranks its static grid by the same queue.

Nalar reallocates units to the role with the lowest normalised capacity, that is the
highest utilisation. That objective is blind to how many units share a load: a role
offered 0.6 units of work queues fifteen times as long on one unit as on two, and three
times as long as a role 61% busy on seven. So on the analyst workflow (6 analysts and 2
summarizers, 72% / 41% busy) a window whose summarizer calls dip to 0.6 units makes
7 / 1 look better (61% / 60%) and moves a summarizer unit away; such moves made the
workflow 5-10% slower than never moving. What a request's latency pays is waiting, so
the capacity controller minimises the calls expected to wait, summed over roles, which
by Little's law is the waiting time per request times the request rate.
"""

from __future__ import annotations

import math


def queue_length(units: int | float, load: float) -> float:
    """Calls expected to wait for ``units`` servers offered ``load`` units of work (M/M/c).

    ``load`` is arrivals per second times mean service seconds (Erlang). Erlang C gives the
    chance that a call waits; the mean queue is that chance times ``load / (units - load)``.
    Infinite when the role is offered at least as much work as it has units.

    The exponential service time is an approximation: the workflows' calls are
    log-normal with a squared coefficient of variation near one, where M/M/c and the
    M/G/c approximations of Allen-Cunneen differ little.

    Examples
    --------
    >>> round(queue_length(1, 0.5), 3)   # M/M/1: rho^2 / (1 - rho)
    0.5
    >>> round(queue_length(2, 0.82), 3), round(queue_length(1, 0.82), 3)   # a role's second unit
    (0.166, 3.736)
    >>> queue_length(3, 3.0), queue_length(2, 0.0)
    (inf, 0.0)
    """
    c = int(units)
    if load <= 0:
        return 0.0
    if load >= c:
        return math.inf
    # Erlang B by its recurrence (no factorials, stable for any c), then C from B.
    b = 1.0
    for k in range(1, c + 1):
        b = load * b / (k + load * b)
    wait = c * b / (c - load * (1 - b))
    return wait * load / (c - load)


def expected_queue(demand: dict, units: dict) -> float:
    """Calls expected to wait, summed over roles (infinite when one is overloaded).

    >>> round(expected_queue({"a": 4.3, "b": 0.82}, {"a": 6, "b": 2}), 2)
    1.08
    >>> round(expected_queue({"a": 4.3, "b": 0.82}, {"a": 7, "b": 1}), 2)
    4.02
    """
    return sum(queue_length(units.get(v, 0), d) for v, d in demand.items())


def target_split(demand: dict, total: int, limits: dict, current: dict | None = None) -> dict | None:
    """Whole units per role, ``total`` in all, with the fewest calls expected to wait.

    Every role first gets its minimum (``limits[v]["min"]``, default 1). Each further
    unit, within the roles' ``max``, goes to the most utilised role offered at least as
    much work as it has units (its queue would grow without bound), and once none is, to
    the role whose expected queue it shortens most (:func:`queue_length`; the queue is
    convex in units, so unit by unit is optimal). Ties keep ``current`` where it has
    more. Returns None when the minimums do not fit in ``total``.

    Examples
    --------
    >>> target_split({"plan": 0.42, "dev": 4.65, "test": 2.4}, 12, {})   # the SWE workflow's offered work
    {'plan': 1, 'dev': 7, 'test': 4}
    >>> target_split({"analyst": 4.3, "summarizer": 0.6}, 8, {})   # even utilisation would give 7 / 1
    {'analyst': 6, 'summarizer': 2}
    >>> target_split({"dev": 5.0, "test": 1.0}, 8, {"test": {"min": 3}})
    {'dev': 5, 'test': 3}
    >>> target_split({"a": 1.0, "b": 1.0}, 1, {}) is None
    True
    """
    units = {v: int((limits.get(v) or {}).get("min", 1)) for v in demand}
    left = total - sum(units.values())
    if left < 0:
        return None
    current = current or {}

    def claim(v: str) -> tuple:
        n, d = units[v], demand[v]
        overloaded = d >= n
        need = d / max(n, 1e-9) if overloaded else queue_length(n, d) - queue_length(n + 1, d)
        return (overloaded, need, current.get(v, 0) > n, v)

    for _ in range(left):
        open_ = [v for v in demand if (limits.get(v) or {}).get("max") is None or units[v] < limits[v]["max"]]
        if not open_:
            break
        units[max(open_, key=claim)] += 1
    return units


def peak_utilisation(demand: dict, units: dict) -> float:
    """``max_v demand_v / R_v`` (infinite when a role with demand has no unit).

    >>> peak_utilisation({"a": 1.0, "b": 3.0}, {"a": 2, "b": 4})
    0.75
    """
    return max((d / units[v] if units.get(v) else float("inf")) if d > 0 else 0.0 for v, d in demand.items())


def against_the_move(demand: dict, error: dict, units: dict, target: dict, sigmas: float) -> dict:
    """``demand`` moved ``sigmas`` standard errors against a move from ``units`` to ``target``.

    A role the move gives units to is taken as offered less work, a role it takes units
    from as offered more: a move still worth making on these is not one that the noise of
    a few seconds of measurements made look worth it.

    >>> against_the_move({"a": 4.3, "b": 0.82}, {"a": 0.4, "b": 0.2}, {"a": 6, "b": 2}, {"a": 7, "b": 1}, 1.0)
    {'a': 3.9, 'b': 1.02}
    """
    out = {}
    for v, d in demand.items():
        sign = (units.get(v, 0) > target.get(v, 0)) - (units.get(v, 0) < target.get(v, 0))
        out[v] = max(d + sign * sigmas * error.get(v, 0.0), 0.0)
    return out


def congestion(demand: dict, units: dict) -> tuple[float, float]:
    """A split's (expected queue, peak utilisation) under ``demand``: what :func:`worth_moving` compares.

    >>> congestion({"a": 0.5}, {"a": 1})   # M/M/1 at 50%: half a call waiting
    (0.5, 0.5)
    """
    return expected_queue(demand, units), peak_utilisation(demand, units)


def worth_moving(now: tuple[float, float], then: tuple[float, float], epsilon: float) -> bool:
    """Whether a split of :func:`congestion` ``then`` is worth moving to from one of ``now``.

    It must cut the expected queue by more than ``epsilon`` (relative); when both splits
    overload a role (both queues infinite), it must cut the peak utilisation so instead.

    >>> worth_moving((1.09, 0.72), (4.02, 0.61), 0.05)   # lower peak, longer queue: stay
    False
    >>> worth_moving((float("inf"), 1.2), (2.0, 0.8), 0.05)   # out of overload
    True
    >>> worth_moving((float("inf"), 1.5), (float("inf"), 1.2), 0.05)   # overloaded either way, less so
    True
    """
    (now_q, now_peak), (then_q, then_peak) = now, then
    if math.isinf(now_q) and math.isinf(then_q):
        return then_peak < now_peak * (1 - epsilon)
    return then_q < now_q * (1 - epsilon)
