"""The architecture conformance kit: every operator path of every family, token for token.

For each family of :mod:`dask_kvstate.testing.architectures` (a tiny random model saved
as a folder) and each way the library can produce a generation (text replay, resume on
the holder and on another worker, fork, transfer, extend, batched resume, merge, recompute
for an evicted, an incompatible and an unreachable state, the disk tier, the compiler, the
prefix cache), the greedy tokens must equal transformers' own
``model.generate(do_sample=False)`` of the same full prompt, and seeded sampling from a
batch must equal seeded text replay. The shared prefix (~190 tokens) crosses twelve
16-token blocks and every 24-token sliding window, and ends inside a word ("The plan" +
"ner ..."), so each state's last token is re-cut at run time. Each test also checks that
the path it names really ran (blocks reused, pulled, batched, spilled, recomputed), so no
path passes by quietly falling back to another. Each test uses a namespace of its own: no
test reuses another's blocks.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import dask
import pytest
from distributed import Client, LocalCluster, wait

import dask_kvstate as kvs
from dask_kvstate.protocol import WORKER_PLUGIN
from dask_kvstate.testing import architectures
from dask_kvstate.testing.shapes import SYSTEM

from .conftest import CONTEXT, TEST_CONFIG, kv_cluster, on, stats_of

FAMILIES = sorted(architectures.FAMILIES)
PREFIX = SYSTEM + CONTEXT + "The plan"  # ~190 tokens, ending mid-word
SUFFIXES = ("ner speaks. Verdict:", "ets align. Verdict:", "t grows. Verdict:")
N = 10  # new tokens per generation
# Tier budgets for the spill test: a couple of blocks of any family per tier, so a state goes to disk.
TIGHT = {"device_bytes": 24 * 1024, "host_bytes": 24 * 1024, "disk_bytes": "1GiB"}
# A holder that never answers is given up on sooner than the default, so the unreachable-holder
# test costs ~1 s a family; live peers on one machine connect in milliseconds.
CONFIG = {**TEST_CONFIG, "kvstate.transport.connect-timeout": "1s"}

every_family = pytest.mark.parametrize("family", FAMILIES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("architectures")
    return {name: str(folder) for name, folder in architectures.build_all(root).items()}


@pytest.fixture(scope="module")
def kv_cluster_client(folders):
    """Two worker processes serving every family at once, as one install of several models does.

    One block store holds every model's blocks (kept apart by model fingerprint), and models
    of different attention implementations (GPT-OSS runs eager, Gemma2 too on newer transformers, the others sdpa) share each
    worker process: what one model's setup registers with transformers must not change another's.
    """
    with kv_cluster(CONFIG, model=list(folders.values())) as client:
        yield client


@pytest.fixture
def kv(kv_cluster_client):
    # Two clusters live in this module: plain dask.compute must go to the one the test names.
    with kv_cluster_client.as_current():
        yield kv_cluster_client


@pytest.fixture
def kv_workers(kv):
    return sorted(kv.nthreads())


@pytest.fixture
def tight(tight_cluster_client):
    with tight_cluster_client.as_current():
        yield tight_cluster_client


@pytest.fixture(scope="module")
def tight_cluster_client(folders, tmp_path_factory):
    """One worker process whose device and host tiers hold a couple of blocks: states live on disk."""
    local = str(tmp_path_factory.mktemp("tight"))
    with kv_cluster(TEST_CONFIG, list(folders.values()), n_workers=1, install=TIGHT, local_directory=local) as client:
        yield client


@functools.cache
def _reference_model(folder: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(folder, local_files_only=True)


@functools.cache
def _expected(folder: str, text: str, n: int) -> tuple[int, ...]:
    import torch

    model, tok = _reference_model(folder)
    ids = tok(text, return_tensors="pt").input_ids  # what a user hands model.generate
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return tuple(out[0, ids.shape[1] :].tolist())


def prompt_tokens(folder: str, text: str) -> int:
    return len(_reference_model(folder)[1](text).input_ids)


def want(folder: str, *segments: str, n: int = N) -> list[int]:
    """transformers' greedy continuation of ``"".join(segments)``: the answer every path must give."""
    return list(_expected(folder, "".join(segments), n))


