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

import traceback

from dask_kvstate.bench import crossover, serve_path

from . import common

MODEL = "tiny-llama"
STATE_BYTES = 32 * 2**20
STATE_TOKENS = 4096


class CrossoverSweep:
    params = (crossover.BANDWIDTHS, crossover.CONTEXTS)
    param_names = ["bandwidth", "context_tokens"]
    timeout = 600

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
    """KV pull vs Dask's fetch of the same bytes, per comm and model (``crossover.throughput``).

    Every cell is measured in ``setup_cache``: one two-worker cluster per comm, each
    model installed on it in turn, so the run starts a cluster per comm rather than
    per benchmark and parameter. The state is :data:`STATE_BYTES` (32 MiB: 728 SmolLM2
    tokens, whose prefill is most of a comm's time), or :data:`STATE_TOKENS` tokens
    where that would not fit the model's positions (tiny-llama's 512 bytes a token
    would take 65,536 tokens, 8 times its 8,192 positions: a prefill of minutes).
    """

    params = (list(common.COMMS), ["tiny-llama", "smollm2-135m"])
    param_names = ["protocol", "model"]
    timeout = 420

    def setup_cache(self):
        import dask_kvstate as kvs
        from dask_kvstate.bench import workload

        cells = {}
        for protocol in self.params[0]:
            reason = common.missing(common.COMMS[protocol])
            if reason:
                cells.update({(protocol, m): {"skip": reason} for m in self.params[1]})
                continue
            try:
                with crossover.two_workers(protocol) as client:
                    for model in self.params[1]:
                        kvs.install(client, model, torch_threads=1)
                        a, b = sorted(client.nthreads())
                        nbytes = min(STATE_BYTES, STATE_TOKENS * workload.kv_bytes_per_token(client))
                        cells[protocol, model] = crossover.throughput(client, a, b, nbytes, packed=True)
            except Exception:  # one comm's failure fails its cells, not the other comms'
                error = traceback.format_exc()
                cells.update({(protocol, m): {"error": error} for m in self.params[1] if (protocol, m) not in cells})
        return cells

    def setup(self, cells, protocol, model):
        cell = cells[protocol, model]
        if "skip" in cell:
            raise NotImplementedError(cell["skip"])  # asv: skip this combination
        if "error" in cell:
            raise RuntimeError(f"measuring {protocol} with {model} failed:\n{cell['error']}")

    def track_kv_pull_mib_per_s(self, cells, protocol, model):
        cell = cells[protocol, model]
        return cell["mib"] / cell["kv_s"]

    track_kv_pull_mib_per_s.unit = "MiB/s"

    def track_dask_fetch_mib_per_s(self, cells, protocol, model):
        cell = cells[protocol, model]
        return cell["mib"] / cell["raw_s"]

    track_dask_fetch_mib_per_s.unit = "MiB/s"

    def track_kv_vs_dask_ratio(self, cells, protocol, model):
        return cells[protocol, model]["ratio"]

    track_kv_vs_dask_ratio.unit = "KV pull / Dask fetch throughput"

    def track_kv_packed_vs_dask_ratio(self, cells, protocol, model):
        return cells[protocol, model]["packed_ratio"]

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
