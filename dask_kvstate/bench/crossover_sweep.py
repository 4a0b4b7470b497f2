"""``python -m dask_kvstate.bench crossover-sweep``: the crossover sweep and KV pull throughput, alone.

The bench's experiment 3 runs one sweep inside the AAFLOW+ suite; this command runs the
measurements of :mod:`dask_kvstate.bench.crossover` on their own, with every knob:
the sweep's comm and repeats, the throughput comms and sizes, the zero-copy and
checksum comparisons, or the sweep over real shaped links (``links="netns"``, root,
Linux: :mod:`dask_kvstate.bench.crossover_netns`) beside the config throttle. A module of
its own because the netns sweep imports :mod:`~dask_kvstate.bench.crossover`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dask_kvstate.bench import crossover, crossover_netns


@dataclass
class Options:
    """The sweep's and the throughput measurement's settings."""

    model: str = field(default="tiny-llama", metadata={"help": "the model both workers install"})
    protocol: str = field(default="tcp", metadata={"help": "comm of the sweep's cluster: tcp, tls or ucx"})
    repeats: int = field(default=3, metadata={"help": "timings of each option per cell"})
    throughput: str = field(default="tcp", metadata={"help": "comma-separated comms to measure KV pull throughput on"})
    mib: int = field(default=64, metadata={"help": "bytes of KV moved per throughput measurement"})
    skip_sweep: bool = field(default=False, metadata={"help": "measure the throughput only"})
    packed: bool = field(default=False, metadata={"help": "also time pulls with the zero-copy path off, interleaved"})
    checksum: bool = field(
        default=False, metadata={"help": "also time pulls with frame checksums off and on, interleaved"}
    )
    tp_repeats: int = field(default=9, metadata={"help": "pulls and fetches per throughput measurement"})
    links: str = field(
        default="throttle",
        metadata={
            "help": "the sweep's links: the config throttle, or shaped netns links (root)",
            "choices": ("throttle", "netns"),
        },
    )
    contexts: list[int] = field(
        default_factory=lambda: list(crossover_netns.CONTEXTS), metadata={"help": "--links netns: context lengths"}
    )
    out: str = field(default="results/crossover-netns", metadata={"help": "where --links netns writes its table"})


def command(opts: Options) -> dict:
    """The netns sweep and its table, or the throttle sweep (unless skipped) and the throughput per comm."""
    if opts.links == "netns":
        res = crossover_netns.compare(opts.model, opts.repeats, contexts=opts.contexts)
        print(crossover_netns.write(res, opts.out))
        return res
    cells = [] if opts.skip_sweep else crossover.sweep(opts.model, opts.protocol, opts.repeats)
    protocols = list(filter(None, opts.throughput.split(",")))
    rates = crossover.throughputs(
        opts.model, protocols, opts.mib, opts.tp_repeats, packed=opts.packed, checksum=opts.checksum
    )
    return {"cells": cells, "throughput": rates}
