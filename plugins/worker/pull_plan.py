"""Pulling a state's missing blocks so that a wrong guess about the link costs little.

The transfer-or-recompute rule prices a pull with the link's measured bandwidth, but
before the first pull from a peer that bandwidth is only Dask's estimate (100 MB/s
by default): over a real 10 Mbit/s link the rule would commit to pulling what
recomputing rebuilds in a tenth of the time. And one probe's time mixes the link's
latency with its bandwidth: 64 KiB in 6.8 ms over 100 Mbit/s reads as 77 Mbit/s, the
same bytes over 1 Gbit/s as 0.5 Gbit/s. So a pull decided by the rule goes in steps
(:func:`next_chunk`), each priced with what the ones before measured:

1. a peer whose link is unmeasured first gets a probe of ``transport.probe-bytes`` of
   the missing blocks, with the rest asked for at once beside it: the two share the
   link, so going on costs no second round trip, and a rest the probe says not to
   pull is dropped (its comm aborted, the link free at once); a state of at most four
   probes is pulled whole, as its own probe;
2. the rest is pulled whole when it wins even at the link's floor (the fastest pull
   seen, latency counted as transfer time: a rate the link surely carries), or when a
   fit of latency and bandwidth from pulls at least a quarter of its size says so;
3. it is left to be recomputed when the fitted link says pulling it costs more, or,
   with one pull size measured (no fit yet), when it would even at twice the floor;
4. between the two, a probe four times the largest measured pull, then step 2 again:
   two sizes make the fit of latency and bandwidth (``LinkMeter``).

Every step is given its estimate plus ``transport.patience`` times the estimated
recompute time; a step still running then is cut off, its blocks recomputed, and the
reply, which finishes in the background, is timed for the next decision. So a pull the
rule got wrong costs at most its probes plus the patience on top of the recompute it
should have chosen. A pull forced by ``placement.rule: pull`` is one request with no
cut-off: benchmarks time it as the pull option.
"""

from __future__ import annotations

import math
import time

from dask_kvstate.cost import transfer_seconds
from dask_kvstate.placement import Decision
from dask_kvstate.plugins.worker import placement
from dask_kvstate.plugins.worker.measure import LinkMeter

#: a state whose missing bytes are at most this many probes is pulled whole, as its own probe
SMALL_PROBES = 4
#: each probe between a fit's sizes is this many times the largest measured pull
GROWTH = 4


