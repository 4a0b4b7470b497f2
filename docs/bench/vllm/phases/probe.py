"""Where the 16-agent wall goes: the shared state's prefill, then the siblings' resumes.

    .venv/bin/python docs/bench/vllm/phases/probe.py > docs/bench/vllm/phases/probe.log

Two workers, both engines given both cores (kvstate.vllm.share-cores on, the default),
SmolLM2, L = 4,096, 16 agents, 64 new tokens: the state made on the first worker, its
16 siblings resumed either 8 + 8 on both workers or all 16 on the holder (the other
engine idle), two rounds each from cold stores and engine caches. Outputs are checked
against replay by the bench and tests, not here.
"""

import os
import statistics
import time

import dask
from distributed import wait

import dask_kvstate as kvs
from dask_kvstate.bench import workload
from dask_kvstate.bench.vllm_rows import _cluster, _reset, on


def run(client, workers, context, label):
    sfx = [workload.suffix(i) for i in range(16)]
    for rep in range(2):
        _reset(client)
        t0 = time.perf_counter()
        with on(workers[0]):
            st = client.persist(kvs.materialize(context))
        wait(st)
        t1 = time.perf_counter()
        outs = []
        for j, w in enumerate(workers):
            with on(w):
                outs += kvs.resume_many(st, sfx[j :: len(workers)], max_new_tokens=64)
        got = dask.compute(*outs)
        t2 = time.perf_counter()
        ttft = statistics.median(g.ttft for g in got)
        print(f"{label} {rep} materialize {t1 - t0:.2f}s resume {t2 - t1:.2f}s total {t2 - t0:.2f}s ttft med {ttft:.2f}")
        del st, outs, got  # the state's last references: the next round's reset empties it


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    both = os.sched_getaffinity(0)
    cluster, client, workers = _cluster(2, [both, both])
    context = workload.contexts(client, [4096])[4096]
    run(client, workers, context, "two engines shared")
    run(client, workers[:1], context, "one of two engines (other idle)")
    client.close()
    cluster.close()
