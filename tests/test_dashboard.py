"""Observability: the /kvstate dashboard page, kvstate-* event topics, reprs.

The browser test drives Debian's headless Chromium over the DevTools protocol against
the session's two-process cluster while a tree-of-thought workflow runs, and checks
that the totals the page shows are the totals ``kvs.stats`` returns.
"""

from __future__ import annotations

import json
import os
import select
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import replace

import dask
import pytest
from dask.utils import format_bytes
from distributed import Client, LocalCluster, wait
from distributed.utils_test import poll_for

import dask_kvstate as kvs
from dask_kvstate import protocol, views
from dask_kvstate.plugins.scheduler.dashboard import SHOWN_TOTALS, KVStatePage
from dask_kvstate.plugins.scheduler.observe import KVObserver
from dask_kvstate.protocol import OBSERVE_EXTENSION, SESSIONS_EXTENSION
from dask_kvstate.views import ClusterStats

from .browser import Browser, find_chromium
from .conftest import CONTEXT, TEST_CONFIG

ARTIFACTS = os.path.join(os.path.dirname(__file__), "artifacts")


def tree_of_thought(branches: int = 4, new_tokens: int = 8):
    """One shared context, forked; each branch extends with its own thought and answers."""
    context = kvs.materialize("Tree of thought. " + CONTEXT)
    thoughts = [
        kvs.extend(b, f" Branch {i}: consider the tester's report {i} times.")
        for i, b in enumerate(kvs.fork(context, branches))
    ]
    return thoughts, [kvs.resume(t, " Verdict:", max_new_tokens=new_tokens) for t in thoughts]


def loopback(cluster, path: str) -> str:
    """A page of ``cluster``'s dashboard, over loopback (the dashboard link names the host's address)."""
    return f"http://127.0.0.1:{cluster.scheduler.http_server.port}/{path.lstrip('/')}"


def _observer_snapshot(dask_scheduler):
    return dask_scheduler.plugins[OBSERVE_EXTENSION].snapshot()


def _lineages(ids, dask_scheduler):
    return [dask_scheduler.plugins[OBSERVE_EXTENSION].lineage(i) for i in ids]


def _page_header(dask_scheduler):
    page = KVStatePage(dask_scheduler, dask_scheduler.plugins[OBSERVE_EXTENSION])
    page.update()
    return {
        "header": page.header.text,
        "lineage": page.lineage.text,
        "sessions": page.sessions.visible,
        "workers": list(page.tier_source.data["worker"]),
        "history": len(page.history_source.data["time"]),
    }


def _shown(totals: dict) -> dict:
    """How the page writes each total (the same formatting as plugins/scheduler/dashboard.py)."""
    out = {k: format_bytes(int(totals[k])) if k.endswith("bytes") else f"{int(totals[k]):,}" for k, _ in SHOWN_TOTALS}
    rate = totals["hit_rate"]
    out["hit_rate"] = "-" if rate is None else f"{rate:.1%}"
    return out


def _settled(client):
    """(kvs.stats, the scheduler's totals) once the workers' pushed reports caught up."""
    pair = {}

    def agree():
        pair["full"] = kvs.stats(client).workers
        pair["stats"] = pair["full"].totals
        pair["observed"] = client.run_on_scheduler(_observer_snapshot)["totals"]
        return pair["stats"] == pair["observed"]

    def fail():
        raise AssertionError(f"the scheduler's totals {pair['observed']} never matched kvs.stats {pair['stats']}")

    poll_for(agree, timeout=20, period=0.2, fail_func=fail)
    return pair["full"], pair["observed"]


# -- reprs ------------------------------------------------------------------------------