def next_chunk(
    links: LinkMeter,
    holder: str,
    rest_bytes: int,
    block_bytes: int,
    t_recompute: float,
    *,
    probe_bytes: int,
    patience: float,
) -> tuple[int, float] | None:
    """``(blocks, seconds)``: how many of the missing blocks to pull next and how long to
    wait for them; None when the rest is better recomputed.

    Examples
    --------
    A peer not measured yet gets a probe; a link that carried 64 KiB in 53 ms (10 Mbit/s)
    is left for a 0.4 s recompute of 2.8 MB; one that carried it in 7 ms gets the rest:

    >>> links = LinkMeter(seed_bandwidth=1e8)
    >>> kw = dict(probe_bytes=65536, patience=0.25)
    >>> blocks, wait = next_chunk(links, "a", 2_800_000, 8192, 0.4, **kw)
    >>> blocks, round(wait, 3)
    (8, 0.102)
    >>> links.add("a", 65536, 0.053)
    >>> next_chunk(links, "a", 2_734_464, 8192, 0.4, **kw) is None
    True
    >>> links.forget("a"); links.add("a", 65536, 0.007)
    >>> next_chunk(links, "a", 2_734_464, 8192, 0.4, **kw)[0]
    334
    """
    n_rest = max(1, math.ceil(rest_bytes / max(block_bytes, 1)))
    lat, bw = links.latency_to(holder), links.bandwidth(holder)

    def pull(n_blocks: int, seconds: float) -> tuple[int, float]:
        return n_blocks, seconds + patience * t_recompute

    def blocks_of(nbytes: float) -> int:
        return min(n_rest, max(1, int(nbytes // max(block_bytes, 1))))

    if not links.measured(holder):
        if rest_bytes <= SMALL_PROBES * probe_bytes:
            return pull(n_rest, transfer_seconds(rest_bytes, bw, lat))
        n = blocks_of(probe_bytes)
        return pull(n, transfer_seconds(n * block_bytes, bw, lat))
    floor = links.floor(holder)
    if floor > 0 and rest_bytes / floor <= t_recompute:
        return pull(n_rest, rest_bytes / floor)
    if links.fitted(holder):
        estimate = transfer_seconds(rest_bytes, bw, lat)
        if estimate >= t_recompute:
            return None
        if GROWTH * links.largest(holder) >= rest_bytes:
            return pull(n_rest, estimate)
    elif rest_bytes / (2 * floor) >= t_recompute:
        # One size measured says nothing of latency: its rate is the floor at worst, and
        # its latency at most half of its time unless the link is fast, so a rest that
        # takes longer than the recompute even at twice the floor is better recomputed.
        return None
    n = blocks_of(GROWTH * max(links.largest(holder), probe_bytes))
    return pull(n, transfer_seconds(n * block_bytes, bw, lat))


def pull_missing(resolver, ref, tensors: list, holder: str, decision: Decision) -> list:
    """``tensors`` (``None`` where missing) with what could be pulled from ``holder`` filled in.

    Blocks still ``None`` after are for the caller to recompute. Where the measured link
    to ``holder`` says recompute, another copy of ``decision.holders`` whose estimate
    says pull is tried (``decision.holder`` names the copy pulled from last). Fills in
    ``decision`` the steps taken (``steps``, and ``chunks``: blocks and seconds of each,
    seconds ``None`` for one cut off or failed, ``[0, None]`` for a move to another
    copy), whether one was cut off (``cut_off``) and whether the measured link turned
    the choice to recompute (``switched``). Never raises for a slow, failing or dead holder.
    """
    kv = resolver.kv
    shapes = resolver.block_shapes(ref)

    def filled(pulled: dict, held: list) -> list:
        return [pulled.get(h, t) if t is None else t for h, t in zip(ref.blocks, held)]

    if decision.by == "config":
        missing = [h for h, t in zip(ref.blocks, tensors) if t is None]
        decision.steps = 1
        return filled(resolver.pull(holder, missing, shapes), tensors)
    per_block = ref.block_tokens * kv.backend.kv_bytes_per_token
    before = tensors
    wanted = sum(t is None for t in before)
    estimate = decision
    untried = [h for h in decision.holders if h != holder]
    chunks: list[list] = []
    ahead = None  # the rest, asked for beside a first probe
    try:
        while True:
            missing = [i for i, t in enumerate(tensors) if t is None]
            if not missing:
                break
            if chunks:
                estimate = placement.rule(kv, ref, missing[0], holder)
            plan = next_chunk(
                kv.links,
                holder,
                estimate.missing_bytes,
                per_block,
                estimate.t_recompute,
                probe_bytes=kv.settings.probe_bytes,
                patience=kv.settings.patience,
            )
            if ahead is not None and plan is not None:  # go on with the rest already on its way
                wait = transfer_seconds(estimate.missing_bytes, kv.links.bandwidth(holder), kv.links.latency_to(holder))
                wait = max(plan[1], wait + kv.settings.patience * estimate.t_recompute)
            elif ahead is not None:
                # The probe says recompute, but it shared the link and the puller's event loop
                # with the rest: over a fast link the rest lands about when the probe does, and
                # one already here costs nothing. It gets half the probe's time, at most half
                # the patience.
                wait = min(chunks[-1][1] or 0.0, kv.settings.patience * estimate.t_recompute) / 2
            if ahead is not None:
                t0 = time.perf_counter()
                pulled = resolver.take(holder, ahead, shapes, wait)
                n, ahead = len(ahead.hashes), None
                if not pulled and plan is None:  # not here in time: recompute, as the probe said
                    decision.switched = True
                    break
            else:
                if plan is None:  # the measured link says recompute: unless another copy is worth a try
                    untried.sort(key=lambda h: placement.pull_seconds(kv, ref, missing[0], h))
                    other = untried.pop(0) if untried else None
                    if other is not None and placement.rule(kv, ref, missing[0], other).action == "pull":
                        holder = decision.holder = other
                        chunks.append([0, None])  # a step that moved to another copy
                        continue
                    decision.switched = True
                    break
                chunk = [ref.blocks[i] for i in missing[: plan[0]]]
                rest = [ref.blocks[i] for i in missing[plan[0] :]]
                n, t0 = len(chunk), time.perf_counter()
                if rest and not kv.links.measured(holder):
                    # first contact: the rest is asked for at once beside the probe, so going
                    # on costs no second round trip, and is dropped if the probe says recompute
                    pulled, ahead = resolver.pull_beside(holder, chunk, rest, shapes, plan[1])
                else:
                    pulled = resolver.pull(holder, chunk, shapes, patience=plan[1])
            chunks.append([n, time.perf_counter() - t0 if pulled else None])
            if not pulled:  # cut off, failed or the holder lost them: the caller recomputes
                decision.cut_off = True
                break
            tensors = filled(pulled, tensors)
            if len(pulled) < n:
                break
    finally:
        if ahead is not None:
            resolver.drop(ahead)
    decision.steps, decision.chunks = len(chunks), chunks
    pulled_n = wanted - sum(t is None for t in tensors)
    if (decision.switched or decision.cut_off) and pulled_n * 2 < wanted:
        # Given up after little more than the probe: recompute all of it from the blocks held
        # before, not on top of the probe's few. A prefill on top of a short cached prefix
        # costs more than one from that prefix's start (measured with tiny-llama on CPU: 5,500
        # tokens on top of 128 pulled took 1.5 s, from scratch 0.36 s), and its time would
        # skew the prefill meter the rule prices recompute with.
        return before
    return tensors
