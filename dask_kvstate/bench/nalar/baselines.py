"""The baselines a user would configure without this library, and the static split's grid candidates.

``default`` is stock Dask on the workflow's start split; ``naive`` adds a hand-written
``priority=`` by request progress (:class:`~dask_kvstate.bench.nalar.workflows.Request`);
``static-best`` is stock Dask on the best static role split found in hindsight: the
candidates are the splits whose every role's offered work (the exact seconds the run's
arrivals draw for it, per second of arrivals) is below its units, fewest calls
expected to wait first, then the others, and each candidate is then run
(:func:`~dask_kvstate.bench.nalar.runner.grid_search`).
"""

from __future__ import annotations

from collections.abc import Iterator

from dask_kvstate.bench.nalar.workflows import Draws, Workflow, arrival_times, kind_of
from dask_kvstate.plugins.scheduler.queueing import expected_queue

BASELINES = ("default", "naive", "static-best")


def offered_load(wf: Workflow, duration: float, seeds: list[int]) -> dict[str, float]:
    """Units of work each role is offered: its drawn call seconds over the arrivals of ``seeds``, per second."""
    kind, load = kind_of(wf), dict.fromkeys(wf.roles, 0.0)
    for seed in seeds:
        for rid, t in enumerate(arrival_times(wf, duration, seed)):
            for r, s in kind.load(wf, kind.plan(Draws(wf, seed, rid), float(t), duration)).items():
                load[r] += s
    return {r: s / (duration * len(seeds)) for r, s in load.items()}


def splits(roles: list[str], total: int) -> Iterator[dict[str, int]]:
    """Every split of ``total`` units over ``roles``, each role at least one.

    >>> list(splits(["a", "b"], 3))
    [{'a': 1, 'b': 2}, {'a': 2, 'b': 1}]
    """
    if len(roles) == 1:
        if total >= 1:
            yield {roles[0]: total}
        return
    for n in range(1, total - len(roles) + 2):
        for rest in splits(roles[1:], total - n):
            yield {roles[0]: n, **rest}


def max_utilisation(load: dict[str, float], split: dict[str, int]) -> float:
    return max(load[r] / split[r] for r in split)


def grid_candidates(load: dict[str, float], total: int, grid_max: int) -> list[tuple[dict[str, int], float]]:
    """The splits worth running, as (split, max utilisation), the most promising first.

    Those under which every role's offered work is below its units first, fewest calls
    expected to wait first (Erlang C, as the capacity controller ranks splits), then the
    rest by max utilisation (a non-stationary workload overloads every split in some
    phase, which the average hides), at most ``grid_max`` in all. Ranked by max
    utilisation alone, the router workflow's best split (2/2/8) came fifth.

    >>> grid_candidates({"a": 2.5, "b": 0.5}, 4, 2)
    [({'a': 3, 'b': 1}, 0.8333333333333334), ({'a': 2, 'b': 2}, 1.25)]
    >>> [s for s, _ in grid_candidates({"a": 3.5, "b": 1.5}, 4, 2)]
    [{'a': 3, 'b': 1}, {'a': 2, 'b': 2}]
    >>> [s for s, _ in grid_candidates({"router": 0.56, "chat": 0.41, "code": 4.84}, 12, 2)]
    [{'router': 2, 'chat': 2, 'code': 8}, {'router': 2, 'chat': 1, 'code': 9}]
    """
    ranked = sorted(splits(list(load), total), key=lambda s: (expected_queue(load, s), max_utilisation(load, s)))
    return [(s, max_utilisation(load, s)) for s in ranked[:grid_max]]
