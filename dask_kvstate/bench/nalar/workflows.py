"""The Nalar workflows: seeded profiles, arrivals, and each request as ordinary Python over futures.

A request is one coroutine inside ``kvs.session``, submitting components as tasks that
ask for their agent role (``resources={"role:developer": 1}``) through its
:class:`Request`. Every random number a request needs comes from :class:`Draws`, seeded
by (run seed, request id) and drawn up front in a fixed order (a workflow's ``plan``),
so every configuration replays the very same durations and outcomes, and the work a
request offers each role can be summed in hindsight (its ``load``) without running it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from distributed import Client, Future

import dask_kvstate as kvs
from dask_kvstate.bench.nalar.components import classify, develop, run_tests, work


@dataclass
class Workflow:
    name: str
    roles: dict[str, int]  # role -> worker units at start (empty: role-free, generic workers)
    rate: float  # requests per second (outside a phase's burst)
    components: dict = field(default_factory=dict)  # component -> (median seconds, sigma)
    hints: dict = field(default_factory=dict)
    stateful: dict = field(default_factory=dict)  # hints applied only with --stateful
    nalar_hints: dict = field(default_factory=dict)  # component hints of the "+hints" configs
    # Per-worker role units; a worker's threads are its units (at least one: a worker of
    # no role is one generic thread). None: one single-thread worker per unit of ``roles``.
    workers: list[dict[str, int]] | None = None
    kind: str = ""  # the request coroutine of KINDS (default: ``name``)
    phase_seconds: float = 0.0  # the mix flips every phase (0: stationary)
    burst: tuple[float, float] = (1.0, 0.0)  # rate factor for the first seconds of every phase


WORKFLOWS = {
    "swe": Workflow(
        "swe",
        {"planner": 4, "developer": 4, "tester": 4},
        rate=7.0,
        components={"planner": (0.05, 0.8), "developer": (0.10, 0.8), "tester": (0.06, 0.8)},
        stateful={"developer": {"stateful": True}},
        nalar_hints={"tester": {"max-concurrency": 3}},
    ),
    "analyst": Workflow(
        "analyst",
        {"analyst": 6, "summarizer": 2},
        rate=7.0,
        components={"analyst": (0.08, 1.0), "summarizer": (0.06, 0.8)},
    ),
    "router": Workflow(
        "router",
        {"router": 2, "chat": 5, "code": 5},
        rate=20.0,
        components={"router": (0.02, 0.8), "chat": (0.12, 0.8), "code": (0.20, 0.8)},
        nalar_hints={"router": {"batchable": True, "max-batch": 16}},
    ),
    "phases": Workflow(
        "phases",
        {"developer": 4, "tester": 4},
        rate=5.0,
        # A call of its phase's heavy role draws "heavy", of the other role "light".
        components={"heavy": (0.8, 0.6), "light": (0.08, 0.6)},
        workers=[{"developer": 2, "tester": 2}, {"developer": 2, "tester": 2}],
        phase_seconds=10.0,
        burst=(2.0, 2.0),
    ),
    "swe-free": Workflow(
        "swe-free",
        {},
        rate=3.2,
        components={"planner": (0.05, 0.8), "developer": (0.10, 0.8), "tester": (0.06, 0.8)},
        stateful={"developer": {"stateful": True}},
        nalar_hints={"tester": {"max-concurrency": 3}},
        workers=[{}, {}, {}, {}],
        kind="swe",
    ),
}


def spread(roles: dict[str, int], n_workers: int) -> list[dict[str, int]]:
    """``roles``' units over ``n_workers`` workers, each role as evenly as possible.

    One unit at a time, round robin, continuing across roles, so the workers' totals
    (their threads) differ by one at most.

    >>> spread({"developer": 5, "tester": 3}, 2)
    [{'developer': 3, 'tester': 1}, {'developer': 2, 'tester': 2}]
    """
    out: list[dict[str, int]] = [dict.fromkeys(roles, 0) for _ in range(n_workers)]
    i = 0
    for r, n in roles.items():
        for _ in range(n):
            out[i % n_workers][r] += 1
            i += 1
    return out


def with_split(wf: Workflow, roles: dict[str, int]) -> Workflow:
    """``wf`` starting from the role units ``roles`` (spread over its workers, if it lays them out)."""
    workers = spread(roles, len(wf.workers)) if wf.workers else None
    return dataclasses.replace(wf, roles=dict(roles), workers=workers)


def configure(
    name: str,
    *,
    rate: float | None = None,
    stateful: bool = False,
    roles: str | None = None,
    median: str | None = None,
) -> Workflow:
    """A copy of ``WORKFLOWS[name]`` with the command line's overrides applied to it.

    ``roles`` gives units per role at start (``planner=1,developer=7,tester=4``, every
    role of the workflow), ``median`` median seconds per component call
    (``router=0.06``); a role set that differs, or an unknown component, raises ValueError.
    """
    wf = copy.deepcopy(WORKFLOWS[name])
    if rate:
        wf.rate = rate
    if stateful:
        wf.hints = {**wf.hints, **wf.stateful}
    if roles:
        units = {k: int(v) for k, v in (kv.split("=") for kv in roles.split(","))}
        if set(units) != set(wf.roles):
            raise ValueError(f"--roles must give every role of {name}: {sorted(wf.roles)}, got {sorted(units)}")
        wf = with_split(wf, units)
    if median:
        for comp, sec in (kv.split("=") for kv in median.split(",")):
            if comp not in wf.components:
                raise ValueError(f"--median: {name} has no component {comp!r}; it has {sorted(wf.components)}")
            wf.components[comp] = (float(sec), wf.components[comp][1])
    return wf


def arrival_times(wf: Workflow, duration: float, seed: int) -> np.ndarray:
    """Seeded open-loop arrivals over ``duration`` seconds: Poisson at ``wf.rate``, and with a
    burst, at ``factor`` times that for the first ``seconds`` of every phase (by thinning).

    The thinning has a stream of its own, so a shorter run's arrivals are a longer one's first.
    """
    rng = np.random.default_rng([seed, 10**6])
    factor, burst_s = wf.burst
    if burst_s <= 0:
        times = np.cumsum(rng.exponential(1 / wf.rate, int(duration * wf.rate * 2)))
        return times[times < duration]
    peak = wf.rate * factor
    times = np.cumsum(rng.exponential(1 / peak, int(duration * peak * 2)))
    in_burst = (times % wf.phase_seconds) < burst_s
    thin = np.random.default_rng([seed, 10**6 + 1]).random(len(times))
    keep = thin < np.where(in_burst, 1.0, 1.0 / factor)
    return times[keep & (times < duration)]


class Draws:
    """Per-request random numbers, drawn in a fixed order from a seed of (run seed, request)."""

    def __init__(self, wf: Workflow, seed: int, rid: int):
        self.rng = np.random.default_rng([seed, rid])
        self.wf = wf

    def seconds(self, component: str) -> float:
        median, sigma = self.wf.components[component]
        return float(min(median * self.rng.lognormal(0.0, sigma), 50 * median))  # 1 ms .. seconds

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)


def role(name: str) -> dict:
    """The worker resource a component of agent role ``name`` asks for."""
    return {f"role:{name}": 1}


class Request:
    """One request's submissions: its role resources, and under ``naive`` a priority by its progress.

    ``naive`` is what a user writes without this library: every ``submit`` passes
    ``priority=`` the number of this request's component calls already completed
    (counted by done callbacks), so requests further along run first. A role-free
    workflow asks for no resources.
    """

    def __init__(self, c: Client, wf: Workflow, rid: int, *, naive: bool = False):
        self.c, self.wf, self.rid, self.naive = c, wf, rid, naive
        self.completed = 0

    def submit(self, fn: Callable, *args: Any, key: str, role: str) -> Future:
        kwargs: dict[str, Any] = {"key": key}
        if self.wf.roles:
            kwargs["resources"] = {f"role:{role}": 1}
        if self.naive:
            kwargs["priority"] = self.completed
        fut = self.c.submit(fn, *args, **kwargs)
        if self.naive:  # only there: the other configs submit exactly as they always did
            fut.add_done_callback(self._count)
        return fut

    def _count(self, fut: Future) -> None:
        # Done callbacks run on one thread of the client's, so this never races itself.
        if fut.status == "finished":
            self.completed += 1


def plan_swe(d: Draws, t_arr: float, duration: float) -> tuple:
    """The planner's time, and per lane its 4 attempts: (developer s, test passes, tester s)."""
    plan_s = d.seconds("planner")
    lanes = [
        [(d.seconds("developer"), d.chance(0.65) or a == 3, d.seconds("tester")) for a in range(4)] for _ in range(3)
    ]
    return plan_s, lanes


