"""``python -m dask_kvstate.bench nalar-workflows``: the workflows' settings and what the command runs.

A run of :func:`~dask_kvstate.bench.nalar.runner.run` (the workflows under their
configurations), or, with ``control_loop`` or ``control_loop_scale``, a measurement of
the scheduler's control loop instead (:mod:`.loop_latency`, :mod:`.loop_scale`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dask_kvstate.bench.nalar.loop_latency import measure_control_loop
from dask_kvstate.bench.nalar.loop_scale import SIZES, measure_control_loop_scale
from dask_kvstate.bench.nalar.runner import CONFIGS, DEFAULT_CONFIGS, run
from dask_kvstate.bench.nalar.workflows import WORKFLOWS


@dataclass
class Options:
    """One command's settings: the workflow and its overrides, the configurations, the grid, where to."""

    workflow: str = field(
        default="swe", metadata={"help": "the workflow (all: every one)", "choices": [*WORKFLOWS, "all"]}
    )
    configs: str = field(
        default=DEFAULT_CONFIGS,
        metadata={"help": f"comma-separated, of {','.join(CONFIGS)}; a +hints suffix adds the component hints"},
    )
    duration: float = field(default=40.0, metadata={"help": "seconds of arrivals"})
    drain: float = field(default=120.0, metadata={"help": "seconds allowed after the last arrival"})
    rate: float | None = field(default=None, metadata={"help": "requests per second (default: the workflow's)"})
    seed: int = field(default=0, metadata={"help": "the first seed of arrivals, durations and outcomes"})
    repeats: int = field(default=1, metadata={"help": "seeds seed..seed+repeats-1, interleaved; medians"})
    roles: str | None = field(
        default=None, metadata={"help": "units per role at start, e.g. planner=1,developer=7,tester=4"}
    )
    median: str | None = field(default=None, metadata={"help": "median seconds per component call, e.g. router=0.06"})
    stateful: bool = field(
        default=False,
        metadata={"help": "mark swe's developer stateful: its retries keep session affinity (Nalar's stateful hint)"},
    )
    grid_max: int = field(default=10, metadata={"help": "static-best: candidate splits run at most"})
    grid_duration: float | None = field(
        default=None, metadata={"help": "static-best: seconds of arrivals a grid run (default: --duration)"}
    )
    out: str = field(default="results/nalar", metadata={"help": "folder for <workflow>.md, .json and .png"})
    control_loop: int = field(
        default=0, metadata={"help": "measure the loop with N queued futures instead", "metavar": "N"}
    )
    control_loop_scale: str | None = field(
        default=None,
        metadata={
            "help": "measure the loop's pass against queued futures instead (over 1000 sessions, 100 workers); "
            "sizes comma-separated",
            "nargs": "?",
            "const": ",".join(str(n) for n in SIZES),
            "metavar": "N,N,...",
        },
    )


def command(opts: Options) -> dict | list | None:
    """What ``opts`` asks for: the control loop's scale or latency, else the workflows' table."""
    logging.getLogger("distributed").setLevel(logging.ERROR)  # cluster start/stop chatter, per run
    if opts.control_loop_scale:
        return measure_control_loop_scale([int(n) for n in opts.control_loop_scale.split(",")], opts.out)
    if opts.control_loop:
        return measure_control_loop(opts.control_loop, opts.out)
    return run(
        opts.workflow,
        configs=opts.configs,
        duration=opts.duration,
        drain=opts.drain,
        rate=opts.rate,
        seed=opts.seed,
        repeats=opts.repeats,
        roles=opts.roles,
        median=opts.median,
        stateful=opts.stateful,
        grid_max=opts.grid_max,
        grid_duration=opts.grid_duration,
        out=opts.out,
    )
