"""Isolation: tenants (namespaces) share no KV block; spill files are private raw bytes.

Why namespaces matter (docs/design.md, "Tenants"): a prefix-cache hit makes the first
token come sooner, so a tenant who times its own requests could learn whether anyone
else recently sent the same prefix. Blocks are hashed with the namespace, so a hit is
only ever on one's own namespace.
"""

from __future__ import annotations

import os

import dask

import dask_kvstate as kvs

from .conftest import CONTEXT, on, stats_of
from .test_tiered_cluster import BLOCK, tight_client  # noqa: F401  (a fixture: its own cluster)

PROMPT = "Isolation check. " + CONTEXT
SUFFIX = " And then the reviewer signs off."


def test_identical_prompts_in_two_namespaces_share_no_block(client, workers):
    a, _ = workers

    def run(text, namespace):
        before = stats_of(client, a)
        with on(a):
            ref = client.compute(kvs.materialize(text, namespace=namespace)).result()
        after = stats_of(client, a)
        return ref, after["block_hits"] - before.get("block_hits", 0), after["blocks"] - before["blocks"]

    first, hits1, new1 = run(PROMPT, "tenant-a")
    other, hits2, new2 = run(PROMPT + SUFFIX, "tenant-b")  # the same leading text, another tenant
    again, hits3, new3 = run(PROMPT + SUFFIX, "tenant-a")  # the same text as tenant-b, tenant-a again

    assert hits1 == 0 and new1 == len(first.blocks)
    # Across namespaces: not one block in common, not one hit; every block prefilled anew.
    assert set(other.blocks).isdisjoint(first.blocks) and hits2 == 0 and new2 == len(other.blocks)
    assert set(again.blocks).isdisjoint(other.blocks)
    # Within a namespace: the shared prefix's full blocks are hits, only the rest is new.
    full = first.num_tokens // first.block_tokens
    assert again.blocks[:full] == first.blocks[:full] and hits3 >= full
    assert new3 == len(again.blocks) - full


def test_namespace_comes_from_the_client_config(client, workers):
    a, _ = workers
    with dask.config.set({"kvstate.namespace": "tenant-c"}), on(a):
        ref = kvs.materialize(PROMPT)  # fixed when the graph is built, on the client
    with on(a):
        default = kvs.materialize(PROMPT)
    r, d = dask.compute(ref, default)
    assert (r.namespace, d.namespace) == ("tenant-c", "default")
    assert set(r.blocks).isdisjoint(d.blocks)


async def _local_files(dask_worker) -> dict:
    import asyncio

    store = dask_worker.plugins["kvstate"].runtime.store
    await asyncio.wrap_future(store.settled())  # the spills the task's end asked for have run
    files = {}
    for root, _, names in os.walk(dask_worker.local_directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                head = f.read(4)
            files[path] = {
                "mode": os.stat(path).st_mode & 0o777,
                "head": head,
                "kv": os.path.dirname(path) == store.directory,
            }
    return {"dir_mode": os.stat(store.directory).st_mode & 0o777, "files": files}


def test_spill_files_are_0600_in_a_0700_folder_and_never_pickles(tight_client):  # noqa: F811
    client = tight_client
    kvs.install(client, "tiny-llama", torch_threads=1, device_bytes=BLOCK, host_bytes=BLOCK, disk_bytes="1GiB")
    state = client.persist(kvs.materialize(PROMPT))
    ref = state.compute()
    (seen,) = client.run(_local_files).values()
    kv_files = {p: f for p, f in seen["files"].items() if f["kv"]}
    assert len(kv_files) >= len(ref.blocks) - 2  # all but what fits in device + host went to disk
    assert seen["dir_mode"] == 0o700
    assert {f["mode"] for f in kv_files.values()} == {0o600}
    assert {f["head"] for f in kv_files.values()} == {b"KVB1"}
    # Nothing anywhere in the worker's folder is a pickle (protocol 2+ starts with 0x80).
    assert not [p for p, f in seen["files"].items() if f["head"][:1] == b"\x80"]
