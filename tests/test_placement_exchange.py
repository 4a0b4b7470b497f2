"""The typed placement exchange (dask_kvstate/placement.py): one pricing function for the
scheduler and the worker, and records that refuse a malformed message."""

from __future__ import annotations

import pytest

from dask_kvstate.cost import transfer_or_recompute
from dask_kvstate.placement import Assignment, Decision, Link, price


def test_price_is_the_rule_on_the_missing_blocks():
    link, prefill = Link(bandwidth=5e7, latency=2e-3), (2e-4, 1e-8)
    e = price(1000, 3, 64, 4096, link, prefill)
    missing = 1000 - 3 * 64
    assert (e.missing_tokens, e.missing_bytes) == (missing, missing * 4096)
    expected = transfer_or_recompute(
        missing * 4096, missing, 3 * 64, bandwidth=5e7, latency=2e-3, per_token_s=2e-4, per_pair_s=1e-8
    )
    assert (e.action, e.t_transfer, e.t_recompute) == expected


def test_an_assignment_survives_the_wire():
    a = Assignment("tcp://b", "pull", "tcp://a", 0.1, 0.3, 512, 0.2, 0.05, True, ("tcp://a", "tcp://c"), 3)
    wire = a.wire()
    assert isinstance(wire["copies"], list)  # msgpack-friendly
    assert Assignment.from_wire(wire) == a
    told = Assignment(worker=None, copies=("tcp://a",))
    assert Assignment.from_wire(told.wire()) == told


@pytest.mark.parametrize(
    "bad, says",
    [
        ("pull", "is a dict"),
        ({"action": "pull"}, "needs worker"),
        ({"worker": "tcp://b", "action": "teleport"}, "teleport"),
        ({"worker": "tcp://b", "copies": [1, 2]}, "worker addresses"),
    ],
)
def test_a_malformed_assignment_is_refused_naming_what_is_wrong(bad, says):
    with pytest.raises(ValueError, match=says):
        Assignment.from_wire(bad)


def test_a_decision_carries_its_outcome_back():
    d = Decision("pull", 0.1, 0.4, "scheduler", 4096, 64, key="k", holder="tcp://a", holders=["tcp://a"])
    assert not d.slower  # not carried out yet
    d.seconds, d.steps, d.chunks = 0.5, 1, [[4, 0.5]]
    assert d.slower  # it took longer than recomputing was estimated to
    back = Decision.from_wire({**d.wire(), "op": "kvstate-outcome"})  # the stream message's own keys are dropped
    assert back == d
    with pytest.raises(ValueError, match="needs"):
        Decision.from_wire({"action": "pull"})