def test_stats_is_a_dict_with_table_and_html_reprs(client, workers):
    dask.compute(*tree_of_thought(2, 4)[1])
    full = kvs.stats(client)
    s = full.workers
    assert isinstance(s, ClusterStats) and isinstance(s, dict) and sorted(s) == workers
    text = str(s)
    assert repr(s) == text
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["worker", "model", "blocks"] and lines[-1].startswith("total")
    for w in workers:  # one row per worker, with its own block count
        row = next(line for line in lines if line.startswith(w))
        assert f"{s[w]['blocks']:,}" in row.split()
    assert lines[-1].split()[3] == f"{s.totals['blocks']:,}"
    html = s._repr_html_()
    assert html.count("<tr>") == len(workers) + 2 and all(w in html for w in workers)
    assert s.totals["blocks"] == sum(v["blocks"] for v in s.values())
    # The whole object: the worker table, then a line per scheduler extension; the same in HTML.
    assert isinstance(full, kvs.Stats) and repr(full) == str(full) and str(full).startswith(text)
    extensions = dict(line.split(None, 1) for line in str(full).split("\n\n")[1].splitlines()[2:])
    assert "workers 2" in extensions["placement"] and extensions["lifecycle"].startswith("on")  # on by default
    assert full._repr_html_().startswith(html) and "<td>hints</td><td>off</td>" in full._repr_html_()


def test_explain_renders_html():
    system = "You are a careful reviewer of distributed systems incident reports. "
    plan = kvs.explain(*[kvs.generate(system, CONTEXT, f" Question {i}?") for i in range(3)])
    html = plan._repr_html_()
    assert html.count("resume from S1") == 3 and "materialize" in html
    assert html.startswith("<div>") and "<script" not in html


# -- event topics -------------------------------------------------------------------------


def test_refusals_and_evictions_reach_the_event_log(client):
    ref = client.compute(kvs.materialize("Events. " + CONTEXT)).result()
    alien = replace(ref, config="c-from-another-model")
    client.compute(kvs.resume(alien, " Q?", max_new_tokens=2)).result()
    freed = client.compute(kvs.evict(ref)).result()

    def logged(topic, **match):
        return [m for _, m in client.get_events(topic) if all(m.get(k) == v for k, v in match.items())]

    poll_for(lambda: logged(protocol.COMPATIBILITY_TOPIC, state=ref.state_id), timeout=10)
    (refusal,) = logged(protocol.COMPATIBILITY_TOPIC, state=ref.state_id)
    assert refusal["kind"] == "refused" and "config" in refusal["reason"] and refusal["tokens"] == ref.num_tokens
    # Each worker that held blocks logs its own eviction, on its own stream: wait for them all.
    assert freed > 0
    poll_for(
        lambda: sum(e["freed_bytes"] for e in logged(protocol.STORE_TOPIC, kind="evict", state=ref.state_id)) == freed,
        timeout=10,
    )


def test_spills_are_logged_aggregated_per_report():
    """A tiny device tier spills many blocks; the log gets counts per report, not one event per block."""
    with dask.config.set(TEST_CONFIG):
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster:
            with Client(cluster) as client:
                kvs.install(client, "tiny-llama", torch_threads=1, device_bytes="20KiB", host_bytes="1MiB")
                refs = client.compute([kvs.materialize(f"Spill {i}. " + CONTEXT) for i in range(3)])
                wait(refs)
                (w,) = kvs.stats(client).workers
                spills = lambda: kvs.stats(client).workers[w]["tiers"]["device"]["spills"]
                logged = lambda: [m for _, m in client.get_events(protocol.STORE_TOPIC) if m.get("kind") == "store"]
                poll_for(lambda: sum(m.get("device_spills", 0) for m in logged()) == spills() > 0, timeout=15)
                assert len(logged()) < spills()  # aggregated: fewer events than blocks moved
                assert all(m["worker"] == w for m in logged())


# -- the page -----------------------------------------------------------------------------


@pytest.mark.parametrize("key, value", [("history", 0), ("refresh-interval", "0s"), ("largest-states", -1)])
def test_observer_rejects_bad_settings(key, value):
    with dask.config.set({f"kvstate.dashboard.{key}": value}), pytest.raises(ValueError, match=key):
        KVObserver()


