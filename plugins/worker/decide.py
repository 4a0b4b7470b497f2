"""Pull the missing blocks of a state from their holder, or recompute them (AAFLOW+ eq. 30).

The rule is :func:`dask_kvstate.cost.transfer_or_recompute`, priced with this
worker's own meters (the link to the holder, the model's prefill rate). The
scheduler's placement extension runs the same rule when it sends a task to a worker
for its KV, and says so in the ``kvstate-placement`` annotation; then its choice
stands. ``kvstate.placement.rule`` set to ``pull`` or ``recompute`` overrides both.
Each choice made is timed, and its outcome goes back to the extension
(:func:`record_outcome`), so a rule that guesses wrong shows in ``kvs.stats``.
"""

from __future__ import annotations

from dask_kvstate.cost import transfer_or_recompute
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
        latency=kv.links.latency,
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


def choose(kv: KVEngine, ref: KVStateRef, first: int, holder: str) -> dict:
    """``"pull"`` or ``"recompute"`` for blocks ``first...`` of ``ref``, held by ``holder``.

    The placement extension decides when it sent the running task here for its KV;
    otherwise (stolen, loose fallback, extension off) this worker decides with its own
    measurements, same rule. The decision names its task and holder, for the outcome.
    """
    key = kv.task_owner()[1]
    ann = scheduler_link.placement_choice(kv.worker, key)
    d = rule(kv, ref, first, holder)
    if ann.get("worker") == kv.address and ann.get("action") in ("pull", "recompute"):
        d.update(action=ann["action"], t_transfer=ann["t_transfer"], t_recompute=ann["t_recompute"], by="scheduler")
    if kv.settings.rule in ("pull", "recompute"):
        d.update(action=kv.settings.rule, by="config")
    kv.counters[f"chose_{d['action']}"] += 1
    return {**d, "key": key, "holder": holder}


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