def cascade_fallbacks(client, model: str) -> int:
    """Batched calls of ``model`` that ran a resume per row instead of cascade attention (all workers)."""

    def count(dask_worker):
        return sum(dask_worker.plugins[WORKER_PLUGIN].runtimes[model].backend.cascade_fallbacks.values())

    return sum(client.run(count).values())


def fused(client, model: str) -> bool:
    """Whether ``model``'s batches run cascade attention (else its own attention row by row:
    its attention is not routable, or reads other than what it caches, as MLA's)."""
    flags = client.run(lambda dask_worker: dask_worker.plugins[WORKER_PLUGIN].runtimes[model].backend.cascade)
    assert len(set(flags.values())) == 1, flags
    return next(iter(flags.values()))


def check_batch_path(client, model: str, fallbacks_before: int, batches: int = 1) -> None:
    """The batch ran as one fused batch where the model's attention allows it, else per row, counted."""
    if fused(client, model):
        assert cascade_fallbacks(client, model) == fallbacks_before  # one fused batch, not a resume per row
    else:
        assert cascade_fallbacks(client, model) == fallbacks_before + batches


def total(client, counter: str) -> int:
    return sum(s.get(counter, 0) for s in kvs.stats(client).workers.values())


@every_family
def test_text_replay(kv, folders, family):
    m, window = folders[family], architectures.FAMILIES[family].window
    assert window is None or prompt_tokens(m, PREFIX) > 4 * window  # the prefix crosses the window several times
    outs = dask.compute(*[kvs.generate(PREFIX, s, max_new_tokens=N, model=m) for s in SUFFIXES])
    assert [o.token_ids for o in outs] == [want(m, PREFIX, s) for s in SUFFIXES]
    assert [o.prompt_tokens for o in outs] == [prompt_tokens(m, PREFIX + s) for s in SUFFIXES]  # BOS and all
    assert all(o.reused_tokens == 0 for o in outs)


@every_family
def test_resume_on_the_holder(kv, kv_workers, folders, family):
    m, (a, _) = folders[family], kv_workers
    with on(a):
        state = kvs.materialize(PREFIX, model=m, namespace="holder")
        outs = [kvs.resume(state, s, max_new_tokens=N) for s in SUFFIXES]
    got = dask.compute(*outs)
    assert [g.token_ids for g in got] == [want(m, PREFIX, s) for s in SUFFIXES]
    assert all(g.reused_tokens > 0 for g in got)


@every_family
def test_fork_and_resume_on_both_workers(kv, kv_workers, folders, family):
    m, (a, b) = folders[family], kv_workers
    before = stats_of(kv, b)
    with on(a):
        state = kvs.materialize(PREFIX, model=m, namespace="fork")
        kids = kvs.fork(state, 2)
        here = kvs.resume(kids[0], SUFFIXES[0], max_new_tokens=N)
    with on(b):
        there = kvs.resume(kids[1], SUFFIXES[1], max_new_tokens=N)
    ref, h, t = dask.compute(state, here, there)
    after = stats_of(kv, b)
    assert [h.token_ids, t.token_ids] == [want(m, PREFIX, SUFFIXES[0]), want(m, PREFIX, SUFFIXES[1])]
    assert h.reused_tokens > 0 and t.reused_tokens > 0
    assert after.get("transfers", 0) - before.get("transfers", 0) == len(ref.blocks)  # pulled, not recomputed
    assert after.get("recomputes", 0) == before.get("recomputes", 0)


@every_family
def test_transfer_then_resume(kv, kv_workers, folders, family):
    m, (a, b) = folders[family], kv_workers
    with on(a):
        state = kvs.materialize(PREFIX, model=m, namespace="transfer")
    moved = kvs.transfer(state, b)
    with on(b):
        out = kvs.resume(moved, SUFFIXES[2], max_new_tokens=N)
    ref, mv, got = dask.compute(state, moved, out)
    assert (ref.placement.worker, mv.placement.worker) == (a, b) and mv.blocks == ref.blocks
    assert got.token_ids == want(m, PREFIX, SUFFIXES[2]) and got.reused_tokens > 0