def test_page_with_no_data_shows_an_empty_state():
    with LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as c:
        url = loopback(cluster, "kvstate")
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url)  # served once the plugins are installed
        c.register_plugin(KVObserver())
        assert urllib.request.urlopen(url).status == 200
        nav = urllib.request.urlopen(loopback(cluster, "status")).read().decode()
        assert 'href="kvstate"' in nav  # listed in Dask's navigation bar
        shown = c.run_on_scheduler(_page_header)
        assert "data-kvstate='empty'" in shown["header"] and "No KV state yet" in shown["header"]
        assert shown["workers"] == [] and shown["history"] == 0 and not shown["sessions"]
        assert "No states yet" in shown["lineage"]


def test_lineage_escapes_what_workers_report():
    """State ids, ops, holders and models come from workers: the page shows them as text, never as markup."""
    from dask_kvstate.plugins.scheduler.dashboard import lineage_html

    step = {"op": "<b>op", "state": "<script>x", "tokens": 3, "nbytes": 10, "holder": "<i>w", "model": "<u>m"}
    shown = lineage_html([[{**step, "live": True}, step]])
    assert "<script" not in shown and "<b>op" not in shown and "<i>w" not in shown and "<u>m" not in shown
    assert "&lt;script" in shown and "&lt;b&gt;op" in shown


def test_page_data_follows_a_workflow(client, workers):
    thoughts, answers = tree_of_thought(3, 4)
    held = client.compute(thoughts)  # keep the branch states live
    dask.compute(*answers)
    full, observed = _settled(client)
    stats = full.totals
    assert observed == stats
    shown = client.run_on_scheduler(_page_header)
    assert (
        shown["workers"] == workers and shown["history"] >= 1 and shown["sessions"] is True
    )  # the session tracker runs by default
    for key, value in _shown(stats).items():
        assert f"data-kvstate='{key}'" in shown["header"] and f">{value}</b>" in shown["header"], key
    # Each branch's lineage leads back through its fork to the shared context.
    refs = client.gather(held)
    chains = client.run_on_scheduler(_lineages, [r.state_id for r in refs])
    for ref, chain in zip(refs, chains):
        assert [c["op"] for c in chain] == ["extend", "fork", "materialize"], chain
        assert chain[0]["tokens"] == ref.num_tokens > chain[-1]["tokens"] and chain[0]["holder"] in workers
    assert len({c[-1]["state"] for c in chains}) == 1  # one shared context
    largest = client.run_on_scheduler(_observer_snapshot)["largest"]
    sizes = [c[0]["nbytes"] for c in largest]
    assert sizes == sorted(sizes, reverse=True) and largest[0][0]["op"] in shown["lineage"]
    # Placement decisions for these consumers went to Dask's event log under their topic.
    assert any(m.get("kind") == "decision" for _, m in client.get_events(protocol.PLACEMENT_TOPIC))
    del held


def _sessions_panel(dask_scheduler) -> str:
    from dask_kvstate.plugins.scheduler.dashboard import sessions_html

    return sessions_html(dask_scheduler.plugins[SESSIONS_EXTENSION])


def _inc(x):
    return x + 1


def test_sessions_panel_shows_live_sessions_with_their_progress(client):
    assert client.run_on_scheduler(_page_header)["sessions"] is True  # the tracker runs by default
    with kvs.session("review-42") as s:
        futures = client.map(_inc, range(3), pure=False)
        wait(futures)
        panel = client.run_on_scheduler(_sessions_panel)
    assert s.id in panel and "3/3" in panel
    del futures


def _wait_for(name: str, *_after) -> str:
    """A workflow step that blocks until the test sets the Event ``name`` (returns no text)."""
    from distributed import Event

    if not Event(name).wait(timeout=120):
        raise TimeoutError(f"event {name!r} was never set")
    return ""


