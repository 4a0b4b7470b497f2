"""vLLM's CPU attention kernel on the transformers backend (``backends/cpu_attention.py``,
``backends/paged_rows.py``): the kernel against sdpa, when it is used and when not, and
prompts and sibling rows served with it against text replay and transformers' own ``generate``.

Skips, saying why, where vLLM is not installed (the ``vllm`` extra): the backend then keeps sdpa.
"""

from __future__ import annotations

import threading

import dask
import pytest
import torch
import torch.nn.functional as F

from dask_kvstate.backends.cpu_attention import CPUAttention
from dask_kvstate.backends.hf import HFBackend
from dask_kvstate.generation import Sampling

from .conftest import transformers_continuation

pytestmark = pytest.mark.needs_vllm  # vLLM's CPU attention kernel: skipped, saying why, without vLLM

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's


def sdpa(q, k, v):
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
    return out.transpose(1, 2)


def qkv(B, T, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn((B, HEADS, T, DIM), generator=g).to(dtype),
        torch.randn((B, KV_HEADS, T, DIM), generator=g).to(dtype),
        torch.randn((B, KV_HEADS, T, DIM), generator=g).to(dtype),
    )


@pytest.fixture(scope="module")
def kernel():
    kernel, why = CPUAttention.load(HEADS, KV_HEADS, DIM, torch.float32)
    assert kernel is not None, why
    return kernel


@pytest.mark.parametrize("B, T", [(1, 1), (1, 63), (1, 64), (1, 65), (2, 300), (1, 1100)])
def test_the_kernel_computes_causal_attention_as_sdpa_does(kernel, B, T):
    q, k, v = qkv(B, T)
    got = kernel.prompt(q, k, v, None)
    assert got.shape == (B, T, HEADS, DIM)
    torch.testing.assert_close(got, sdpa(q, k, v), atol=2e-5, rtol=1e-4)
    # The module's own scale is honoured.
    torch.testing.assert_close(
        kernel.prompt(q, k, v, 0.05),
        sdpa(q * (0.05 * DIM**0.5), k, v),
        atol=2e-5,
        rtol=1e-4,
    )


def test_bfloat16_too():
    kernel, why = CPUAttention.load(HEADS, KV_HEADS, DIM, torch.bfloat16)
    assert kernel is not None, why
    q, k, v = qkv(1, 200, torch.bfloat16)
    torch.testing.assert_close(kernel.prompt(q, k, v, None).float(), sdpa(q, k, v).float(), atol=3e-2, rtol=3e-2)


def test_heads_it_cannot_serve_are_refused_naming_why():
    assert CPUAttention.load(9, 3, 16, torch.float32) == (None, "head size 16 is not one vLLM's CPU kernel supports")
    kernel, why = CPUAttention.load(9, 4, 64, torch.float32)
    assert kernel is None and "do not group" in why


class Module:
    is_causal = True


def test_it_applies_only_to_a_prompt_attending_over_itself(kernel):
    q, k, v = qkv(1, 40)
    m = Module()
    assert kernel.applies_to_prompt(m, q, k, v, None, {"scaling": 0.125})
    assert kernel.applies_to_prompt(m, q, k, v, None, {"sliding_window": 40})  # a window the prompt fits in
    assert kernel.applies_to_prompt(m, q, k, v, None, {"position_ids": torch.arange(40), "use_cache": True})
    past_k = torch.cat([k, k], dim=2)
    refused = [
        (q, k, v, torch.ones(1, 1, 40, 40, dtype=torch.bool), {}),  # a mask: padding, or a window that cuts
        (q, past_k, past_k, None, {}),  # a past: the keys outnumber the queries
        (q, k, v, None, {"sliding_window": 39}),
        (q, k, v, None, {"softcap": 30.0}),
        (q, k, v, None, {"s_aux": torch.zeros(HEADS)}),
        (q, k, v, None, {"dropout": 0.1}),
        (q, k, v, None, {"is_causal": False}),  # bidirectional
        (q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), None, {}),  # not its dtype
        (q[:, :8], k, v, None, {}),  # other heads
        (q, k, v[..., :32], None, {}),  # a value narrower than the key: the kernel would read past its end
        (q, k, v, None, {"position_bias": torch.zeros(1, HEADS, 40, 40)}),  # a bias the kernel would ignore
        (q, k, v, None, {"some_new_keyword": 1}),  # unknown: the model's own attention
    ]
    for query, key, value, mask, kwargs in refused:
        assert not kernel.applies_to_prompt(m, query, key, value, mask, kwargs), kwargs or (query.shape, value.shape)
    with torch.enable_grad():  # the kernel has no backward
        assert not kernel.applies_to_prompt(m, q.clone().requires_grad_(), k, v, None, {})


