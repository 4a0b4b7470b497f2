"""Transfer versus recompute on a live two-process cluster (AAFLOW+ section 6.8).

The sweep of :mod:`dask_kvstate.bench.crossover` as an asv suite: for each emulated link speed x
context length, the rule's choice, the measured pull time and the measured recompute
time, all from one run (``setup_cache``) so every cell is measured under the same
conditions. ``track_rule_right`` is 1 where the rule picked the faster option; the
target is 95% of cells. ``KVThroughput`` sets a KV pull beside Dask's own fetch of
a numpy array of the same bytes, on the same pair of workers, per comm, and beside the
same pull with the holder's zero-copy path off (packed). ``ServePath`` times the
holder's side alone: packing a pull into a reply buffer vs finding its block arena run.
"""

from __future__ import annotations

from dask_kvstate.bench import crossover, serve_path

MODEL = "tiny-llama"


class CrossoverSweep:
    params = (crossover.BANDWIDTHS, crossover.CONTEXTS)
    param_names = ["bandwidth", "context_tokens"]
    timeout = 1800

    def setup_cache(self):
        cells = crossover.sweep(MODEL, "tcp", repeats=3)
        # cells come in sweep order: bandwidths outer, contexts inner
        grid = [(bw, n) for bw in crossover.BANDWIDTHS for n in crossover.CONTEXTS]
        return dict(zip(grid, cells))

    def track_rule_right(self, cells, bandwidth, context_tokens):
        return int(cells[bandwidth, context_tokens]["right"])

    track_rule_right.unit = "right (1) / wrong (0)"

    def track_rule_chose_pull(self, cells, bandwidth, context_tokens):
        return int(cells[bandwidth, context_tokens]["choice"] == "pull")

    track_rule_chose_pull.unit = "pull (1) / recompute (0)"

    def track_pull_seconds(self, cells, bandwidth, context_tokens):
        return cells[bandwidth, context_tokens]["t_pull"]

    track_pull_seconds.unit = "s"

    def track_recompute_seconds(self, cells, bandwidth, context_tokens):
        return cells[bandwidth, context_tokens]["t_recompute"]

    track_recompute_seconds.unit = "s"


class KVThroughput:
    params = (["tcp", "tls", "ucx"], ["tiny-llama", "smollm2-135m"])
    param_names = ["protocol", "model"]
    timeout = 600

    def setup(self, protocol, model):
        if protocol == "ucx":
            try:
                import distributed_ucxx  # noqa: F401
            except ImportError:
                raise NotImplementedError("UCX comm not installed")  # asv: skip this combination
        import dask_kvstate as kvs

        with crossover.two_workers(protocol) as client:
            kvs.install(client, model, torch_threads=1)
            a, b = sorted(client.scheduler_info()["workers"])
            self.result = crossover.throughput(client, a, b, 64 * 2**20, packed=True)

    def track_kv_pull_mib_per_s(self, protocol, model):
        return self.result["mib"] / self.result["kv_s"]

    track_kv_pull_mib_per_s.unit = "MiB/s"

    def track_dask_fetch_mib_per_s(self, protocol, model):
        return self.result["mib"] / self.result["raw_s"]

    track_dask_fetch_mib_per_s.unit = "MiB/s"

    def track_kv_vs_dask_ratio(self, protocol, model):
        return self.result["ratio"]

    track_kv_vs_dask_ratio.unit = "KV pull / Dask fetch throughput"

    def track_kv_packed_vs_dask_ratio(self, protocol, model):
        return self.result["packed_ratio"]

    track_kv_packed_vs_dask_ratio.unit = "KV pull with zero-copy off / Dask fetch throughput"


class ServePath:
    """The holder's work for a 64 MiB pull of SmolLM2-shaped blocks, in one process."""

    def setup(self):
        from dask_kvstate.plugins.worker.block_store import TieredBlockStore
        from dask_kvstate.plugins.worker.packing import PackingBuffers

        self.hashes, blocks = serve_path.smollm2_blocks(64)
        self.store = TieredBlockStore(device_bytes=2**31, host_bytes=2**31, disk_bytes=2**31, device="cpu")
        for h, t in zip(self.hashes, blocks):
            self.store.put(h, t)
        self.buffers = PackingBuffers(keep_bytes=2**28)

    def teardown(self):
        self.store.close()

    def time_serve_packed(self):
        from dask_kvstate.plugins.worker.serve import serve_blocks

        reply = serve_blocks(self.store, self.hashes, self.buffers, zero_copy=False)
        self.buffers.release(reply["frames"][0].data)  # as the comm does once it has written the reply

    def time_serve_zero_copy(self):
        from dask_kvstate.plugins.worker.serve import serve_run

        serve_run(self.store, self.hashes)