@every_family
def test_extend_mid_word_equals_prefill_of_the_whole_text(kv, folders, family):
    m = folders[family]
    state = kvs.extend(kvs.materialize(PREFIX, model=m, namespace="extend"), SUFFIXES[0])
    whole = kvs.materialize(PREFIX + SUFFIXES[0], model=m, namespace="extend")
    out = kvs.resume(state, " Answer:", max_new_tokens=N)
    ext, direct, got = dask.compute(state, whole, out)
    assert ext.blocks == direct.blocks and ext.num_tokens == direct.num_tokens
    assert got.token_ids == want(m, PREFIX, SUFFIXES[0], " Answer:") and got.reused_tokens > 0


@every_family
def test_resume_many_batched_over_the_shared_prefix(kv, kv_workers, folders, family):
    m, (a, _) = folders[family], kv_workers
    with on(a):
        state = kvs.materialize(PREFIX, model=m, namespace="batch")
        batch = kvs.resume_many(state, list(SUFFIXES), max_new_tokens=N)
    before, fallbacks = stats_of(kv, a).get("resume_batches", 0), cascade_fallbacks(kv, m)
    got = dask.compute(*batch)
    assert [g.token_ids for g in got] == [want(m, PREFIX, s) for s in SUFFIXES]
    assert all(g.reused_tokens > 0 for g in got)
    assert stats_of(kv, a).get("resume_batches", 0) == before + 1
    check_batch_path(kv, m, fallbacks)


@every_family
def test_seeded_sampling_batched_equals_text_replay(kv, kv_workers, folders, family):
    """Sampling sees the logits' scale (softcaps, logit scales), which greedy choices never do."""
    m, (a, _) = folders[family], kv_workers
    sampling = {"max_new_tokens": N, "temperature": 0.8, "seed": 11}
    with on(a):
        state = kvs.materialize(PREFIX, model=m, namespace="sampled")
        batch = kvs.resume_many(state, list(SUFFIXES), **sampling)
    replay = [kvs.generate(PREFIX, s, model=m, **sampling) for s in SUFFIXES]
    got, want_ = dask.compute(batch, replay)
    assert [g.token_ids for g in got] == [w.token_ids for w in want_]
    assert all(g.reused_tokens > 0 for g in got)


@every_family
def test_merge_equals_prefill_of_the_concatenation(kv, folders, family):
    m = folders[family]
    first = kvs.materialize(PREFIX, model=m, namespace="merge")
    second = kvs.extend(first, SUFFIXES[1])
    merged = kvs.merge(first, second)
    out = kvs.resume(merged, " Next:", max_new_tokens=N)
    mg, sc, got = dask.compute(merged, second, out)
    assert mg.blocks == sc.blocks and mg.lineage.op == "merge"
    assert got.token_ids == want(m, PREFIX, SUFFIXES[1], " Next:") and got.reused_tokens > 0


@every_family
def test_evicted_state_is_recomputed(kv, kv_workers, folders, family):
    m, (a, _) = folders[family], kv_workers
    with on(a):
        state = kvs.materialize(PREFIX, model=m, namespace="evict").persist()
    ref = state.compute()
    assert kvs.evict(state).compute() == ref.nbytes
    before = total(kv, "recomputes")
    got = kv.compute(kvs.resume(state, SUFFIXES[0], max_new_tokens=N)).result()
    assert got.token_ids == want(m, PREFIX, SUFFIXES[0])
    assert total(kv, "recomputes") > before


@every_family
def test_incompatible_state_is_never_reused(kv, folders, family):
    m = folders[family]
    ref = kv.compute(kvs.materialize(PREFIX, model=m, namespace="alien")).result()
    alien = replace(ref, config="c-from-another-model")
    before = total(kv, "incompatible")
    got = kv.compute(kvs.resume(alien, SUFFIXES[2], max_new_tokens=N)).result()
    assert got.token_ids == want(m, PREFIX, SUFFIXES[2]) and got.reused_tokens == 0
    assert total(kv, "incompatible") == before + 1


