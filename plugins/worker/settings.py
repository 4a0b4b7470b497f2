"""A worker's kvstate settings, read once when the worker plugin sets up.

The client's ``kvstate.*`` config travels inside the worker plugin, so every worker
hashes blocks with the same block size and decides by the same rule. The plugin reads
it here, in one place, into a frozen :class:`WorkerSettings`, and hands that to the
runtime, the transport and the serve side; nothing on the worker reads the config
again later, so a setting cannot change under a running task.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import dask.config
from dask.utils import parse_bytes

from dask_kvstate import config

logger = logging.getLogger("dask_kvstate")


@dataclass(frozen=True)
class WorkerSettings:
    """The ``kvstate.*`` keys a worker acts on, parsed (bytes as ints, durations in seconds).

    Examples
    --------
    >>> s = WorkerSettings.from_config({"kvstate.block-tokens": 16})
    >>> s.block_tokens, s.rule in ("auto", "pull", "recompute")
    (16, True)
    """

    block_tokens: int
    #: seconds a holder has to accept a connection before its blocks are recomputed
    connect_timeout: float
    #: seconds a block pull may take before it falls back to recompute
    pull_timeout: float
    #: bytes/s a pull is throttled to (an emulated slow link), or None
    emulated_bandwidth: float | None
    #: the transfer-or-recompute rule: "auto", or "pull" / "recompute" always
    rule: str
    #: prefills of at least this many tokens borrow idle threads (0: never)
    borrow_min_tokens: int
    #: prefill sizes timed at setup to seed the prefill cost model
    probe_tokens: tuple[int, ...]
    #: bytes of reply buffers kept to send a pull as one frame (0: none)
    packing_bytes: int
    #: whether blocks that are one run of memory are served as that memory
    zero_copy: bool
    #: whether served frames carry a CRC-32 each, which the puller checks
    checksum: bool
    #: most bytes of the first pull from a peer whose link is not measured yet
    probe_bytes: int
    #: how far (a fraction of the recompute estimate) a pull chunk may run past its estimate
    patience: float
    #: whether Dask's memory monitor may spill KV blocks before task data
    memory_monitor: bool
    #: freed bytes glibc keeps for reuse, or None to leave the allocator alone
    malloc_retain: int | None
    #: idle half-life (seconds) in the block store's eviction score
    recency_half_life: float
    #: seconds between reports to the placement extension (blocks and measurements, when changed)
    placement_report_interval: float
    #: Dask's ``distributed.comm.offload``: replies copying more than this leave the event loop
    inline_copy_bytes: int

    @classmethod
    def from_config(cls, cfg: dict | None = None) -> WorkerSettings:
        """Settings from the current config with ``cfg`` set over it (as ``dask.config.set``
        takes it: the plugin passes the whole ``{"kvstate": {...}}`` it carried)."""
        with dask.config.set(cfg or {}):
            retain = config.get("worker.malloc-retain")
            return cls(
                block_tokens=int(config.get("block-tokens")),
                connect_timeout=config.get_seconds("transport.connect-timeout"),
                pull_timeout=config.get_seconds("transport.timeout"),
                emulated_bandwidth=config.get_bandwidth("transport.emulated-bandwidth"),
                rule=config.get("placement.rule"),
                borrow_min_tokens=int(config.get("worker.borrow-idle-threads")),
                probe_tokens=tuple(config.get("placement.probe-tokens")),
                packing_bytes=config.get_bytes("transport.packing-bytes"),
                zero_copy=bool(config.get("transport.zero-copy")),
                checksum=bool(config.get("transport.checksum")),
                probe_bytes=config.get_bytes("transport.probe-bytes"),
                patience=float(config.get("transport.patience")),
                memory_monitor=bool(config.get("worker.memory-monitor")),
                malloc_retain=None if retain is None else config.get_bytes("worker.malloc-retain"),
                recency_half_life=config.get_seconds("worker.recency-half-life"),
                placement_report_interval=config.get_seconds("placement.report-interval"),
                inline_copy_bytes=parse_bytes(dask.config.get("distributed.comm.offload")),
            )


def warn_overridden(carried: dict) -> None:
    """Log each setting of this process's own config that ``carried`` (the plugin's
    ``{"kvstate": {...}}``) replaces: set where the worker started, lost unless the
    client's config has it too (:func:`dask_kvstate.config.overridden`)."""
    for key, own, theirs in config.overridden(dask.config.get("kvstate", {}), carried["kvstate"]):
        logger.warning(
            "kvstate.%s: %r in this worker's config, %r in the client's, which kvs.install carried here "
            "and the worker runs under; set it in the client's config before kvs.install",
            key,
            own,
            theirs,
        )
