"""The ``placement`` scheduler extension: KV locality and the transfer-versus-recompute rule.

Workers tell the scheduler, over their existing batched streams (no polling):

* ``kvstate-ref``: a key they computed holds a state (its block hashes, tokens, holder);
* ``kvstate-blocks``: which blocks they gained and lost since the last report;
* ``kvstate-metrics``: their measured prefill cost coefficients per model and KV pull
  bandwidth per peer;
* ``kvstate-outcome``: how long the chosen pull or recompute really took.

When a state's key reaches memory, each waiting task that consumes it gets the worker
that minimises its expected start time::

    occupancy(w) + min(T_transfer(missing bytes at w), T_recompute(missing tokens at w))

through Dask's own mechanism: a loose worker restriction (Dask falls back to any worker
if that one is gone, and its stealing respects restrictions), plus a
``kvstate-placement`` annotation carrying the decision to the worker, which pulls or
recomputes accordingly and falls back to recompute if the pull fails. Tasks the user
restricted are left alone. Every decision and outcome goes to
``scheduler.log_event("kvstate-placement", ...)``.

A ref report may carry the task's result itself, when small: the extension hands a copy
to the worker of each task that needs it, ahead of the task, so no consumer dials a
holder for a ref (:mod:`~dask_kvstate.plugins.scheduler.ref_relay`).
"""

from __future__ import annotations

import functools
import logging
import traceback
from collections import Counter, defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING

from distributed.diagnostics.plugin import SchedulerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler

from dask_kvstate import config
from dask_kvstate.placement import Assignment, Decision, Estimate, Link, price
from dask_kvstate.plugins.scheduler.handshake import serve_hello
from dask_kvstate.plugins.scheduler.liveness import heard_from
from dask_kvstate.plugins.scheduler.ref_relay import RefRelay
from dask_kvstate.protocol import (
    BLOCKS,
    ERROR_TOPIC,
    HOLDERS,
    IDLE_THREADS,
    METRICS,
    OUTCOME,
    PLACEMENT_ANNOTATION,
    PLACEMENT_EXTENSION,
    PLACEMENT_TOPIC,
    REF,
)

logger = logging.getLogger("dask_kvstate")