@every_family
def test_state_of_an_unreachable_holder_is_recomputed(kv, kv_workers, folders, family):
    m, (a, b) = folders[family], kv_workers
    with on(a):
        ref = kvs.materialize(PREFIX, model=m, namespace="gone").compute()
    gone = replace(ref, placement=replace(ref.placement, worker="tcp://127.0.0.1:9"))  # nothing listens there
    before = stats_of(kv, b)
    with on(b):
        got = kvs.resume(gone, SUFFIXES[0], max_new_tokens=N).compute()
    after = stats_of(kv, b)
    assert got.token_ids == want(m, PREFIX, SUFFIXES[0])
    assert after.get("recomputes", 0) > before.get("recomputes", 0)


async def _spills_done(dask_worker) -> None:
    import asyncio

    await asyncio.wrap_future(dask_worker.plugins[WORKER_PLUGIN].runtime.store.settled())


@every_family
def test_blocks_spilled_to_disk_and_back(tight, folders, family):
    m = folders[family]
    (w,) = tight.nthreads()
    before = kvs.stats(tight).workers[w]
    state = tight.persist(kvs.materialize(PREFIX, model=m, namespace="spill"))
    wait(state)
    tight.run(_spills_done)  # the spills the materialize's end asked for have run: its blocks are on disk
    got = tight.compute(kvs.resume(state, SUFFIXES[1], max_new_tokens=N)).result()
    after = kvs.stats(tight).workers[w]
    assert got.token_ids == want(m, PREFIX, SUFFIXES[1]) and got.reused_tokens > 0
    assert after["tiers"]["host"]["spills"] > before["tiers"]["host"]["spills"]  # it went to disk
    assert after["tiers"]["disk"]["hits"] > before["tiers"]["disk"]["hits"]  # and came back
    assert after.get("recomputes", 0) == before.get("recomputes", 0)
    del state


@every_family
def test_compiler_rewrites_shared_prefix_generates(kv, folders, family):
    m = folders[family]
    calls = [kvs.generate(PREFIX, s, max_new_tokens=N, model=m, namespace="compiler") for s in SUFFIXES]
    assert kvs.explain(*calls).plan.states, "the compiler found no shared prefix"
    batched, fallbacks = total(kv, "batched_resumes"), cascade_fallbacks(kv, m)
    with kvs.stateflow():
        got = dask.compute(*calls)
    assert [g.token_ids for g in got] == [want(m, PREFIX, s) for s in SUFFIXES]
    assert all(g.reused_tokens > 0 for g in got)
    # The siblings became one batched resume over the shared state, decoded by cascade attention.
    assert total(kv, "batched_resumes") == batched + len(SUFFIXES)
    check_batch_path(kv, m, fallbacks)


@every_family
def test_prefix_cache(kv, kv_workers, folders, family):
    m, (a, _) = folders[family], kv_workers
    with on(a):
        first = kvs.generate(PREFIX, SUFFIXES[0], max_new_tokens=N, model=m, prefix_cache=True, namespace="apc")
    f = first.compute()
    with on(a):
        second = kvs.generate(PREFIX, SUFFIXES[1], max_new_tokens=N, model=m, prefix_cache=True, namespace="apc")
    s = second.compute()
    assert f.token_ids == want(m, PREFIX, SUFFIXES[0]) and f.reused_tokens == 0
    assert s.token_ids == want(m, PREFIX, SUFFIXES[1]) and s.reused_tokens > 0


@pytest.mark.parametrize("family", sorted(architectures.UNSUPPORTED))
def test_unsupported_models_are_refused_at_install(tmp_path, family):
    """A ValueError naming the model type, and no worker left holding a plugin that failed to set up."""
    folder = str(architectures.build(family, tmp_path))
    with dask.config.set(TEST_CONFIG):
        with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as c:
            with pytest.raises(ValueError, match=rf"model type {family!r}"):
                kvs.install(c, folder, torch_threads=1)
            assert not any(c.run(lambda dask_worker: WORKER_PLUGIN in dask_worker.plugins).values())
