"""Automatic prefix caching inside one worker: the "local prefix cache" baseline.

What vLLM's automatic prefix caching and SGLang's radix cache give inside one engine:
a text-prompt generation looks up the leading blocks of its prompt in this worker's
block store by their chained hash, and the leading tokens of a stored block where its
prompt parts from the chain (:mod:`.partial_match`, as SGLang's radix cache matches
tokens), prefills only the rest, and leaves its own prompt blocks behind for later
calls, with its answer's where the backend can hand them out (the next turn of a
conversation starts with them). Nothing is pulled from other workers, no compiler
rewrites the graph, no placement steers tasks: a later call with the same prefix
profits only if Dask's default scheduling happens to run it on the same worker.

The block store and the hash chain (``dask_kvstate/blocks.py``) already do the work;
this module is the lookup-prefill-store loop around them. Cached blocks are not held by
any ref, so the store's scored eviction may drop them, as an engine's LRU would.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dask_kvstate.blocks import kv_tokens
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
    whole, past = rt.stored_past(ids, hashes, namespace)
    rt.counters["prefix_cache_hits"] += whole
    rt.counters["prefix_cache_misses"] += len(hashes) - whole
    stored = whole * rt.block_tokens  # the prompt's tokens the store already holds

    def keep(cache, seq: list[int] | None = None) -> None:  # the cache holds `seq` (the prompt) from `stored` on
        seq = ids if seq is None else seq
        if len(seq) <= stored:  # the store holds them all (a whole-block prompt again, one token out)
            return
        chain = hashes if seq is ids else rt.hashes(seq, namespace)
        if seq is not ids:  # the answer's blocks too are this task's: its session keeps them (lifecycle)
            rt.store.pin_more(rt.task_owner(), chain[whole:])
        kv = backend.kv_to_store(cache, stored, rt.block_tokens)
        rt.store_kv(kv, chain, whole, first_token=len(seq) - kv_tokens(kv), ids=seq, namespace=namespace)

    hooks: dict[str, Callable] = {}
    if backend.sequence_kv:
        # The answer too: a conversation's next prompt is this one, the answer and more, so
        # its next call loads the answer's KV instead of prefilling it again.
        hooks["on_sequence"] = keep
    elif whole < len(hashes):  # only the blocks the store lacks are asked of the backend
        hooks["on_prefill"] = keep
    return rt.generate_from(
        ids,
        rt.as_past(past),
        sampling,
        t0,
        namespace=namespace,
        keep_from=stored,
        # Its reuse path, as a materialize's or a resume's (text replay, the baseline, never borrows).
        borrow=True,
        **hooks,
    )
