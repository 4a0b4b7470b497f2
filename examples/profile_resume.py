"""Where a resume's time goes at long context, in process: prefill vs block join vs cache copy vs forward.

Two resume paths are timed to their first token: transformers' own cache (the prefix
copied into a ``DynamicCache``) and the shared-prefix path kvstate uses (the prefix
read in place, ``backends/cascade.py``).

Run: ``python examples/profile_resume.py [--model smollm2-135m] [--tokens 4096]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from dask_kvstate.backends import load_backend
from dask_kvstate.backends.batch import Row, generate_batch
from dask_kvstate.blocks import join_blocks
from dask_kvstate.generation import Sampling


def best(f, n: int = 3) -> float:
    runs = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        runs.append(time.perf_counter() - t0)
    return min(runs)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    b = load_backend(args.model)
    ids = list(range(200, 200 + args.tokens))  # seeded by construction: the same ids every run
    suffix = list(range(300, 300 + args.suffix))
    t0 = time.perf_counter()
    cache, _ = b.prefill(ids)
    r = {"prefill_s": time.perf_counter() - t0}
    kv = b.kv_from_cache(cache)
    blocks = [kv[:, :, :, i : i + 64].contiguous() for i in range(0, args.tokens, 64)]
    r["join_s"] = best(lambda: join_blocks(blocks))
    joined = join_blocks(blocks)
    r["cache_copy_s"] = best(lambda: b.cache_from_kv(joined))
    r["resume_forward_s"] = best(lambda: b.prefill(ids + suffix, joined))
    r["cascade_first_token_s"] = best(lambda: generate_batch(b, [Row(ids + suffix, len(ids))], joined, Sampling(1)))
    print(
        f"prefill {args.tokens}: {r['prefill_s']:.2f} s | join {len(blocks)} blocks {r['join_s'] * 1e3:.0f} ms | "
        f"cache copy {r['cache_copy_s'] * 1e3:.0f} ms | resume forward of {args.suffix} (incl. cache copy) "
        f"{r['resume_forward_s']:.2f} s | ratio {r['prefill_s'] / r['resume_forward_s']:.0f}x | shared-prefix resume "
        f"to first token {r['cascade_first_token_s']:.2f} s, ratio {r['prefill_s'] / r['cascade_first_token_s']:.0f}x"
    )
    return r


if __name__ == "__main__":
    main()
