"""Copies of ref-holding task results, carried by the scheduler: the scheduler side.

Why (the worker side, :mod:`dask_kvstate.plugins.worker.ref_copies`, says it at length):
a consumer must never wait on Dask's comm connect timeout (30 s by default) to fetch a
few hundred bytes of ref from a holder it cannot reach; the KV rule gives a holder
``transport.connect-timeout`` and recomputes.

The placement extension keeps the copy a holder sent with its ref report (:meth:`keep`)
while the key is in memory, and on every transition of a task to ``processing`` hands
the copies of its inputs that its worker lacks to that worker (:meth:`hand_over`). Dask
sends the task itself after the transitions of the same pass, on the same stream, so the
copy is there first and the worker never fetches the input. Only workers whose kvstate
plugin said hello get copies (a stream op with no handler closes a worker's stream).

Other ways were weighed: replicating ref keys to every worker is undone by Dask's
Active Memory Manager, which drops replicas no waiting task needs, and is O(workers)
per state; a shorter connect timeout for fetches of ref keys leaves the consumer
asking the scheduler again, which names the same unreachable holder until it removes
it (30 s after the cut with Dask's defaults, measured: its stream to the holder times out).
"""

from __future__ import annotations

from collections import Counter

from distributed.comm.core import CommClosedError

from dask_kvstate.protocol import REF_COPY, WORKER_PLUGIN


class RefRelay:
    """Copies of small ref-holding task results, handed to the workers of their dependents.

    Examples
    --------
    >>> relay = RefRelay()
    >>> relay.kvstate_hello("tcp://w:1", "kvstate")
    >>> relay.keep("k", {"kind": "ref", "rows": [()]})
    >>> sorted(relay.copies), relay.announced
    (['k'], {'tcp://w:1'})
    >>> relay.forget("k"); relay.remove_worker("tcp://w:1"); (relay.copies, relay.announced)
    ({}, set())
    """

    def __init__(self) -> None:
        self.copies: dict = {}  # key -> the copy its holder sent (``ref_copies.pack``)
        self.announced: set[str] = set()  # workers whose kvstate plugin handles REF_COPY
        self.counters: Counter[str] = Counter()

    def kvstate_hello(self, worker: str | None, plugin: str | None) -> None:
        if worker is not None and plugin == WORKER_PLUGIN:
            self.announced.add(worker)

    def remove_worker(self, worker: str) -> None:
        self.announced.discard(worker)

    def keep(self, key, copy: dict) -> None:
        """Keep ``copy`` of ``key``'s value (in memory now) until :meth:`forget`."""
        self.copies[key] = copy

    def forget(self, key) -> None:
        self.copies.pop(key, None)

    def hand_over(self, scheduler, ts) -> int:
        """Send ``ts``'s worker the copies of the inputs of ``ts`` it does not hold; how many.

        Called as ``ts`` enters ``processing``: before Dask sends the task itself.
        """
        ws = ts.processing_on
        if ws is None or ws.address not in self.announced:
            return 0
        stream = scheduler.stream_comms.get(ws.address)
        if stream is None:
            return 0
        sent = 0
        for dts in ts.dependencies:
            copy = self.copies.get(dts.key)
            if copy is None or ws in (dts.who_has or ()):
                continue
            try:
                stream.send({"op": REF_COPY, "key": dts.key, "copy": copy})
            except CommClosedError:  # the worker is going: Dask reschedules its task
                return sent
            sent += 1
        self.counters["ref_copies_sent"] += sent
        return sent

    def stats(self) -> dict:
        return {**self.counters, "ref_copies_kept": len(self.copies)}
