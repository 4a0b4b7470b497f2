"""Pull the missing blocks of a state from their holder, or recompute them (AAFLOW+ eq. 30).

The rule is :func:`dask_kvstate.cost.transfer_or_recompute`, priced with this
worker's own meters (the link to the holder, the model's prefill rate). The
scheduler's placement extension runs the same rule when it sends a task to a worker
for its KV, and says so in the ``kvstate-placement`` annotation; then its choice
stands. ``kvstate.placement.rule`` set to ``pull`` or ``recompute`` overrides both.
Each choice made is timed, and its outcome goes back to the extension
(:func:`record_outcome`), so a rule that guesses wrong shows in ``kvs.stats``.

A state's blocks may sit on several workers (its holder, and consumers that pulled or
rebuilt them). The pull comes from the one this worker reaches fastest by its own
measurements (:func:`sources`): the state's holder, the one the placement extension
named, and, when pulling from the holder would take long enough to be worth a scheduler
round trip, every worker the extension knows to hold them. A copy not measured yet is
priced at the seed bandwidth, so it gets a probe and a measurement of its own.
"""

from __future__ import annotations

from dask_kvstate.cost import transfer_or_recompute, transfer_seconds
from dask_kvstate.plugins.worker import scheduler_link
from dask_kvstate.plugins.worker.engine import KVEngine
from dask_kvstate.state import KVStateRef


def rule(kv: KVEngine, ref: KVStateRef, first: int, holder: str) -> dict:
    """The rule with this worker's measurements, for ``ref`` missing blocks ``first...``."""
    missing_tokens = ref.num_tokens - first * ref.block_tokens
    missing_bytes = missing_tokens * kv.backend.kv_bytes_per_token
    per_token, per_pair = kv.prefill_meter.coefficients()
    action, tt, tr = transfer_or_recompute(
        missing_bytes,
        missing_tokens,
        first * ref.block_tokens,
        bandwidth=kv.links.bandwidth(holder),
        latency=kv.links.latency_to(holder),
        per_token_s=per_token,
        per_pair_s=per_pair,
    )
    return {
        "action": action,
        "t_transfer": tt,
        "t_recompute": tr,
        "by": "worker",
        "missing_bytes": missing_bytes,
        "missing_tokens": missing_tokens,
    }


#: ask the scheduler for other copies when the pull from the named holder is estimated to
#: take at least this many scheduler round trips
ASK_ROUND_TRIPS = 10


def pull_seconds(kv: KVEngine, ref: KVStateRef, first: int, peer: str) -> float:
    """The estimated time to pull blocks ``first...`` of ``ref`` from ``peer``."""
    nbytes = (ref.num_tokens - first * ref.block_tokens) * kv.backend.kv_bytes_per_token
    return transfer_seconds(nbytes, kv.links.bandwidth(peer), kv.links.latency_to(peer))


def sources(kv: KVEngine, ref: KVStateRef, first: int, holder: str, named: str | None = None) -> list[str]:
    """Workers to pull blocks ``first...`` of ``ref`` from, fastest (estimated) first.

    ``holder`` (the state's own) and ``named`` (the placement extension's pick), and the
    other copies the extension knows of when the pull from ``holder`` is estimated to take
    :data:`ASK_ROUND_TRIPS` scheduler round trips (Dask's ``worker.latency``) or more.
    """
    found = [holder] + ([named] if named and named not in (holder, kv.address) else [])
    rtt = max(getattr(kv.worker, "latency", 0.0) or 0.0, 1e-3)
    if kv.links.measured(holder) and pull_seconds(kv, ref, first, holder) >= ASK_ROUND_TRIPS * rtt:
        wanted = list(ref.blocks[first:])
        found += [w for w in scheduler_link.holders(kv.worker, wanted, kv.settings.connect_timeout) if w not in found]
    found = [w for w in found if w != kv.address]
    return sorted(found, key=lambda w: pull_seconds(kv, ref, first, w))  # stable: the holder first on ties


def choose(kv: KVEngine, ref: KVStateRef, first: int, holder: str) -> dict:
    """``"pull"`` or ``"recompute"`` for blocks ``first...`` of ``ref``, held by ``holder``.

    The placement extension decides when it sent the running task here for its KV;
    otherwise (stolen, loose fallback, extension off) this worker decides with its own
    measurements, same rule. The decision names its task, the copy to pull from
    (``holder``, of :func:`sources`) and the other copies (``holders``), for the outcome.
    A rule forced by config pulls from the state's own holder.
    """
    key = kv.task_owner()[1]
    ann = scheduler_link.placement_choice(kv.worker, key)
    ours = ann.get("worker") == kv.address
    found = (
        [holder] if kv.settings.rule != "auto" else sources(kv, ref, first, holder, ann.get("holder") if ours else None)
    )
    d = rule(kv, ref, first, found[0])
    if ours and ann.get("action") in ("pull", "recompute"):
        d.update(action=ann["action"], t_transfer=ann["t_transfer"], t_recompute=ann["t_recompute"], by="scheduler")
    if kv.settings.rule in ("pull", "recompute"):
        d.update(action=kv.settings.rule, by="config")
    kv.counters[f"chose_{d['action']}"] += 1
    return {**d, "key": key, "holder": found[0], "holders": found}


def record_outcome(kv: KVEngine, d: dict) -> None:
    """Count a decision that was slower than the other option's estimate, and tell the scheduler."""
    other = d["t_recompute"] if d["action"] == "pull" else d["t_transfer"]
    if d["seconds"] > other:
        kv.counters["slower_choice"] += 1
    scheduler_link.send_outcome(kv.worker, d)


def estimate(kv: KVEngine, ref: KVStateRef) -> dict:
    """What the rule would do for ``ref`` on this worker now, without doing it."""
    first = next((i for i, h in enumerate(ref.blocks) if h not in kv.store), None)
    if first is None or ref.placement.worker in (None, kv.address):
        return {"action": "local", "t_transfer": 0.0, "t_recompute": 0.0}
    return rule(kv, ref, first, ref.placement.worker)
