"""Pulling a state's missing blocks so that a wrong guess about the link costs little.

The transfer-or-recompute rule prices a pull with the link's measured bandwidth, but
before the first pull from a peer that bandwidth is only Dask's global estimate (100
MB/s by default): over a real 10 Mbit/s link the rule would commit to pulling what
recomputing rebuilds in a tenth of the time. So a pull decided by the rule goes in
steps, each re-priced with what the one before measured:

1. a peer whose link is unmeasured first gets a probe: the leading missing blocks, at
   most ``transport.probe-bytes`` (larger than a token bucket's burst or TCP's first
   window, so its time says something about the rate);
2. then the rule runs again with the measured link, on the blocks still missing, and
   either pulls all of them or leaves them to be recomputed;
3. every step is given its estimate plus ``transport.patience`` times the estimated
   recompute time; a step still running then is cut off, its blocks recomputed, and
   the reply, which finishes in the background, is timed for the next decision.

So a pull the rule got wrong costs at most the probe plus the patience on top of the
recompute it should have chosen; a pull given up after little more than its probe
recomputes from the blocks held before it. A pull forced by ``placement.rule: pull`` is one
request with no cut-off: benchmarks time it as the pull option.
"""

from __future__ import annotations

from dask_kvstate.cost import transfer_seconds
from dask_kvstate.plugins.worker import decide


def pull_missing(resolver, ref, tensors: list, holder: str, decision: dict) -> list:
    """``tensors`` (``None`` where missing) with what could be pulled from ``holder`` filled in.

    Blocks still ``None`` after are for the caller to recompute. Adds to ``decision``
    the steps taken (``steps``), whether one was cut off (``cut_off``) and whether the
    measured link turned the choice to recompute (``switched``). Never raises for a
    slow, failing or dead holder.
    """
    kv = resolver.kv
    shapes = resolver.block_shapes(ref)

    def filled(pulled: dict, held: list) -> list:
        return [pulled.get(h, t) if t is None else t for h, t in zip(ref.blocks, held)]

    if decision["by"] == "config":
        missing = [h for h, t in zip(ref.blocks, tensors) if t is None]
        decision["steps"] = 1
        return filled(resolver.pull(holder, missing, shapes), tensors)
    per_block = ref.block_tokens * kv.backend.kv_bytes_per_token
    before = tensors
    wanted = sum(t is None for t in before)
    estimate = decision
    steps = 0
    while True:
        missing = [i for i, t in enumerate(tensors) if t is None]
        if not missing:
            break
        if steps:
            estimate = decide.rule(kv, ref, missing[0], holder)
            if estimate["action"] != "pull":
                decision["switched"] = True
                break
        if kv.links.measured(holder):
            chunk = missing
        else:
            chunk = missing[: max(1, kv.settings.probe_bytes // max(per_block, 1))]
        expected = transfer_seconds(len(chunk) * per_block, kv.links.bandwidth(holder), kv.links.latency)
        patience = expected + kv.settings.patience * estimate["t_recompute"]
        pulled = resolver.pull(holder, [ref.blocks[i] for i in chunk], shapes, patience=patience)
        steps += 1
        if not pulled:  # cut off, failed or the holder lost them: the caller recomputes
            decision["cut_off"] = True
            break
        tensors = filled(pulled, tensors)
        if len(pulled) < len(chunk):
            break
    decision["steps"] = steps
    pulled_n = wanted - sum(t is None for t in tensors)
    if (decision.get("switched") or decision.get("cut_off")) and pulled_n * 2 < wanted:
        # Given up after little more than the probe: recompute all of it from the blocks held
        # before, not on top of the probe's few. A prefill on top of a short cached prefix
        # costs more than one from that prefix's start (measured with tiny-llama on CPU: 5,500
        # tokens on top of 128 pulled took 1.5 s, from scratch 0.36 s), and its time would
        # skew the prefill meter the rule prices recompute with.
        return before
    return tensors
