"""Transfer versus recompute over real links: shaped network namespaces x context length.

The same cells as :func:`dask_kvstate.bench.crossover.sweep`, but the link between the
holder and the consumer is a real TCP link through a bridge, shaped with ``htb``
(:class:`dask_kvstate.testing.hosts.Hosts`), not the in-process throttle of
``kvstate.transport.emulated-bandwidth``. Per cell: the rule carried out on a link it
has not measured yet (``first``: the probes and the cut-off at work) and again once it
has (``warm``), both forced options timed, and whether each rule run came within 1.5x
of the faster option; each repeat runs all four in turn. :func:`compare` runs the config throttle on the same cells.
"""

from __future__ import annotations

import json
import os
import statistics

import dask

import dask_kvstate as kvs
from dask_kvstate import progress, tasks
from dask_kvstate.bench import crossover, probes
from dask_kvstate.testing.hosts import Hosts, skip_reason

RATES: list[str | None] = ["10 Mbit/s", "100 Mbit/s", "1 Gbit/s", None]
CONTEXTS = [256, 1024, 4096]
#: the rule's run counts as right when it costs at most this much more than the faster option
TOLERANCE = 1.5


def median_run(runs: list[dict]) -> dict:
    """The rule run of median seconds, counting what deciding took (asking for other copies too)."""
    for d in runs:
        d["seconds"] += d.get("decide_s", 0.0)
    return sorted(runs, key=lambda d: d["seconds"])[len(runs) // 2]


def outcome(d: dict) -> str:
    """What a rule run did: pulled, recomputed at once, or probed and then recomputed."""
    if d.get("cut_off") or d.get("switched"):
        return "probe->recompute"
    return d["action"]


def cell(client, a: str, b: str, tokens_hint: int, salt: str, repeats: int) -> dict:
    """A state made on ``a`` needed on ``b``: the rule (first contact, then warm) vs both options.

    Each repeat runs all four in turn (rule on first contact, pull, recompute, rule warm),
    so a change of the machine's load between them hits every one alike; medians of the
    repeats.
    """
    ref = client.submit(tasks.materialize, crossover.context(tokens_hint, salt), workers=[a], pure=False).result()

    def run(fn, *args):
        return client.submit(fn, ref, *args, workers=[b], pure=False).result()

    firsts: list[dict] = []
    warms: list[dict] = []
    times: dict[str, list[float]] = {"pull": [], "recompute": []}
    for _ in range(repeats):
        firsts.append(run(probes.measure_rule, True))
        for action in times:
            times[action].append(run(probes.measure_fill, action))
        warms.append(run(probes.measure_rule, False))
    first, warm = median_run(firsts), median_run(warms)
    t = {action: statistics.median(v) for action, v in times.items()}
    best = min(t.values())
    faster = min(t, key=t.__getitem__)
    return {
        "tokens": ref.num_tokens,
        "mib": ref.nbytes / 2**20,
        "faster": faster,
        "t_pull": t["pull"],
        "t_recompute": t["recompute"],
        "est_recompute": warm["t_recompute"],
        "first": outcome(first),
        "first_s": first["seconds"],
        "first_chunks": first.get("chunks", []),
        "first_right": first["seconds"] <= TOLERANCE * best,
        "warm": outcome(warm),
        "warm_s": warm["seconds"],
        "warm_chunks": warm.get("chunks", []),
        "warm_right": warm["seconds"] <= TOLERANCE * best,
        "choice": warm["action"],
        "right": warm["action"] == faster,
    }


def warm_up(client, a: str, b: str) -> None:
    """One pull and one recompute of a short and a long state before the sweep, their link
    knowledge forgotten after: the first cell's runs then pay no connection set-up or
    first-call costs that later cells do not (the connection stays open throughout, as it
    does between the workers of a running cluster)."""
    for n in (256, 4096):
        ref = client.submit(tasks.materialize, crossover.context(n, "warm-up"), workers=[a], pure=False).result()
        for action in ("pull", "recompute"):
            client.submit(probes.measure_fill, ref, action, workers=[b], pure=False).result()
    client.run(_forget, a, workers=[b])


def _forget(peer: str, dask_worker) -> None:
    from dask_kvstate.protocol import WORKER_PLUGIN

    dask_worker.plugins[WORKER_PLUGIN].runtime.links.forget(peer)


def sweep(model: str, repeats: int, rates=RATES, contexts=CONTEXTS) -> dict:
    """Every cell of ``rates`` x ``contexts`` on one set of hosts (the holder's link reshaped per rate)."""
    reason = skip_reason()
    if reason:
        raise RuntimeError(f"--links netns needs network namespaces: {reason}")
    cells, fits = [], []
    bar = progress.bar(total=len(rates) * len(contexts), desc="crossover over shaped links", unit="cell")
    with Hosts(n_workers=2) as hosts, hosts.client() as client:
        kvs.install(client, model, torch_threads=1)
        a, b = hosts.workers["w0"], hosts.workers["w1"]
        warm_up(client, a, b)
        for rate in rates:
            hosts.set_rate("w0", rate)
            for n in contexts:
                c = {"rate": rate or "unshaped", **cell(client, a, b, n, f"netns {rate} {n}", repeats)}
                cells.append(c)
                bar.update()
                progress.write(
                    f"{c['rate']:>11} {c['tokens']:>5} tok {c['mib']:6.2f} MiB | pull {c['t_pull']:.4f} s, "
                    f"recompute {c['t_recompute']:.4f} s (est. {c['est_recompute']:.4f}) | rule first {c['first']} "
                    f"{c['first_s']:.4f} s {c['first_chunks']}, warm {c['warm']} {c['warm_s']:.4f} s {c['warm_chunks']}"
                )
            fitted = client.run(_fitted, a, workers=[b])[b]
            fits.append({"rate": rate or "unshaped", "fitted_bytes_per_s": fitted})
        prefills = client.run(_prefills, workers=[b])[b]
    bar.close()
    return {"cells": cells, "fits": fits, "prefills": prefills}


def _fitted(peer: str, dask_worker) -> float | None:
    from dask_kvstate.protocol import WORKER_PLUGIN

    links = dask_worker.plugins[WORKER_PLUGIN].runtime.links
    return links.per_peer.get(peer)


def _prefills(dask_worker) -> dict:
    """The consumer's prefill meter: its recent ``(missing, cached, seconds)`` and its fit."""
    from dask_kvstate.protocol import WORKER_PLUGIN

    meter = dask_worker.plugins[WORKER_PLUGIN].runtime.prefill_meter
    return {"obs": [list(o) for o in meter.obs], "coefficients": list(meter.coefficients())}


def compare(model: str, repeats: int, rates=RATES, contexts=CONTEXTS) -> dict:
    """:func:`sweep` beside the config throttle's sweep on the same cells (a fresh ``LocalCluster`` per rate)."""
    res = sweep(model, repeats, rates, contexts)
    throttle = []
    for rate in rates:
        with dask.config.set({"kvstate.transport.emulated-bandwidth": rate}), crossover.two_workers("tcp") as client:
            kvs.install(client, model, torch_threads=1)
            a, b = sorted(client.nthreads())
            for n in contexts:
                throttle.append(
                    {"rate": rate or "unshaped", **crossover.sweep_cell(client, a, b, n, f"t {rate} {n}", repeats)}
                )
    res["throttle"] = throttle
    return res


def table(res: dict) -> str:
    """The sweep as a markdown table, with the hit rates and the fitted link rates."""
    rows = [
        "| link | tokens | MiB | pull s | recompute s | recompute est. s | faster | rule, first contact | s "
        "| rule, warm | s | throttle: choice | throttle: pull s | throttle: recompute s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # both sweeps walk rates x contexts in the same order
    throttle = res.get("throttle") or [{}] * len(res["cells"])
    for c, t in zip(res["cells"], throttle):
        rows.append(
            f"| {c['rate']} | {c['tokens']} | {c['mib']:.2f} | {c['t_pull']:.4f} | {c['t_recompute']:.4f} "
            f"| {c.get('est_recompute', float('nan')):.4f} | {c['faster']} "
            f"| {c['first']}{'' if c['first_right'] else ' (>1.5x)'} | {c['first_s']:.4f} "
            f"| {c['warm']}{'' if c['warm_right'] else ' (>1.5x)'} | {c['warm_s']:.4f} "
            f"| {t.get('choice', '')}{'' if t.get('right', True) else ' (wrong)'} "
            f"| {t.get('t_pull', float('nan')):.4f} | {t.get('t_recompute', float('nan')):.4f} |"
        )
    cells = res["cells"]
    n = len(cells)
    lines = [
        "\n".join(rows),
        "",
        f"Rule within {TOLERANCE}x of the faster option: first contact {sum(c['first_right'] for c in cells)}/{n}, "
        f"warm {sum(c['warm_right'] for c in cells)}/{n}; warm choice = the faster option "
        f"{sum(c['right'] for c in cells)}/{n}.",
    ]
    if res.get("throttle"):
        t = res["throttle"]
        lines.append(
            f"Config throttle, same cells: rule's estimate picked the faster {sum(x['right'] for x in t)}/{len(t)}."
        )
    lines += ["", "| shaped link | fitted pull rate (Mbit/s) |", "|---|---|"]
    for f in res["fits"]:
        bw = f["fitted_bytes_per_s"]
        lines.append(f"| {f['rate']} | {'' if bw is None else f'{bw * 8 / 1e6:.1f}'} |")
    return "\n".join(lines) + "\n"


def write(res: dict, folder: str) -> str:
    """``cells.json`` and ``table.md`` of ``res`` in ``folder``; returns the table."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "cells.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = table(res)
    with open(os.path.join(folder, "table.md"), "w") as f:
        f.write(md)
    return md
