"""Worker side of placement: pull the missing blocks of a state from a copy, or recompute them.

The rule is :func:`dask_kvstate.placement.price` (AAFLOW+ eq. 30), the one the
scheduler's placement extension also prices with, here fed with this worker's own
meters (the link to each copy, the model's prefill rate). When the extension sent the
running task here for its KV, its :class:`~dask_kvstate.placement.Assignment` (the
task's ``kvstate-placement`` annotation) says so and its choice stands.
``kvstate.placement.rule`` set to ``pull`` or ``recompute`` overrides both. Each choice
made is timed, and its outcome goes back to the extension (:func:`record_outcome`), so
a rule that guesses wrong shows in ``kvs.stats``.

A state's blocks may sit on several workers (its holder, and consumers that pulled or
rebuilt them). The pull comes from the one this worker reaches fastest by its own
measurements (:func:`sources`). The annotation carries every copy the extension knew
of when it placed the task, so a placed task moves its first byte without a scheduler
round trip; only a task the extension never saw (a ref passed by value) asks it for
other copies, and only when the pull from the holder would take long enough to be
worth that round trip. A copy not measured yet is priced at the seed bandwidth, so it
gets a probe and a measurement of its own.
"""

from __future__ import annotations

from dask_kvstate.cost import transfer_seconds
from dask_kvstate.placement import Assignment, Decision, Link, price
from dask_kvstate.plugins.worker import scheduler_link
from dask_kvstate.plugins.worker.engine import KVEngine
from dask_kvstate.state import KVStateRef


def link(kv: KVEngine, peer: str) -> Link:
    return Link(kv.links.bandwidth(peer), kv.links.latency_to(peer))


def rule(kv: KVEngine, ref: KVStateRef, first: int, holder: str) -> Decision:
    """The rule with this worker's measurements, for ``ref`` missing blocks ``first...`` held by ``holder``."""
    e = price(
        ref.num_tokens,
        first,
        ref.block_tokens,
        kv.backend.kv_bytes_per_token,
        link(kv, holder),
        kv.prefill_meter.coefficients(),
    )
    return Decision(e.action, e.t_transfer, e.t_recompute, "worker", e.missing_bytes, e.missing_tokens)


#: ask the scheduler for other copies (a task it never placed) when the pull from the named
#: holder is estimated to take at least this many scheduler round trips
ASK_ROUND_TRIPS = 10


def pull_seconds(kv: KVEngine, ref: KVStateRef, first: int, peer: str) -> float:
    """The estimated time to pull blocks ``first...`` of ``ref`` from ``peer``."""
    nbytes = (ref.num_tokens - first * ref.block_tokens) * kv.backend.kv_bytes_per_token
    return transfer_seconds(nbytes, kv.links.bandwidth(peer), kv.links.latency_to(peer))


def sources(kv: KVEngine, ref: KVStateRef, first: int, holder: str, placed: Assignment | None = None) -> list[str]:
    """Workers to pull blocks ``first...`` of ``ref`` from, fastest (estimated) first.

    ``holder`` (the state's own), and the copies ``placed`` names (the extension's pick
    and every copy it knew of). Without a placement, the other copies the extension knows
    of when the pull from ``holder`` is estimated to take :data:`ASK_ROUND_TRIPS`
    scheduler round trips (Dask's ``worker.latency``) or more.
    """
    found = [holder]
    if placed is not None:
        found += [w for w in (placed.holder, *placed.copies) if w and w not in found]
    else:
        rtt = max(getattr(kv.worker, "latency", 0.0) or 0.0, 1e-3)
        if kv.links.measured(holder) and pull_seconds(kv, ref, first, holder) >= ASK_ROUND_TRIPS * rtt:
            others = scheduler_link.holders(kv.worker, list(ref.blocks[first:]), kv.settings.connect_timeout)
            found += [w for w in others if w not in found]
    found = [w for w in found if w != kv.address] or [holder]
    return sorted(found, key=lambda w: pull_seconds(kv, ref, first, w))  # stable: the holder first on ties


def choose(kv: KVEngine, ref: KVStateRef, first: int, holder: str) -> Decision:
    """``"pull"`` or ``"recompute"`` for blocks ``first...`` of ``ref``, held by ``holder``.

    The placement extension decides when it sent the running task here for its KV;
    otherwise (stolen, loose fallback, extension off) this worker decides with its own
    measurements, same rule. The decision names its task, the copy to pull from
    (``holder``, of :func:`sources`) and the other copies (``holders``), for the outcome.
    A rule forced by config pulls from the state's own holder.
    """
    key = kv.task_owner()[1]
    placed = scheduler_link.assignment(kv.worker, key)
    found = [holder] if kv.settings.rule != "auto" else sources(kv, ref, first, holder, placed)
    d = rule(kv, ref, first, found[0])
    if placed is not None and placed.worker == kv.address and placed.action in ("pull", "recompute"):
        d.action, d.t_transfer, d.t_recompute, d.by = placed.action, placed.t_transfer, placed.t_recompute, "scheduler"
    if kv.settings.rule in ("pull", "recompute"):
        d.action, d.by = kv.settings.rule, "config"
    kv.counters[f"chose_{d.action}"] += 1
    d.key, d.holder, d.holders = key, found[0], found
    return d


def record_outcome(kv: KVEngine, d: Decision) -> None:
    """Count a decision that was slower than the other option's estimate, and tell the scheduler."""
    if d.slower:
        kv.counters["slower_choice"] += 1
    scheduler_link.send_outcome(kv.worker, d.wire())


def estimate(kv: KVEngine, ref: KVStateRef) -> Decision | None:
    """What the rule would do for ``ref`` on this worker now, without doing it (None: all held here)."""
    first = next((i for i, h in enumerate(ref.blocks) if h not in kv.store), None)
    if first is None or ref.placement.worker in (None, kv.address):
        return None
    return rule(kv, ref, first, ref.placement.worker)
