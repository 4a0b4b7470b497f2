"""The three Nalar workflows: seeded profiles, and each request as ordinary Python over futures.

A request is one coroutine inside ``kvs.session``, submitting components as tasks that
ask for their agent role (``resources={"role:developer": 1}``). Every random number a
request needs comes from :class:`Draws`, seeded by (run seed, request id) and drawn in
a fixed order, so every configuration replays the very same durations and outcomes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
from distributed import Client

import dask_kvstate as kvs
from dask_kvstate.bench.nalar.components import classify, develop, run_tests, work


@dataclass
class Workflow:
    name: str
    roles: dict[str, int]  # role -> worker units at start (even split)
    rate: float  # requests per second
    components: dict = field(default_factory=dict)  # component -> (median seconds, sigma)
    hints: dict = field(default_factory=dict)
    stateful: dict = field(default_factory=dict)  # hints applied only with --stateful
    nalar_hints: dict = field(default_factory=dict)  # component hints of the "+hints" configs


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
}


def configure(
    name: str,
    *,
    rate: float | None = None,
    stateful: bool = False,
    roles: str | None = None,
    median: str | None = None,
) -> Workflow:
    """``WORKFLOWS[name]`` with the command line's overrides applied to it.

    ``roles`` gives units per role at start (``planner=1,developer=7,tester=4``, every
    role of the workflow), ``median`` median seconds per component call
    (``router=0.06``); a role set that differs, or an unknown component, raises ValueError.
    """
    wf = WORKFLOWS[name]
    if rate:
        wf.rate = rate
    if stateful:
        wf.hints = {**wf.hints, **wf.stateful}
    if roles:
        units = {k: int(v) for k, v in (kv.split("=") for kv in roles.split(","))}
        if set(units) != set(wf.roles):
            raise ValueError(f"--roles must give every role of {name}: {sorted(wf.roles)}, got {sorted(units)}")
        wf.roles = units
    if median:
        for comp, sec in (kv.split("=") for kv in median.split(",")):
            if comp not in wf.components:
                raise ValueError(f"--median: {name} has no component {comp!r}; it has {sorted(wf.components)}")
            wf.components[comp] = (float(sec), wf.components[comp][1])
    return wf


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


async def swe(c: Client, rid: int, d: Draws, t_arr: float) -> None:
    """Planner -> 3 developer lanes -> a tester each; a failed test goes back to the lane (4 attempts)."""
    rebuild = 0.5 * d.wf.components["developer"][0]
    plan_s = d.seconds("planner")
    # Every lane's attempts are drawn up front, in order: the draws never depend on timing.
    lanes = [
        [(d.seconds("developer"), d.chance(0.65) or a == 3, d.seconds("tester")) for a in range(4)] for _ in range(3)
    ]
    with kvs.session(f"swe-{rid}"):
        plan = c.submit(work, plan_s, key=f"planner-{rid}", resources=role("planner"))

        async def lane(k: int) -> None:
            previous = None  # the last attempt's future: its context is the next attempt's input
            for attempt, (dev_s, passed, test_s) in enumerate(lanes[k]):
                dev = c.submit(
                    develop,
                    dev_s,
                    rebuild,
                    previous,
                    plan,
                    key=f"developer-{rid}-{k}-{attempt}",
                    resources=role("developer"),
                )
                ok = c.submit(
                    run_tests, test_s, passed, dev, key=f"tester-{rid}-{k}-{attempt}", resources=role("tester")
                )
                if await ok:
                    return
                previous = dev

        await asyncio.gather(*(lane(k) for k in range(3)))


async def analyst(c: Client, rid: int, d: Draws, t_arr: float) -> None:
    """4 analysts -> a summary; half the requests come back after a think time with a follow-up."""
    with kvs.session(f"analyst-{rid}"):
        views = [
            c.submit(work, d.seconds("analyst"), key=f"analyst-{rid}-{i}", resources=role("analyst")) for i in range(4)
        ]
        await c.submit(work, d.seconds("summarizer"), *views, key=f"summarizer-{rid}", resources=role("summarizer"))
        if d.chance(0.5):
            think = d.seconds("summarizer") * 8
            await asyncio.sleep(think)
            more = [
                c.submit(work, d.seconds("analyst"), key=f"analyst-{rid}-f{i}", resources=role("analyst"))
                for i in range(2)
            ]
            await c.submit(
                work, d.seconds("summarizer"), *more, key=f"summarizer-{rid}-f", resources=role("summarizer")
            )


async def router(c: Client, rid: int, d: Draws, t_arr: float, *, shift_until: float) -> None:
    """A classifier routes to ``chat`` or ``code``; code's share grows from 50% to 95% until ``shift_until``."""
    with kvs.session(f"router-{rid}"):
        p_code = 0.5 + 0.45 * min(t_arr / shift_until, 1.0)
        branch = "code" if d.chance(p_code) else "chat"
        label = c.submit(classify, d.seconds("router"), key=f"router-{rid}", resources=role("router"))
        await c.submit(work, d.seconds(branch), label, key=f"{branch}-{rid}", resources=role(branch))