def load_swe(wf: Workflow, plan: tuple) -> dict[str, float]:
    """Seconds per role; every retry attempt counts a rebuild (an upper bound: it may stay)."""
    plan_s, lanes = plan
    rebuild = 0.5 * wf.components["developer"][0]
    out = {"planner": plan_s, "developer": 0.0, "tester": 0.0}
    for attempts in lanes:
        for a, (dev_s, passed, test_s) in enumerate(attempts):
            out["developer"] += dev_s + (rebuild if a else 0.0)
            out["tester"] += test_s
            if passed:
                break
    return out


async def swe(r: Request, plan: tuple) -> None:
    """Planner -> 3 developer lanes -> a tester each; a failed test goes back to the lane (4 attempts)."""
    plan_s, lanes = plan
    rebuild, rid = 0.5 * r.wf.components["developer"][0], r.rid
    with kvs.session(f"{r.wf.name}-{rid}"):
        planned = r.submit(work, plan_s, key=f"planner-{rid}", role="planner")

        async def lane(k: int) -> None:
            previous = None  # the last attempt's future: its context is the next attempt's input
            for attempt, (dev_s, passed, test_s) in enumerate(lanes[k]):
                dev = r.submit(
                    develop, dev_s, rebuild, previous, planned, key=f"developer-{rid}-{k}-{attempt}", role="developer"
                )
                ok = r.submit(run_tests, test_s, passed, dev, key=f"tester-{rid}-{k}-{attempt}", role="tester")
                if await ok:
                    return
                previous = dev

        await asyncio.gather(*(lane(k) for k in range(3)))


