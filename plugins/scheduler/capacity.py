"""The ``capacity`` scheduler extension: capacity reallocation between agent roles (Nalar Algorithm 2).

Agent roles are Dask worker resources named ``role:<name>`` (the prefix is
``kvstate.scheduling.capacity.resource-prefix``); a task asks for one with
``resources={"role:tester": 1}``, a worker offers units of it (``--resources
role:tester=1``). Every capacity interval, off the critical path (on the global
control loop), for each role ``v``:

* ``mu_v = R_v * mu_bar_v``: units ``R_v`` times the measured per-unit service rate
  (completions over busy unit-seconds, from the compute start/stop times workers send
  with every finished task), over a sliding window of intervals;
* ``p_v``: visits per workflow request (role invocations per distinct session that
  submitted work in the window);
* ``x_v = mu_v / max(p_v, delta)``, the workflow throughput the role can sustain.

The role with the smallest ``x_v`` is the candidate bottleneck. Only when it stays the
bottleneck for ``K`` consecutive intervals and has ready work (tasks waiting behind
busy units, or ``no-worker``) does one unit move to it from an idle role above its
minimum, choosing the donor that maximises the predicted throughput ``min_v x_v`` and
only if that beats the current one by ``epsilon`` (the donor must not become the
new bottleneck). :func:`best_move` is that decision as a pure function.

Moving a unit: the scheduler stops counting the donor unit first (no new donor work is
sent to that worker; only a worker with no donor task on it is picked), the worker's
``kvstate-scheduling`` plugin updates its own resources, then the scheduler adds the
bottleneck unit and dispatches ``no-worker`` tasks that fit it. Work already queued
on the bottleneck's other workers reaches the new unit by stealing.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, defaultdict, deque
from time import perf_counter, time

from distributed.diagnostics.plugin import SchedulerPlugin

from dask_kvstate import config
from dask_kvstate.protocol import CAPACITY_EXTENSION, CAPACITY_TOPIC, HINTS_EXTENSION, SESSIONS_EXTENSION, SET_RESOURCES

logger = logging.getLogger("dask_kvstate")

WINDOW = 20  # capacity intervals of history behind mu and p
DELTA = 1e-3  # numerical floor on visits per request


def normalized_capacity(units: float, per_unit_rate: float, visits: float, delta: float = DELTA) -> float:
    """``x_v = R_v * mu_bar_v / max(p_v, delta)``: requests per second role ``v`` can carry.

    Examples
    --------
    >>> normalized_capacity(units=2, per_unit_rate=5.0, visits=4.0)   # 10 calls/s, 4 per request
    2.5
    """
    return units * per_unit_rate / max(visits, delta)


def best_move(
    x: dict, units: dict, rates: dict, visits: dict, bottleneck: str, donors, *, limits: dict, epsilon: float
) -> tuple[str, float] | None:
    """The donor whose unit, given to ``bottleneck``, raises ``min_v x_v`` the most.

    Returns ``(donor, predicted throughput)`` or None when no donor is feasible (above its
    minimum, bottleneck below its maximum, not the bottleneck after the move) or no move
    gains more than ``epsilon`` (relative).

    Examples
    --------
    >>> x = {"dev": 1.0, "test": 4.0, "plan": 8.0}
    >>> units, rates, visits = {"dev": 2, "test": 4, "plan": 2}, {"dev": 1.0, "test": 2.0, "plan": 4.0}, \
        {"dev": 2.0, "test": 2.0, "plan": 1.0}
    >>> best_move(x, units, rates, visits, "dev", ["test", "plan"], limits={}, epsilon=0.05)
    ('test', 1.5)
    >>> best_move(x, units, rates, visits, "dev", ["test"], limits={"test": {"min": 4}}, epsilon=0.05) is None
    True
    """
    lim_b = limits.get(bottleneck) or {}
    if lim_b.get("max") is not None and units[bottleneck] + 1 > lim_b["max"]:
        return None
    current = min(x.values())
    best = None
    for d in donors:
        if d == bottleneck or units[d] - 1 < (limits.get(d) or {}).get("min", 1):
            continue
        trial = dict(x)
        trial[bottleneck] = normalized_capacity(units[bottleneck] + 1, rates[bottleneck], visits[bottleneck])
        # A donor never measured (no calls in the window) has nothing to lose.
        trial[d] = normalized_capacity(units[d] - 1, rates[d], visits[d]) if rates.get(d) else math.inf
        predicted = min(trial.values())
        if trial[d] <= trial[bottleneck]:
            continue  # the donor would become the new bottleneck: the next interval would move it back
        if predicted > current * (1 + epsilon) and (best is None or predicted > best[1]):
            best = (d, predicted)
    return best


class CapacityController(SchedulerPlugin):
    """Scheduler side of capacity reallocation (installed by ``kvs.install`` when enabled)."""

    name = CAPACITY_EXTENSION
    idempotent = True

    def __init__(
        self,
        interval=None,
        persistence: int | None = None,
        epsilon: float | None = None,
        prefix: str | None = None,
        limits: dict | None = None,
    ):
        self.interval_s = config.get_seconds("scheduling.capacity.interval", interval)
        self.k = int(config.get("scheduling.capacity.persistence") if persistence is None else persistence)
        self.epsilon = float(config.get("scheduling.capacity.epsilon") if epsilon is None else epsilon)
        self.prefix = config.get("scheduling.capacity.resource-prefix") if prefix is None else prefix
        self.limits = dict(config.get("scheduling.capacity.limits") if limits is None else limits)
        if self.k < 1 or self.epsilon < 0 or not self.prefix:
            raise ValueError(
                f"capacity settings out of range: persistence={self.k} "
                f"epsilon={self.epsilon} resource-prefix={self.prefix!r}"
            )
        for role, lim in self.limits.items():
            if not role.startswith(self.prefix):
                raise ValueError(f"capacity limit for {role!r}: roles are resources named {self.prefix}<name>")
            if lim.get("max") is not None and lim["max"] < lim.get("min", 1):
                raise ValueError(f"capacity limit for {role!r}: max {lim['max']} < min {lim.get('min', 1)}")

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.tracker = scheduler.plugins.get(SESSIONS_EXTENSION)
        assert self.tracker is not None, "the capacity extension needs the sessions extension registered first"
        self.counters: Counter[str] = Counter()
        self._done: defaultdict[str, list] = defaultdict(lambda: [0, 0.0])  # role -> [completions, busy s]
        self._visits: Counter[str] = Counter()  # role -> invocations submitted this interval
        self._sessions: set[str] = set()
        self.role_of: dict = {}  # key -> its role, for tasks the scheduler holds
        self.history: deque = deque(maxlen=WINDOW)  # (done, visits, sessions) per interval
        self.bottleneck: str | None = None
        self.streak = 0
        self.moving = False
        self._moves: set[asyncio.Future] = set()
        self.moves: deque = deque(maxlen=100)
        self.last: dict = {}
        self.latency: deque = deque(maxlen=1000)
        every = max(1, round(self.interval_s / self.tracker.loop.interval_s))
        self.tracker.loop.add("capacity", self.control, every=every)

    # -- telemetry -------------------------------------------------------------------
    def _roles(self, ts) -> list[str]:
        return [r for r in (ts.resource_restrictions or ()) if r.startswith(self.prefix)]

    def update_graph(self, scheduler, *, tasks=(), **kwargs) -> None:
        for key in tasks:
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state != "released" or not ts.resource_restrictions:
                continue
            roles = self._roles(ts)
            if not roles:
                continue
            # One role per task is what the controller counts (the first, if a task asks several).
            self.role_of[key] = roles[0]
            self._visits[roles[0]] += 1
            s = self.tracker.session_of(key)
            if s is not None:
                self._sessions.add(s.id)

    def transition(self, key, start, finish, *args, startstops=None, **kwargs) -> None:
        if finish == "forgotten":
            self.role_of.pop(key, None)
            return
        if start != "processing" or finish != "memory" or not startstops:
            return
        r = self.role_of.get(key)
        if r is None:
            return
        busy = sum(ss["stop"] - ss["start"] for ss in startstops if ss.get("action") == "compute")
        self._done[r][0] += 1
        self._done[r][1] += busy

    # -- the controller --------------------------------------------------------------
    def control(self) -> None:
        t0 = perf_counter()
        try:
            self._control()
        finally:
            self.latency.append(perf_counter() - t0)

    def _control(self) -> None:
        s = self.scheduler
        self.history.append((dict(self._done), dict(self._visits), set(self._sessions)))
        self._done.clear()
        self._visits.clear()
        self._sessions.clear()
        units: Counter[str] = Counter()
        ready: Counter[str] = Counter()
        role_of = self.role_of
        for ws in s.running:
            per_role: dict[str, int] = {}
            for ts in ws.processing:  # the hot loop with 10,000 queued tasks: a dict lookup each
                r = role_of.get(ts.key)
                if r is not None:
                    per_role[r] = per_role.get(r, 0) + 1
            for r, q in ws.resources.items():
                if r.startswith(self.prefix):
                    units[r] += q
                    ready[r] += max(per_role.get(r, 0) - q, 0)
            for r, n in per_role.items():
                if r not in ws.resources:
                    ready[r] += n
        # Tasks held by max-concurrency wait for a slot, not for want of units.
        held = getattr(s.plugins.get(HINTS_EXTENSION), "held_comp", {})
        for ts in s.unrunnable:
            r = role_of.get(ts.key)
            if r is not None and ts.key not in held:
                ready[r] += 1
        done: Counter[str] = Counter()
        busy: defaultdict[str, float] = defaultdict(float)
        visits: Counter[str] = Counter()
        sessions: set[str] = set()
        for d, v, ss in self.history:
            for r, (n, a) in d.items():
                done[r] += n
                busy[r] += a
            visits.update(v)
            sessions |= ss
        rates = {r: done[r] / busy[r] for r in units if busy[r] > 0}
        p = {r: visits[r] / max(len(sessions), 1) for r in units}
        x = {r: normalized_capacity(units[r], rates[r], p[r]) if r in rates else math.inf for r in units}
        measured = {r: v for r, v in x.items() if r in rates and p[r] > 0}
        self.last = {
            "units": dict(units),
            "ready": dict(ready),
            "rate": rates,
            "visits": p,
            "x": {r: (v if v != math.inf else None) for r, v in x.items()},
        }
        if not measured:
            self.bottleneck, self.streak = None, 0
            return
        b = min(measured, key=lambda r: measured[r])
        self.streak = self.streak + 1 if b == self.bottleneck else 1
        self.bottleneck = b
        self.last.update(bottleneck=b, streak=self.streak)
        if self.streak < self.k or ready[b] <= 0 or self.moving:
            return
        donors = [r for r in units if r != b and ready[r] == 0 and (r in rates or p[r] == 0)]
        full_rates = {r: rates.get(r, 0.0) for r in units}
        choice = best_move(x, dict(units), full_rates, p, b, donors, limits=self.limits, epsilon=self.epsilon)
        if choice is None:
            self.counters["no_feasible_move"] += 1
            return
        donor, predicted = choice
        ws = self._donor_worker(donor)
        if ws is None:
            self.counters["no_free_unit"] += 1
            return
        self.moving = True
        task = asyncio.ensure_future(self._move(ws, donor, b, predicted, min(x.values())))
        self._moves.add(task)  # a reference until done: the loop keeps only a weak one
        task.add_done_callback(self._moves.discard)

    def _donor_worker(self, donor: str):
        """A running worker offering a ``donor`` unit with no donor task on it (none gets stranded)."""
        for ws in sorted(self.scheduler.running, key=lambda w: w.address):
            if (
                ws.resources.get(donor, 0) >= 1
                and ws.address in self.tracker.announced
                and not any(self.role_of.get(ts.key) == donor for ts in ws.processing)
            ):
                return ws
        return None

    def _set(self, ws, role: str, quantity: float) -> None:
        ws.resources[role] = quantity
        self.scheduler.resources.setdefault(role, {})[ws.address] = quantity
        ws.used_resources.setdefault(role, 0)

    async def _move(self, ws, donor: str, to: str, predicted: float, before: float) -> None:
        s = self.scheduler
        try:
            new_d, new_b = ws.resources.get(donor, 0) - 1, ws.resources.get(to, 0) + 1
            self._set(ws, donor, new_d)  # first: no more donor work is sent there
            try:
                await getattr(s.rpc(ws.address), SET_RESOURCES)(resources={donor: new_d, to: new_b})
            except Exception as e:
                self._set(ws, donor, new_d + 1)
                self.counters["failed_moves"] += 1
                logger.warning("kvstate capacity: moving %s -> %s on %s failed: %s", donor, to, ws.address, e)
                return
            if s.workers.get(ws.address) is not ws:
                return  # the worker left meanwhile
            self._set(ws, to, new_b)
            stimulus_id = f"kvstate-capacity-{time()}"
            s.transitions(s.bulk_schedule_unrunnable_after_adding_worker(ws), stimulus_id)
            move = {
                "kind": "move",
                "worker": ws.address,
                "from": donor,
                "to": to,
                "before": before,
                "predicted": predicted,
                "time": time(),
            }
            self.moves.append(move)
            self.counters["moves"] += 1
            s.log_event(CAPACITY_TOPIC, move)
        finally:
            self.moving = False

    def stats(self) -> dict:
        from dask_kvstate.plugins.scheduler.control import latency_summary

        return {
            **dict(self.counters),
            "k": self.k,
            "last": self.last,
            "recent_moves": list(self.moves)[-20:],
            "latency": latency_summary(self.latency),
        }