def test_chromium_shows_the_totals_of_kvs_stats(client, cluster):
    """The page, in a real browser, shows kvs.stats' totals mid-run and after the run."""
    binary = find_chromium()
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run tries to install it)")
    pytest.importorskip("websocket", reason="websocket-client is missing (pip install -e '.[test]')")
    from distributed import Event

    os.makedirs(ARTIFACTS, exist_ok=True)
    go = f"kvstate-dashboard-go-{uuid.uuid4().hex[:8]}"
    context = kvs.materialize("Tree of thought in a browser. " + CONTEXT)
    thoughts = [kvs.extend(b, f" Branch {i}: weigh the tester's report.") for i, b in enumerate(kvs.fork(context, 6))]
    # The answers wait for a gate: the run is provably in progress while the page is read.
    gate = dask.delayed(_wait_for, pure=False)(go, thoughts)
    answers = [kvs.resume(t, gate, " Verdict:", max_new_tokens=16) for t in thoughts]
    seen: dict = {}
    during: dict = {}
    with Browser(binary) as browser:
        held = client.compute(thoughts)
        running = client.compute(answers)
        browser.navigate(loopback(cluster, "kvstate"))

        def check(label: str) -> None:
            stats = _settled(client)[0]
            want, rows = _shown(stats.totals), views._rows(stats)  # the per-worker rows as the page writes them

            def shows():  # Bokeh has drawn the plots, and the totals and rows are kvs.stats'
                seen.update(browser.read_page())
                return seen.get("canvases", 0) >= 4 and seen.get("shown") == want and seen.get("rows") == rows

            def fail():
                raise AssertionError(
                    f"{label}: the page shows {seen.get('shown')} {seen.get('rows')}, kvs.stats says {want} {rows}"
                )

            poll_for(shows, timeout=30, period=0.25, fail_func=fail)

        try:
            wait(held)
            check("mid-run")
            assert not any(f.done() for f in running)  # still running: held at the gate
            during.update(seen["shown"])
            Event(go, client=client).set()
            wait(running)
            check("after the run")
        finally:  # the artifacts, pass or fail
            Event(go, client=client).set()
            browser.screenshot(os.path.join(ARTIFACTS, "kvstate-dashboard.png"))
            with open(os.path.join(ARTIFACTS, "kvstate-dashboard.json"), "w") as f:
                json.dump({"during": during, "after": seen.get("shown")}, f, indent=1)
        assert seen["title"] == "Dask: KV state"
        count = lambda shown: int(shown["prefill_tokens_avoided"].replace(",", ""))
        assert count(during) < count(seen["shown"])  # the answers resumed from the branches' KV
        assert all(r.reused_tokens > 0 for r in client.gather(running))
        del held


# -- progress bars ----------------------------------------------------------------------


@pytest.mark.parametrize("on", [True, False])
def test_progress_bars_show_on_a_terminal_unless_disabled(monkeypatch, on):
    import fcntl
    import pty
    import struct
    import termios

    from dask_kvstate import progress

    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    with os.fdopen(child, "w") as terminal:
        with monkeypatch.context() as m, dask.config.set({"kvstate.progress": on}):
            m.setattr("sys.stderr", terminal)  # restored before the terminal closes
            assert progress.enabled() is on
            with progress.bar(total=3, desc="converting", unit="step") as b:
                b.update(3)
        # The pty delivers asynchronously: read up to a marker written after the bar.
        terminal.write("<<end>>\n")
        terminal.flush()
        shown = ""
        deadline = time.monotonic() + 10
        while "<<end>>" not in shown and time.monotonic() < deadline:
            if select.select([main], [], [], 0.5)[0]:
                shown += os.read(main, 65536).decode(errors="replace")
    os.close(main)
    assert "<<end>>" in shown, shown
    assert ("converting" in shown and "3/3" in shown) is on, shown


def test_stats_under_an_asynchronous_client(client, workers):
    import asyncio

    async def go():
        async with Client(client.scheduler.address, asynchronous=True) as ac:
            return await kvs.stats(ac)

    full = asyncio.run(go())
    s = full.workers
    assert isinstance(s, ClusterStats) and sorted(s) == workers and "total" in str(s)
    assert full.placement["installed"] and full.lifecycle["installed"]
