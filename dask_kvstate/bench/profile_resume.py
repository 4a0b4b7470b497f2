"""Where a resume's time goes at long context, in process: prefill vs block join vs cache copy vs forward.

Two resume paths are timed to their first token on one backend, no cluster:
transformers' own cache (the prefix copied into a ``DynamicCache``) and the
shared-prefix path kvstate uses (the prefix read in place, ``backends/cascade.py``).
Each step's time is the best of a few runs. ``python -m dask_kvstate.bench
profile-resume`` (``examples/profile_resume.py``) runs :func:`command`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

BLOCK = 64  # tokens a block, as the stores cut them


@dataclass
class Options:
    """The model, the prefix and suffix lengths, and torch's threads."""

    model: str = field(default="smollm2-135m", metadata={"help": "the model, loaded in this process"})
    tokens: int = field(default=4096, metadata={"help": "prefix tokens (the resumed context)"})
    suffix: int = field(default=32, metadata={"help": "suffix tokens the resume prefills"})
    threads: int = field(default=1, metadata={"help": "torch threads"})


def best(f, n: int = 3) -> float:
    """The shortest of ``n`` timed calls of ``f`` (seconds).

    >>> best(lambda: None) < 1.0
    True
    """
    runs = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        runs.append(time.perf_counter() - t0)
    return min(runs)


def command(opts: Options) -> dict:
    """Time each step of both resume paths; print them and the ratios to a prefill of the whole context."""
    import torch

    from dask_kvstate.backends import load_backend
    from dask_kvstate.backends.batch import Row, generate_batch
    from dask_kvstate.blocks import join_blocks
    from dask_kvstate.generation import Sampling

    torch.set_num_threads(opts.threads)
    b: Any = load_backend(opts.model)  # the transformers backend: the cache copy timed here is its own
    ids = list(range(200, 200 + opts.tokens))  # seeded by construction: the same ids every run
    suffix = list(range(300, 300 + opts.suffix))
    t0 = time.perf_counter()
    cache, _ = b.prefill(ids)
    r = {"prefill_s": time.perf_counter() - t0}
    kv = b.kv_from_cache(cache)
    blocks = [kv[:, :, :, i : i + BLOCK].contiguous() for i in range(0, opts.tokens, BLOCK)]
    r["join_s"] = best(lambda: join_blocks(blocks))
    joined = join_blocks(blocks)
    r["cache_copy_s"] = best(lambda: b.cache_from_kv(joined))
    r["resume_forward_s"] = best(lambda: b.prefill(ids + suffix, joined))
    r["cascade_first_token_s"] = best(lambda: generate_batch(b, [Row(ids + suffix, len(ids))], joined, Sampling(1)))
    print(
        f"prefill {opts.tokens}: {r['prefill_s']:.2f} s | join {len(blocks)} blocks {r['join_s'] * 1e3:.0f} ms | "
        f"cache copy {r['cache_copy_s'] * 1e3:.0f} ms | resume forward of {opts.suffix} (incl. cache copy) "
        f"{r['resume_forward_s']:.2f} s | ratio {r['prefill_s'] / r['resume_forward_s']:.0f}x | shared-prefix resume "
        f"to first token {r['cascade_first_token_s']:.2f} s, ratio {r['prefill_s'] / r['cascade_first_token_s']:.0f}x"
    )
    return r
