"""Automatic prefix caching inside one worker: the "local prefix cache" baseline.

What vLLM's automatic prefix caching and SGLang's radix cache give inside one engine:
a text-prompt generation looks up the leading blocks of its prompt in this worker's
block store by their chained hash, prefills only the rest, and leaves its own prompt
blocks behind for later calls. Nothing is pulled from other workers, no compiler
rewrites the graph, no placement steers tasks: a later call with the same prefix
profits only if Dask's default scheduling happens to run it on the same worker.

The block store and the hash chain (``dask_kvstate/blocks.py``) already do the work;
this module is the lookup-prefill-store loop around them. Cached blocks are not held by
any ref, so the store's scored eviction may drop them, as an engine's LRU would.
"""

from __future__ import annotations

import time

from dask_kvstate.blocks import join_blocks
from dask_kvstate.generation import Generation, Sampling


def generate(rt, text: str, namespace: str, sampling: Sampling) -> Generation:
    """Generate from ``text`` on runtime ``rt``, reusing and filling its local prefix cache.

    Token-identical to text replay: the reused blocks are the KV of exactly the
    prompt's leading tokens (their hashes chain over those token ids and this model).
    ``namespace`` is the calling task's (fixed by its client), so a hit is only ever
    on blocks of the same tenant.
    Raises ValueError for an empty prompt.
    """
    t0 = time.perf_counter()
    backend = rt.backend
    ids = backend.tokenize(text)
    if not ids:
        raise ValueError("cannot generate from an empty prompt: give at least one token of text")
    hashes = rt.hashes(ids, namespace)
    rt.store.pin(rt.task_owner(), hashes)  # the plugin unpins when the task ends
    present = []
    for h in hashes:
        t = rt.store.get(h)
        if t is None:
            break
        present.append(t.to(backend.device, non_blocking=True))
    rt.counters["block_hits"] += len(present)
    rt.counters["prefix_cache_hits"] += len(present)
    rt.counters["prefix_cache_misses"] += len(hashes) - len(present)
    past = join_blocks(present)
    # At least the last prompt token is re-run: its logits start decoding.
    keep = 0 if past is None else min(int(past.shape[3]), len(ids) - 1)

    def keep_prompt(cache) -> None:  # before decoding: the cache holds exactly the prompt
        if len(present) < len(hashes):
            rt.store_kv(backend.kv_from_cache(cache), hashes, len(present))

    return rt.generate_from(
        ids,
        past[:, :, :, :keep] if keep and past is not None else None,
        sampling,
        t0,
        namespace=namespace,
        on_prefill=keep_prompt,
    )
