"""Worker-side guards, each on its own: hooks that must not skip their cleanup, and
process-wide settings that one task must not change under another."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dask_kvstate.state import KVStateRef, Placement, example_ref


def _ref(blocks):
    return replace(
        example_ref("x"),
        state_id="s-1",
        block_tokens=16,
        num_tokens=16 * len(blocks),
        blocks=tuple(blocks),
        nbytes=100,
        placement=Placement("tcp://holder", "device"),
    )


def _scheduler_gone(*args):
    from distributed.comm.core import CommClosedError

    raise CommClosedError("scheduler gone (test)")


class _ClosedStream:
    comm = None
    send = staticmethod(_scheduler_gone)


@pytest.mark.parametrize("broken", ["ref report", "states report"])
def test_a_finished_tasks_pins_go_even_when_its_reports_cannot_be_sent(broken):
    from dask_kvstate.plugins.worker.block_store import TieredBlockStore
    from dask_kvstate.plugins.worker.plugin import KVStateWorkerPlugin

    store = TieredBlockStore(device_bytes=2**20, host_bytes=2**20, disk_bytes=2**20)
    hashes = [b"a" * 16, b"b" * 16]
    for h in hashes:
        store.put(h, torch.zeros(4))
    ref = _ref(hashes)
    plugin = KVStateWorkerPlugin("tiny-llama")
    plugin.runtime = SimpleNamespace(store=store)
    plugin.worker = SimpleNamespace(
        data={"k": ref},
        state=SimpleNamespace(tasks={"k": SimpleNamespace(type=KVStateRef)}),
        batched_stream=_ClosedStream(),
    )
    plugin.placement = broken == "ref report"
    plugin._observer = SimpleNamespace(send_states=_scheduler_gone) if broken == "states report" else None
    store.pin(("task", "k"), hashes)
    if broken == "ref report":
        plugin.transition("k", "executing", "memory")  # a closed stream loses the report, quietly
    else:
        from distributed.comm.core import CommClosedError

        with pytest.raises(CommClosedError):
            plugin.transition("k", "executing", "memory")
    assert not store.pinned_by(("task", "k"))  # unpinned whatever the reports did
    assert plugin.held == {"k": ["s-1"]} and all(h in store.holds for h in hashes)  # and held for the key
    store.close()


def _engine(running: int, monkeypatch, idle: int = 4):
    from dask_kvstate.plugins.worker import scheduler_link
    from dask_kvstate.plugins.worker.engine import KVEngine
    from dask_kvstate.plugins.worker.settings import WorkerSettings

    seen = []

    def prefill(ids, past, keep_from=0, namespace=None):
        seen.append(torch.get_num_threads())
        return torch.zeros(1, 2, 1, len(ids), 1), None  # [L, 2, H, T, D]

    monkeypatch.setattr(scheduler_link, "idle_threads", lambda worker, timeout: idle)
    settings = WorkerSettings.from_config({"kvstate.worker.borrow-idle-threads": 8})
    state = SimpleNamespace(executing=set(range(running)), long_running=set())
    worker = SimpleNamespace(address="tcp://w", state=state)
    backend = SimpleNamespace(
        prefill=prefill, kv_to_store=lambda cache, start, block_tokens: cache, elastic_threads=True
    )
    return KVEngine(backend, SimpleNamespace(), worker, settings=settings), seen


@pytest.mark.skipif((__import__("os").cpu_count() or 1) < 2, reason="borrowing needs a second core")
def test_threads_are_borrowed_only_while_no_other_task_runs_and_by_one_prefill(monkeypatch):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker's own count, below the cores there are to borrow
    try:
        _borrow_checks(monkeypatch, own=1)
    finally:
        torch.set_num_threads(previous)


def _borrow_checks(monkeypatch, own: int):
    crowded, seen = _engine(running=2, monkeypatch=monkeypatch)
    crowded.prefill(list(range(16)), None)
    assert seen == [own] and not crowded.counters["borrowed_threads"]  # another task runs: nothing borrowed
    alone, seen = _engine(running=1, monkeypatch=monkeypatch)
    other, seen_other = _engine(running=1, monkeypatch=monkeypatch)
    with alone._borrowed_threads(16) as threads:
        assert threads > own and torch.get_num_threads() == threads
        other.prefill(list(range(16)), None)  # a second prefill meanwhile borrows nothing more...
        assert seen_other == [threads] and not other.counters["borrowed_threads"]
        assert not other.prefill_meter.obs  # ...and does not meter a thread count that is not its own
    assert torch.get_num_threads() == own  # given back, exactly


def test_the_stats_reporter_loses_its_messages_quietly_when_the_scheduler_is_gone():
    from dask_kvstate.plugins.worker.reporter import StatsReporter

    class _Plugin:
        runtime = None  # worker_stats reads {"installed": False}

    worker = SimpleNamespace(batched_stream=SimpleNamespace(comm=object(), send=_scheduler_gone))
    reporter = StatsReporter(worker, _Plugin(), interval_s=1.0)
    reporter.send_states("k", [_ref([b"a" * 16])])  # no CommClosedError out of a transition hook
    reporter.report()
    assert reporter.last is None  # not recorded as sent: the next connection gets a full report