def _guarded(what: str):
    """Run an extension hook so that its failure costs a decision, not the cluster.

    Unguarded, an exception in a stream handler closes that worker's stream (the
    scheduler then removes the worker), and one in ``transition`` is logged by
    distributed at INFO only. Here it is logged as an error, counted (``errors``) and
    sent to ``log_event("kvstate-error")``; tasks keep the restrictions already given,
    and workers decide pull or recompute with their own measurements.
    """

    def decorate(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception as e:
                self.counters["errors"] += 1
                logger.exception("kvstate placement: %s failed; keeping the last decisions", what)
                if self.scheduler is not None:
                    self.scheduler.log_event(
                        ERROR_TOPIC,
                        {
                            "where": what,
                            "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc(limit=5),
                        },
                    )

        return run

    return decorate


class KVPlacement(SchedulerPlugin):
    """Scheduler side of KV-aware placement (installed by ``kvs.install``)."""

    scheduler: Scheduler  # set by start()

    name = PLACEMENT_EXTENSION
    idempotent = True

    def __init__(self):
        self.refs: dict = {}  # key -> state summary
        self.blocks_on: dict[str, set[bytes]] = {}  # worker -> block hashes it holds
        self.metrics: dict[str, dict] = {}  # worker -> {"prefill": {model: (a, b)}, "bandwidth": {...}, ...}
        self.counters: Counter[str] = Counter()
        self.relay = RefRelay()
        self.connect_timeout = config.get_seconds("transport.connect-timeout")  # a silent worker's limit

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        serve_hello(scheduler)
        scheduler.handlers[IDLE_THREADS] = self._idle_threads
        scheduler.handlers[HOLDERS] = self._holders
        scheduler.stream_handlers.update(
            {REF: self._on_ref, BLOCKS: self._on_blocks, METRICS: self._on_metrics, OUTCOME: self._on_outcome}
        )

    def kvstate_hello(self, worker: str | None, plugin: str | None) -> bool:
        """Present: the worker plugin may report refs, blocks, metrics and outcomes."""
        self.relay.kvstate_hello(worker, plugin)
        return True

    def _idle_threads(self, comm=None, worker=None) -> int:
        """What a long prefill on ``worker`` may borrow: the threads of the other workers on
        its host with no task, and the host's cores no worker's threads claim (one worker
        of one thread on a 2-core host leaves a core that nothing of Dask's would use; the
        cores are the workers' own count, sent with their measurements)."""
        ws = self.scheduler.workers.get(worker)
        if ws is None:
            return 0
        host = [o for o in self.scheduler.workers.values() if o.host == ws.host]
        idle = sum(max(0, o.nthreads - len(o.processing)) for o in host if o is not ws)
        cores = max((self.metrics.get(o.address, {}).get("cores") or 0 for o in host), default=0)
        return idle + max(0, cores - sum(o.nthreads for o in host))

    def _holders(self, comm=None, blocks=(), worker=None) -> list[str]:
        """Running workers but ``worker`` holding every one of ``blocks`` (by their block reports)."""
        running = {ws.address for ws in self.scheduler.running}
        return sorted(
            w for w, have in self.blocks_on.items() if w in running and w != worker and all(h in have for h in blocks)
        )

    # -- reports from workers ------------------------------------------------------
    @_guarded("a ref report")
    def _on_ref(self, worker=None, key=None, refs=(), copy=None, **_) -> None:
        if not refs:
            return
        ts = self.scheduler.tasks.get(key)
        if ts is None or ts.state not in ("processing", "memory"):
            # Late: the key was released or forgotten before its report arrived, so no
            # transition would ever drop an entry made now.
            self.counters["late_refs"] += 1
            return
        self.refs[key] = refs[0]
        if copy is not None:
            self.relay.keep(key, copy)
        # The holder has these blocks now; its periodic block report may come later. Only
        # the holder's own word: a fork elsewhere names a holder that may have dropped them,
        # or died, since, and only the holder's block reports would ever take them out.
        if refs[0]["holder"] == worker:
            self.blocks_on.setdefault(worker, set()).update(refs[0]["blocks"])
        if ts.state == "memory":  # the report lost the race with task-finished
            self._place_dependents(key)

    @_guarded("a block report")
    def _on_blocks(self, worker=None, added=(), removed=(), reset=False, **_) -> None:
        held = self.blocks_on.setdefault(worker, set())
        if reset:
            held.clear()
        held.update(added)
        held.difference_update(removed)

    @_guarded("a metrics report")
    def _on_metrics(
        self,
        worker=None,
        prefill=None,
        bandwidth=None,
        seed_bandwidth=None,
        latency=None,
        latencies=None,
        cores=None,
        **_,
    ) -> None:
        m = self.metrics.setdefault(worker, {})
        m.update(
            {
                "prefill": prefill or {},
                "bandwidth": bandwidth or {},
                "seed_bandwidth": seed_bandwidth,
                "latency": latency,
                "latencies": latencies or {},
                "cores": cores if isinstance(cores, int) and cores > 0 else None,
            }
        )

    @_guarded("an outcome report")
    def _on_outcome(self, worker=None, **outcome) -> None:
        outcome.pop("op", None)
        d = Decision.from_wire(outcome)
        self.counters["outcomes"] += 1
        self.counters["slower_choice"] += d.slower
        self.scheduler.log_event(PLACEMENT_TOPIC, {"kind": "outcome", "worker": worker, "slower": d.slower, **d.wire()})

    # -- Dask hooks ----------------------------------------------------------------
    def transition(self, key, start, finish, *args, **kwargs) -> None:
        # Dask calls every scheduler plugin for every transition of every task; only keys
        # whose value holds a state matter here, so the rest cost one dict lookup, not the
        # guard's wrapper and try.
        if key in self.refs:
            self._transition(key, start, finish)
        if finish == "processing" and self.relay.copies:
            self._hand_over(key)

    @_guarded("a ref copy")
    def _hand_over(self, key) -> None:
        ts = self.scheduler.tasks.get(key)
        if ts is not None:
            self.relay.hand_over(self.scheduler, ts)

    @_guarded("a transition")
    def _transition(self, key, start, finish) -> None:
        if finish == "memory":
            self._place_dependents(key)
        elif finish != "processing":  # released, forgotten, erred: the value the entry describes is gone
            self.refs.pop(key, None)
            self.relay.forget(key)

    @_guarded("remove_worker")
    def remove_worker(self, scheduler, worker, **kwargs) -> None:
        self.blocks_on.pop(worker, None)
        self.metrics.pop(worker, None)
        self.relay.remove_worker(worker)

    # -- the decision --------------------------------------------------------------
    def _place_dependents(self, key) -> None:
        ts = self.scheduler.tasks.get(key)
        ref = self.refs.get(key)
        if ts is None or ref is None:
            return
        # Work placed in this pass, per worker (seconds per thread): Dask adds it to a
        # worker's occupancy only once the task is dispatched, so without it every sibling
        # of a state would pick the same idle holder and wait there for stealing to move
        # it (measured: the second of two batched resumes on SmolLM2 started 2.6 s late).
        planned: dict[str, float] = defaultdict(float)
        cap = config.get("placement.max-copies")
        held = self.holders(ref)  # the workers holding every block now: what is priced and told
        # Workers with a copy of the state; grows as this pass places consumers away from them.
        copies = set(held)
        for dts in ts.dependents:
            if dts.state not in ("waiting", "no-worker", "released"):
                continue
            if dts.worker_restrictions or dts.host_restrictions or dts.resource_restrictions:
                # The user's restriction wins; the worker still learns the copies with the task.
                told = Assignment(worker=None, copies=tuple(sorted(held)))
                dts.annotations = {**(dts.annotations or {}), PLACEMENT_ANNOTATION: told.wire()}
                continue
            capped = cap is not None and len(copies) >= cap
            best = self.choose(ref, planned, among=copies if capped else None, copies=held)
            if best is None or best.worker is None:
                continue
            worker: str = best.worker
            best = replace(
                best,
                capped=capped,
                copies=tuple(sorted(held)),
                idle_threads=self._idle_threads(worker=worker),
            )
            if cap is not None:
                copies.add(worker)
            if dts.prefix.duration_average > 0 or dts.prefix.max_exec_time > 0:
                # Only a measured (or configured) duration: Dask's 0.5 s guess for an unseen
                # prefix would spread trivial tasks (a fork's getitem) for nothing.
                ws = self.scheduler.workers[worker]
                planned[ws.address] += self.scheduler._get_prefix_duration(dts.prefix) / max(ws.nthreads, 1)
            dts.worker_restrictions = {worker}
            dts.loose_restrictions = True
            dts.annotations = {**(dts.annotations or {}), PLACEMENT_ANNOTATION: best.wire()}
            self.counters["decisions"] += 1
            self.counters[f"chose_{best.action}"] += 1
            self.scheduler.log_event(PLACEMENT_TOPIC, {"kind": "decision", "key": str(dts.key), **best.wire()})

    def estimate(self, ref: dict, worker: str, copies: set[str] | None = None) -> Assignment | None:
        """Both options for serving ``ref`` on ``worker``, pulling from the copy (of
        ``copies``, default :meth:`holders`) it reaches fastest; None without its measurements yet."""
        m = self.metrics.get(worker)
        coeffs = None if m is None else m.get("prefill", {}).get(ref["model"])
        if m is None or coeffs is None:
            return None
        held = self.blocks_on.get(worker, set())
        blocks = ref["blocks"]
        first = next((i for i, h in enumerate(blocks) if h not in held), len(blocks))

        def link(holder: str) -> Link:  # what ``worker`` measured of its link to ``holder``
            bw = m["bandwidth"].get(holder) or m.get("seed_bandwidth") or 1e8
            return Link(bw, m.get("latencies", {}).get(holder) or m.get("latency") or 1e-3)

        def priced(holder: str) -> Estimate:
            return price(ref["num_tokens"], first, ref["block_tokens"], ref["bytes_per_token"], link(holder), coeffs)

        # the pull comes from the copy ``worker`` reaches fastest by its own measurements
        # (on a tie, the state's own holder)
        copies = self.holders(ref) if copies is None else copies
        sources = sorted(copies - {worker}, key=lambda h: (h != ref["holder"], h)) or [ref["holder"]]
        holder = min(sources, key=lambda h: priced(h).t_transfer)
        e = priced(holder)
        return Assignment(worker, e.action, holder, e.t_transfer, e.t_recompute, e.missing_tokens)

    def holders(self, ref: dict) -> set[str]:
        """Running workers that hold every block of ``ref`` (its holder at least, while it runs)."""
        blocks = ref["blocks"]
        running = {ws.address for ws in self.scheduler.running}
        held = {w for w, have in self.blocks_on.items() if w in running and all(h in have for h in blocks)}
        return held | ({ref["holder"]} & running)

    def choose(
        self,
        ref: dict,
        planned: dict[str, float] | None = None,
        among: set[str] | None = None,
        copies: set[str] | None = None,
    ) -> Assignment | None:
        """The running worker, heard from lately, with the earliest expected start for a consumer of ``ref``.

        ``planned``: seconds per thread already promised to each worker but not yet in
        its occupancy (earlier consumers placed in the same pass). ``among``: only these
        workers (the state's copies, when ``placement.max-copies`` is reached).
        ``copies``: the state's copies (default: :meth:`holders`).
        """
        planned = planned if planned is not None else {}
        best = None
        copies = self.holders(ref) if copies is None else copies
        s = self.scheduler
        # never a worker silent for long: one cut off looks idle, and holds the KV (liveness.py)
        for ws in heard_from(s.running, len(s.workers), self.connect_timeout):
            if among is not None and ws.address not in among:
                continue
            est = self.estimate(ref, ws.address, copies)
            if est is None:
                continue
            wait = ws.occupancy / max(ws.nthreads, 1) + planned.get(ws.address, 0.0)
            start = wait + min(est.t_transfer, est.t_recompute)
            if best is None or start < best.expected_start:
                best = replace(est, expected_start=start, occupancy=wait)
        if best is not None and best.action == "local":
            best = replace(best, action="pull")  # nothing missing there: the worker finds every block local
        return best

    def stats(self) -> dict:
        return {**dict(self.counters), **self.relay.stats(), "refs": len(self.refs), "workers": len(self.metrics)}
