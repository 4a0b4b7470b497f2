"""How many calls wait for a role: the M/M/c queue (Erlang C) that prices a capacity split.

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