def plan_analyst(d: Draws, t_arr: float, duration: float) -> tuple:
    """4 analysts and a summary; for half the requests a think time, 2 analysts and a summary."""
    first = ([d.seconds("analyst") for _ in range(4)], d.seconds("summarizer"))
    if not d.chance(0.5):
        return first, None
    think = d.seconds("summarizer") * 8
    return first, (think, [d.seconds("analyst") for _ in range(2)], d.seconds("summarizer"))


def load_analyst(wf: Workflow, plan: tuple) -> dict[str, float]:
    rounds = [plan[0]] + ([plan[1][1:]] if plan[1] else [])
    return {"analyst": sum(sum(views) for views, _ in rounds), "summarizer": sum(s for _, s in rounds)}


async def analyst(r: Request, plan: tuple) -> None:
    """4 analysts -> a summary; half the requests come back after a think time with a follow-up."""
    (views_s, summary_s), follow = plan
    rid = r.rid
    with kvs.session(f"analyst-{rid}"):
        views = [r.submit(work, s, key=f"analyst-{rid}-{i}", role="analyst") for i, s in enumerate(views_s)]
        await r.submit(work, summary_s, *views, key=f"summarizer-{rid}", role="summarizer")
        if follow:
            think, more_s, summary_s = follow
            await asyncio.sleep(think)
            more = [r.submit(work, s, key=f"analyst-{rid}-f{i}", role="analyst") for i, s in enumerate(more_s)]
            await r.submit(work, summary_s, *more, key=f"summarizer-{rid}-f", role="summarizer")


def plan_router(d: Draws, t_arr: float, duration: float) -> tuple:
    """The branch (code's share grows from 50% to 95% over the first 40% of ``duration``), then the times."""
    p_code = 0.5 + 0.45 * min(t_arr / (0.4 * duration), 1.0)
    branch = "code" if d.chance(p_code) else "chat"
    return branch, d.seconds("router"), d.seconds(branch)


def load_router(wf: Workflow, plan: tuple) -> dict[str, float]:
    branch, route_s, branch_s = plan
    return {"router": route_s, "chat": 0.0, "code": 0.0} | {branch: branch_s}


async def router(r: Request, plan: tuple) -> None:
    """A classifier routes to ``chat`` or ``code``."""
    branch, route_s, branch_s = plan
    with kvs.session(f"router-{r.rid}"):
        label = r.submit(classify, route_s, key=f"router-{r.rid}", role="router")
        await r.submit(work, branch_s, label, key=f"{branch}-{r.rid}", role=branch)


def heavy_role(wf: Workflow, t_arr: float) -> str:
    """The role a ``phases`` request arriving (as scheduled) at ``t_arr`` loads: it flips every phase.

    >>> wf = WORKFLOWS["phases"]
    >>> heavy_role(wf, 3.0), heavy_role(wf, 13.0), heavy_role(wf, 21.0)
    ('developer', 'tester', 'developer')
    """
    return ("developer", "tester")[int(t_arr // wf.phase_seconds) % 2]


def plan_phases(d: Draws, t_arr: float, duration: float) -> tuple:
    dev_heavy = heavy_role(d.wf, t_arr) == "developer"
    return d.seconds("heavy" if dev_heavy else "light"), d.seconds("light" if dev_heavy else "heavy")


def load_phases(wf: Workflow, plan: tuple) -> dict[str, float]:
    return {"developer": plan[0], "tester": plan[1]}


async def phases(r: Request, plan: tuple) -> None:
    """A developer call, then a tester call on its result."""
    dev_s, test_s = plan
    with kvs.session(f"phases-{r.rid}"):
        dev = r.submit(work, dev_s, key=f"developer-{r.rid}", role="developer")
        await r.submit(work, test_s, dev, key=f"tester-{r.rid}", role="tester")


@dataclass(frozen=True)
class Kind:
    """A workflow's requests: ``plan`` draws one, ``load`` sums its seconds per role, ``request`` runs it."""

    plan: Callable[[Draws, float, float], tuple]
    load: Callable[[Workflow, tuple], dict[str, float]]
    request: Callable[[Request, tuple], Coroutine[Any, Any, None]]


KINDS = {
    "swe": Kind(plan_swe, load_swe, swe),
    "analyst": Kind(plan_analyst, load_analyst, analyst),
    "router": Kind(plan_router, load_router, router),
    "phases": Kind(plan_phases, load_phases, phases),
}


def kind_of(wf: Workflow) -> Kind:
    return KINDS[wf.kind or wf.name]