def test_a_thread_of_another_team_size_gets_its_own_plan(kernel):
    """The kernel refuses a work plan made for another OpenMP team size: plans are per thread and size."""
    q, k, v = qkv(1, 130)
    want = kernel.prompt(q, k, v, None)
    got = {}

    def one_thread():
        torch.set_num_threads(1)
        got["out"] = kernel.prompt(q, k, v, None)

    t = threading.Thread(target=one_thread)
    t.start()
    t.join()
    torch.testing.assert_close(got["out"], want, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def smollm2():
    return HFBackend.load("smollm2-135m")


def test_smollm2_with_the_kernel_replays_as_transformers_generates(smollm2):
    """Text replay (the kernel's prefill) and a resume against transformers' own generate on a
    fresh model (sdpa): token for token."""
    from dask_kvstate.backends.models import load
    from dask_kvstate.bench.workload import context_text, suffix

    assert smollm2.cpu_attention is not None, smollm2.cpu_attention_note
    fresh, _ = load("smollm2-135m")
    before = smollm2.cpu_attention.calls
    for i in range(2):
        ids = smollm2.tokenize(context_text(6) + suffix(i))
        replay = smollm2.generate(ids, None, Sampling(max_new_tokens=16))
        assert replay.token_ids == transformers_continuation(fresh, ids, 16)[: len(replay.token_ids)]
        kv = smollm2.kv_from_cache(smollm2.prefill(ids[: len(ids) * 3 // 4])[0])
        assert smollm2.generate(ids, kv, Sampling(max_new_tokens=16)).token_ids == replay.token_ids
    assert smollm2.cpu_attention.calls > before
    assert smollm2.engine_stats()["vllm_attention_layers"] == smollm2.cpu_attention.calls


def test_switched_off_sdpa_stays_and_the_fingerprint_says_so(smollm2):
    with dask.config.set({"kvstate.hf.vllm-attention": False}):
        off = HFBackend.load("smollm2-135m")
    assert off.cpu_attention is None
    assert off.engine_stats()["vllm_attention"] == "kvstate.hf.vllm-attention is off"
    assert off.config_fingerprint != smollm2.config_fingerprint  # states of the two never mix
    ids = off.tokenize("The planner reads the task and writes a plan.")
    assert off.generate(ids, None, Sampling(max_new_tokens=8)).token_ids == (
        smollm2.generate(ids, None, Sampling(max_new_tokens=8)).token_ids
    )


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "phi3"])
def test_families_served_with_the_kernel_replay_as_transformers_generates(family, tmp_path_factory):
    """Tiny models at 32-dim heads (the narrowest the kernel serves); Mistral and Phi-3 with a
    sliding window, which the kernel serves only where the prompt fits in it."""
    from dask_kvstate.testing import architectures

    folder = architectures.build(family, tmp_path_factory.getbasetemp() / "kit", wide=True)
    model, _ = architectures.model(architectures.widened(architectures.FAMILIES[family]))
    backend = HFBackend.load(str(folder))
    assert backend.cpu_attention is not None, backend.cpu_attention_note
    for text in ("The planner reads the task", "The planner reads the task and writes a plan; " * 6):
        ids = backend.tokenize(text)
        before = backend.cpu_attention.calls
        replay = backend.generate(ids, None, Sampling(max_new_tokens=12))
        want = transformers_continuation(model, ids, 12)
        assert replay.token_ids == want[: len(replay.token_ids)], (family, len(ids))
        window = getattr(backend.config, "sliding_window", None)
        used = backend.cpu_attention.calls > before
        assert used == (window is None or len(ids) <= window), (family, len(ids), window)


def test_a_model_on_eager_attention_keeps_it():
    """The kernel stands in for sdpa's causal case only: eager's mask is explicit, and eager may cap logits."""
    from dask_kvstate.testing import architectures

    model, tokenizer = architectures.model(architectures.widened(architectures.FAMILIES["llama"]))
    model.set_attn_implementation("eager")
    backend = HFBackend("llama-eager", model, tokenizer)
    assert backend.cpu_attention is None
    assert backend.engine_stats()["vllm_attention"] == "the model's attention is 'eager', not sdpa"


def rows_over(backend, context: str, suffixes: list[str], keeps: list[int] | None = None):
    """The context's KV and one row per suffix keeping as much of it as it shares (or ``keeps``)."""
    from dask_kvstate.backends.base import Row
    from plugins.worker.runtime import common_prefix

    cids = backend.tokenize(context)
    prefix = backend.kv_from_cache(backend.prefill(cids)[0])
    rows = []
    for i, s in enumerate(suffixes):
        ids = backend.tokenize(context + s)
        keep = min(common_prefix(cids, ids), len(ids) - 1)  # as the runtime's resumes keep
        rows.append(Row(ids, keep if keeps is None else min(keeps[i], keep)))
    return prefix, rows


def test_sibling_rows_on_shared_pages_equal_text_replay(smollm2):
    """Rows over one prefix decode through the kernel with the prefix's full pages shared; each
    row's tokens equal text replay of its prompt. Rows keep different lengths of the prefix
    (one short of the whole by a token, one by more than a page, one inside the first page),
    and rows stop at EOS at different steps, leaving the table."""
    from dask_kvstate.backends import batch
    from dask_kvstate.bench.workload import context_text, suffix

    suffixes = [suffix(i) for i in range(5)]
    _, rows = rows_over(smollm2, context_text(6), suffixes)
    full = rows[0].keep
    assert full > 130
    prefix, rows = rows_over(smollm2, context_text(6), suffixes, [full, full, full - 1, full - 70, 20])
    assert len({r.keep for r in rows}) == 4
    sampling = Sampling(max_new_tokens=40)
    assert batch._paged(smollm2, rows)
    before = smollm2.cpu_attention.calls
    paged = batch.generate_batch(smollm2, rows, prefix, sampling)
    assert smollm2.cpu_attention.calls > before  # the kernel served the rows
    assert len({len(r.token_ids) for r in paged}) > 1, "rows should stop at different steps"
    for row, got in zip(rows, paged, strict=True):
        replay = smollm2.generate(row.ids, None, sampling)
        assert got.token_ids == replay.token_ids
        assert got.reused_tokens == row.keep


def test_a_single_row_reads_its_state_in_place(smollm2):
    """One row (a resume) is not paged: copying the state into pages would cost its first token."""
    from dask_kvstate.backends import batch
    from dask_kvstate.bench.workload import context_text, suffix

    _, rows = rows_over(smollm2, context_text(3), [suffix(0)])
    assert not batch._paged(smollm2, rows)
    own = len(rows[0].ids) - rows[0].keep
    assert batch.kv_bytes(smollm2, rows, 8) == (own + 8) * smollm2.kv_bytes_per_token


def test_paged_rows_hold_the_pages_they_count(smollm2):
    from dask_kvstate.backends import batch
    from dask_kvstate.backends.paged_rows import PagedRows, page_count
    from dask_kvstate.bench.workload import context_text, suffix

    prefix, rows = rows_over(smollm2, context_text(3), [suffix(i) for i in range(3)])
    keep = [r.keep for r in rows]
    capacity = batch._capacity(rows, 8)
    shared, own = page_count(keep, capacity)
    paged = PagedRows(smollm2.cpu_attention, prefix, keep, capacity, num_layers=smollm2.num_layers)
    held = sum(k.untyped_storage().nbytes() for k, _ in paged.pages)
    page = smollm2.kv_heads * 2 * 64 * smollm2.head_dim * 4
    assert held == batch.kv_bytes(smollm2, rows, 8) == smollm2.num_layers * (shared + 3 * own) * page
    assert shared == min(keep) // 64 and tuple(paged.table.shape) == (3, shared + own)


def test_what_the_paged_rows_do_not_compute_is_refused(kernel):
    """A window, a logit cap or sinks raise (the batch then runs row by row); plain attention
    is each row's own prefix and tokens."""
    from dask_kvstate.backends.cascade import CascadeUnsupported
    from dask_kvstate.backends.paged_rows import PagedRows

    prefix = torch.randn(1, 2, KV_HEADS, 100, DIM)
    rows = PagedRows(kernel, prefix, [100, 90], 10, num_layers=1)
    rows.begin(1)
    q, k, v = qkv(2, 1)
    for kwargs in ({"window": 50}, {"softcap": 30.0}, {"sinks": torch.zeros(HEADS)}):
        with pytest.raises(CascadeUnsupported):
            rows.attend(0, q, k, v, None, **kwargs)
    out = rows.attend(0, q, k, v, None)
    assert out.shape == (2, 1, HEADS, DIM)
    g = HEADS // KV_HEADS
    for b, kept in enumerate((100, 90)):
        keys = torch.cat([prefix[0, 0, :, :kept], k[b]], dim=1).repeat_interleave(g, 0)
        values = torch.cat([prefix[0, 1, :, :kept], v[b]], dim=1).repeat_interleave(g, 0)
        want = F.scaled_dot_product_attention(q[b], keys, values)
        torch.testing.assert_close(out[b, 0], want[:, 0], atol=2e-5, rtol=1e-4)


def test_a_reused_scratch_page_holds_nothing_of_an_earlier_prompt(kernel):
    """The kernel reads a prompt's last page whole: what an earlier, longer prompt left past this
    one's end (even NaN) must not reach the output."""
    q, k, v = qkv(1, 200)
    kernel.prompt(q, k, v, None)  # this thread's scratch now holds 4 pages
    key_pages, value_pages = kernel._scratch(4)
    key_pages.fill_(float("nan"))
    value_pages.fill_(float("nan"))
    q, k, v = qkv(1, 130, seed=1)
    torch.testing.assert_close(kernel.prompt(q, k, v, None), sdpa(q, k, v), atol=2e-5, rtol=1e-4)


def plain_attention(prefix, keep: int, own_k, own_v, query):
    """One row's attention computed plainly: its first ``keep`` prefix tokens and its own tokens
    as keys, its queries (``[heads, n, D]``) the last ``n`` of them, causal; ``[n, heads, D]``."""
    g = HEADS // KV_HEADS
    keys, values = own_k, own_v
    if prefix is not None and keep:
        keys = torch.cat([prefix[0, 0, :, :keep], own_k], dim=1)
        values = torch.cat([prefix[0, 1, :, :keep], own_v], dim=1)
    n, total = query.shape[1], keys.shape[1]
    visible = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
    out = F.scaled_dot_product_attention(
        query.float(), keys.repeat_interleave(g, 0).float(), values.repeat_interleave(g, 0).float(), attn_mask=visible
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_prefix", [True, False])
def test_paged_rows_attend_as_each_row_alone_would(dtype, with_prefix):
    """Rows keeping 0, 63, 64, 129 and 200 prefix tokens; a right-padded first forward of 3 tokens
    (the rows keep 3, 1, 2, 3 and 1 of them); decode steps; two rows leave. Each row's output
    against its own keys and values attended plainly."""
    from dask_kvstate.backends.paged_rows import PagedRows

    kernel, why = CPUAttention.load(HEADS, KV_HEADS, DIM, dtype)
    assert kernel is not None, why
    gen = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(dtype)

    prefix = rand(1, 2, KV_HEADS, 200, DIM) if with_prefix else None
    keeps = [0, 63, 64, 129, 200] if with_prefix else [0] * 5
    rows = PagedRows(kernel, prefix, keeps, 12, num_layers=1)
    live = list(range(5))
    own_k = [torch.zeros(KV_HEADS, 0, DIM, dtype=dtype) for _ in live]
    own_v = [torch.zeros(KV_HEADS, 0, DIM, dtype=dtype) for _ in live]
    tol = {"atol": 3e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 4e-2, "rtol": 4e-2}
    for step, (q, counts) in enumerate([(3, [3, 1, 2, 3, 1]), (1, None), (1, None), (1, None)]):
        if step == 2:
            rows.select([0, 2, 4])  # rows 1 and 3 stop
            live = [live[i] for i in (0, 2, 4)]
        B = len(live)
        rows.begin(q)
        query, key, value = rand(B, HEADS, q, DIM), rand(B, KV_HEADS, q, DIM), rand(B, KV_HEADS, q, DIM)
        out = rows.attend(0, query, key, value, None)
        assert out.shape == (B, q, HEADS, DIM) and out.is_contiguous()
        kept = [q] * B if counts is None else [counts[r] for r in live]
        for i, r in enumerate(live):
            own_k[r] = torch.cat([own_k[r], key[i]], dim=1)
            own_v[r] = torch.cat([own_v[r], value[i]], dim=1)
            n = kept[i]  # a pad's output is never used, and the real tokens before it never see it
            want = plain_attention(
                prefix,
                keeps[r],
                own_k[r][:, : own_k[r].shape[1] - (q - n)],
                own_v[r][:, : own_v[r].shape[1] - (q - n)],
                query[i][:, :n],
            )
            torch.testing.assert_close(out[i, :n].float(), want, **tol)
            own_k[r], own_v[r] = own_k[r][:, : own_k[r].shape[1] - (q - n)], own_v[r][:, : own_v[r].shape[1] - (q - n)]
        rows.advance(kept)
