"""Dask's periodic checks run less often while kvstate is installed, and come back after."""

from __future__ import annotations

import dask
import pytest
from distributed import Client, LocalCluster

import dask_kvstate as kvs
from dask_kvstate.plugins import housekeeping
from dask_kvstate.protocol import HOUSEKEEPING_NANNY, HOUSEKEEPING_WORKER

#: The callbacks each kind of server has, which the plugins time: the names must still be
#: distributed's (a renamed one would be silently left at Dask's interval).
EXPECTED = {
    "worker": {"tick", "profile", "monitor", "memory_monitor"},
    "nanny": {"tick", "monitor", "memory_monitor"},
    "scheduler": {"tick", "monitor"},
}


#: Timers Dask retimes by itself while the test looks: a worker's heartbeat runs every 1 s
#: until the scheduler's first reply, then at the interval that reply names for the cluster's
#: size (0.5 s here), and its find-missing check copies the heartbeat's each time it runs. The
#: plugins never touch them; comparing them would time the test's own pace.
SELF_TIMED = {"heartbeat", "find-missing"}


def _times(dask_worker=None, dask_scheduler=None) -> dict[str, float]:
    server = dask_worker if dask_scheduler is None else dask_scheduler
    return {name: pc.callback_time for name, pc in server.periodic_callbacks.items() if name not in SELF_TIMED}


def _all_times(client: Client) -> dict[str, dict[str, float]]:
    (worker,) = client.run(_times).values()
    (nanny,) = client.run(_times, nanny=True).values()
    return {"worker": worker, "nanny": nanny, "scheduler": client.run_on_scheduler(_times)}


def _cluster(**kwargs):
    return LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0", **kwargs)


def test_install_slows_every_process_checks_and_unregistering_restores():
    with _cluster() as cluster, Client(cluster) as client:
        before = _all_times(client)
        for kind, names in EXPECTED.items():
            assert names <= set(before[kind]), f"distributed's {kind} no longer has {names - set(before[kind])}"
        kvs.install(client, model=False)  # plain Python tasks: no engine to spare, Dask's timers stay
        assert _all_times(client) == before
        with dask.config.set({"kvstate.housekeeping.tick": "750ms"}):
            want = housekeeping.intervals()
            kvs.install(client, "tiny-llama", torch_threads=1)
        assert want["tick"] == 750
        after = _all_times(client)
        for kind, names in EXPECTED.items():
            assert {n: after[kind][n] for n in names} == {n: max(want[n], before[kind][n]) for n in names}, kind
            assert any(after[kind][n] > before[kind][n] for n in names), kind
            # What the plugins do not time keeps Dask's interval.
            assert {n: t for n, t in after[kind].items() if n not in want} == {
                n: t for n, t in before[kind].items() if n not in want
            }
        # A second install, under the default tick (1 s): the plugins already there stay, 750 ms.
        kvs.install(client, "tiny-llama", torch_threads=1)
        assert _all_times(client) == after

        client.unregister_worker_plugin(HOUSEKEEPING_WORKER)
        client.unregister_worker_plugin(HOUSEKEEPING_NANNY, nanny=True)
        restored = _all_times(client)
        assert restored["worker"] == before["worker"]
        assert restored["nanny"] == before["nanny"]
        assert restored["scheduler"] == after["scheduler"]  # distributed tells it nothing; back when it closes


def test_a_preloaded_nanny_reached_by_install_too_gets_dasks_intervals_back():
    # The nanny's preload adds its plugin itself; kvs.install then sends the scheduler's copy,
    # which replaces it on the nanny without a teardown: Dask's intervals must still come back.
    with _cluster(preload_nanny=["dask_kvstate.plugins"]) as cluster, Client(cluster) as client:
        (nanny,) = client.run(_times, nanny=True).values()
        assert nanny["tick"] == housekeeping.intervals()["tick"]  # the preload's plugin
        kvs.install(client, "tiny-llama", torch_threads=1)
        client.unregister_worker_plugin(HOUSEKEEPING_NANNY, nanny=True)
        (restored,) = client.run(_times, nanny=True).values()
    assert restored["tick"] == 1000 * dask.utils.parse_timedelta(dask.config.get("distributed.admin.tick.interval"))
    assert restored["memory_monitor"] == 1000 * dask.utils.parse_timedelta(
        dask.config.get("distributed.worker.memory.monitor-interval")
    )


def test_a_slower_dask_setting_stays_and_the_switch_turns_it_off():
    with dask.config.set({"distributed.admin.tick.interval": "5s", "kvstate.housekeeping.profile": "50ms"}):
        with _cluster() as cluster, Client(cluster) as client:
            kvs.install(client, "tiny-llama", torch_threads=1)
            times = _all_times(client)
    assert {kind: t["tick"] for kind, t in times.items()} == dict.fromkeys(EXPECTED, 5000)  # never faster than Dask's
    assert times["worker"]["profile"] == 50

    with dask.config.set({"kvstate.housekeeping.enabled": False}):
        assert housekeeping.plugins() == []
        with _cluster() as cluster, Client(cluster) as client:
            before = _all_times(client)
            kvs.install(client, "tiny-llama", torch_threads=1)
            assert _all_times(client) == before


def test_bad_intervals_are_refused_before_the_cluster_is_touched():
    with dask.config.set({"kvstate.housekeeping.tick": "soon"}):
        with pytest.raises(ValueError, match=r"kvstate\.housekeeping\.tick must be a duration"):
            kvs.install(None, "tiny-llama")
    with dask.config.set({"kvstate.housekeeping.enabled": "yes"}):
        with pytest.raises(ValueError, match=r"kvstate\.housekeeping\.enabled must be a bool"):
            housekeeping.plugins()
