"""The placement exchange between the scheduler and a worker, typed, and its one pricing function.

A consumer of a KV state may run where the state's blocks are, or elsewhere and pull
or recompute the missing ones (AAFLOW+ eq. 30). Both processes price that choice with
:func:`price`: the scheduler's placement extension
(:mod:`dask_kvstate.plugins.scheduler.placement`) to pick a worker, the worker
(:mod:`dask_kvstate.plugins.worker.placement`) to pull or recompute once the task
runs. What crosses the wire is three records:

* :class:`Assignment`: the scheduler's word on a task, carried by the task itself as its
  ``kvstate-placement`` annotation: the worker chosen and why, the copies of the state
  the scheduler knows of and the idle threads on that worker's host, so the worker
  moves its first byte without asking the scheduler anything;
* :class:`Decision`: what the worker chose, filled in with the outcome as it carries it
  out (the steps of a pull, how long it all took);
* the decision goes back as a ``kvstate-outcome`` stream message (:meth:`Decision.wire`).

On the wire they are plain dicts (annotations and stream messages are msgpack); each
record reads one with ``from_wire``, which refuses a malformed one rather than act on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from dask_kvstate.cost import transfer_or_recompute

#: What a consumer does about the missing blocks: ``local`` when none are missing.
ACTIONS = ("pull", "recompute", "local")


@dataclass(frozen=True)
class Link:
    """What one worker measured of its link to another: bytes per second and seconds per request."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Estimate:
    """Both options for the blocks a worker misses of a state, priced by :func:`price`."""

    action: str
    t_transfer: float
    t_recompute: float
    missing_tokens: int
    missing_bytes: int


def price(
    num_tokens: int,
    first_missing: int,
    block_tokens: int,
    bytes_per_token: int,
    link: Link,
    prefill: tuple[float, float],
) -> Estimate:
    """Pull or recompute blocks ``first_missing...`` of a state of ``num_tokens`` tokens.

    ``link`` is the puller's measurement of its link to the copy it would pull from,
    ``prefill`` its model's fitted prefill coefficients (seconds per token, per token
    pair). The one rule both the scheduler and the worker apply.

    >>> e = price(1024, 2, 256, 1000, Link(bandwidth=1e6, latency=1e-3), (1e-4, 0.0))
    >>> e.action, e.missing_tokens, e.missing_bytes
    ('recompute', 512, 512000)
    >>> price(1024, 4, 256, 1000, Link(1e6, 1e-3), (1e-4, 0.0)).action
    'local'
    """
    missing_tokens = max(num_tokens - first_missing * block_tokens, 0)
    missing_bytes = missing_tokens * bytes_per_token
    action, tt, tr = transfer_or_recompute(
        missing_bytes,
        missing_tokens,
        first_missing * block_tokens,
        bandwidth=link.bandwidth,
        latency=link.latency,
        per_token_s=prefill[0],
        per_pair_s=prefill[1],
    )
    return Estimate(action, tt, tr, missing_tokens, missing_bytes)


def _fields(cls, d: Any) -> dict:
    """The entries of ``d`` that name fields of ``cls``; ValueError if ``d`` is no dict or
    lacks one of them that has no default."""
    if not isinstance(d, dict):
        raise ValueError(f"a {cls.__name__} is a dict, got {type(d).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    required = [
        n for n, f in names.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    lacking = [n for n in required if n not in d]
    if lacking:
        raise ValueError(f"a {cls.__name__} needs {', '.join(lacking)}; got {sorted(d)}")
    return {k: v for k, v in d.items() if k in names}


@dataclass(frozen=True)
class Assignment:
    """The scheduler's word on one consumer of a state (its ``kvstate-placement`` annotation).

    ``worker`` is where the extension sent the task (a loose restriction: Dask may still
    run it elsewhere, then the worker decides itself); ``None`` when the task was left
    where its user put it and only ``copies`` and ``idle_threads`` are told.
    """

    worker: str | None
    action: str | None = None
    holder: str | None = None  # the copy ``worker`` reaches fastest by its own measurements
    t_transfer: float = 0.0
    t_recompute: float = 0.0
    missing_tokens: int = 0
    expected_start: float = 0.0
    occupancy: float = 0.0
    capped: bool = False  # chosen among the state's copies only (``placement.max-copies`` reached)
    copies: tuple[str, ...] = ()  # running workers holding every block of the state
    idle_threads: int = 0  # threads with no task on ``worker``'s host, its own excepted

    def wire(self) -> dict:
        d = dataclasses.asdict(self)
        d["copies"] = list(self.copies)
        return d

    @classmethod
    def from_wire(cls, d: Any) -> Assignment:
        """The annotation ``d`` read back; ValueError naming what is wrong with it."""
        kw = _fields(cls, d)
        if kw.get("action") not in (None, *ACTIONS):
            raise ValueError(f"an Assignment's action is one of {ACTIONS}, got {kw['action']!r}")
        copies = kw.get("copies", ())
        if not isinstance(copies, (list, tuple)) or not all(isinstance(w, str) for w in copies):
            raise ValueError(f"an Assignment's copies are worker addresses, got {copies!r}")
        return cls(**{**kw, "copies": tuple(copies), "idle_threads": max(int(kw.get("idle_threads", 0)), 0)})


@dataclass
class Decision:
    """A worker's pull-or-recompute choice for the missing blocks of a state, and its outcome.

    ``by`` says who decided: ``scheduler`` (the placement extension's choice for this
    worker stood), ``worker`` (its own measurements) or ``config``
    (``kvstate.placement.rule`` forced it). The pull fills in ``steps``, ``chunks``
    (blocks and seconds of each step, seconds ``None`` for one cut off or failed,
    ``[0, None]`` for a move to another copy), ``cut_off`` and ``switched`` (the measured
    link turned it to recompute); the caller fills in ``seconds``, what it all cost.
    """

    action: str
    t_transfer: float
    t_recompute: float
    by: str
    missing_bytes: int
    missing_tokens: int
    key: Hashable | None = None  # the task it was decided for
    holder: str | None = None  # the copy pulled from (the last one, after a move)
    holders: list[str] = field(default_factory=list)  # every copy known when it was decided
    decide_s: float = 0.0
    seconds: float | None = None
    steps: int = 0
    chunks: list[list] = field(default_factory=list)
    cut_off: bool = False
    switched: bool = False

    @property
    def slower(self) -> bool:
        """Whether the option taken took longer than the other one's estimate."""
        other = self.t_recompute if self.action == "pull" else self.t_transfer
        return self.seconds is not None and self.seconds > other

    def wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: Any) -> Decision:
        """A ``kvstate-outcome`` message read back; ValueError naming what is wrong with it."""
        kw = _fields(cls, d)
        if kw["action"] not in ACTIONS:
            raise ValueError(f"a Decision's action is one of {ACTIONS}, got {kw['action']!r}")
        return cls(**kw)
