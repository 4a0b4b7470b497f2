"""What every backend must do the same way, checked on a loaded one.

:func:`check_backend_conformance` runs the same small behavioural checks on any
:class:`~dask_kvstate.backends.base.Backend`, so a new engine is held to what the worker
runtime relies on rather than to what the transformers backend happens to do: the
members are there; text survives a tokenize / detokenize round trip; a prefill's KV has
the shape and size the backend declares; greedy output with a resumed state, in either
KV form, and in a batch, equals text replay token for token; text replay equals the
model's own ``model.generate`` where the model is in process; stats, the engine hooks and
``close`` raise nothing. The tests call it on the tiny test model and on the started vLLM
engine; it needs no cluster.
"""

from __future__ import annotations

from dask_kvstate import config
from dask_kvstate.backends.base import Backend, GenerationResult, Row
from dask_kvstate.blocks import BlockKV, kv_tokens
from dask_kvstate.generation import Sampling

#: A prompt that plain-text tokenizers round-trip, longer than a block, so a state spans several.
TEXT = "The state of a shared prefix is computed once and reused by every agent that continues it. " * 6
#: What the second row of the batch check adds to :data:`TEXT`.
MORE = "Each agent then adds a question of its own."


def check_backend_conformance(backend: Backend, *, new_tokens: int = 4, close: bool = False) -> None:
    """Raise AssertionError, naming the check, where ``backend`` differs from the interface.

    Greedy decoding of ``new_tokens`` tokens. ``close`` also closes the backend at the end
    (leave it off for an engine the caller goes on using). Resets the engine's own prefix
    cache before each generation it compares, so a resume really loads the state.
    """
    _members(backend)
    ids = _text(backend)
    kv = _prefill(backend, ids)
    greedy = Sampling(max_new_tokens=new_tokens, temperature=0.0)
    replay = _generate(backend, ids, None, greedy)
    _against_model(backend, ids, replay, new_tokens)
    _resume(backend, ids, kv, greedy, replay)
    _batch(backend, ids, kv, greedy)
    _engine(backend)
    if close:
        backend.close()


def _members(backend: Backend) -> None:
    assert isinstance(backend, Backend), f"{type(backend).__name__} lacks members of the Backend protocol"
    assert isinstance(backend.name, str) and backend.name, "name: the model name it was loaded under"
    for field in ("num_layers", "kv_heads", "head_dim", "kv_bytes_per_token", "vocab_size"):
        value = getattr(backend, field)
        assert isinstance(value, int) and value > 0, f"{field} must be a positive int, got {value!r}"
    want = backend.num_layers * 2 * backend.kv_heads * backend.head_dim * backend.dtype.itemsize
    assert backend.kv_bytes_per_token == want, f"kv_bytes_per_token {backend.kv_bytes_per_token}, its shape says {want}"
    assert backend.layout.num_layers == backend.num_layers, "layout: one kind per layer"
    assert backend.model_fingerprint and backend.config_fingerprint, "fingerprints: the identity of its KV"
    assert isinstance(backend.kv_identity, bytes) and backend.kv_identity, "kv_identity: what block hashes fold in"
    assert isinstance(backend.reads_blocks, bool) and isinstance(backend.elastic_threads, bool)
    assert all(isinstance(t, int) for t in backend.eos_ids), "eos_ids: token ids"


def _text(backend: Backend) -> list[int]:
    ids = backend.tokenize(TEXT)
    assert ids and all(isinstance(t, int) and 0 <= t < backend.vocab_size for t in ids), "tokenize: ids in the vocab"
    assert backend.detokenize(ids) == TEXT, f"detokenize(tokenize(text)) gave {backend.detokenize(ids)!r}"
    return ids


def _prefill(backend: Backend, ids: list[int]):
    import torch

    out = backend.prefill(ids)
    assert isinstance(out, tuple) and len(out) == 2, "prefill returns (cache, last_logits)"
    cache, logits = out
    assert logits is None or logits.dim() == 1, "prefill's logits: the last position's, one row"
    kv = backend.kv_from_cache(cache)
    want = (backend.num_layers, 2, backend.kv_heads, len(ids), backend.head_dim)
    assert tuple(kv.shape) == want, f"prefill's KV is {tuple(kv.shape)}, the backend declares {want}"
    assert kv.dtype == backend.dtype, f"prefill's KV is {kv.dtype}, the backend declares {backend.dtype}"
    assert kv.device.type == backend.device.type, f"prefill's KV is on {kv.device}, the backend on {backend.device}"
    # From a later token on: that token's KV or earlier's, ending where the whole does
    start = len(ids) // 2
    tail = backend.kv_from_cache(cache, start)
    assert len(ids) - start <= tail.shape[3] <= len(ids), f"kv_from_cache(cache, {start}) has {tail.shape[3]} tokens"
    assert torch.equal(tail, kv[:, :, :, len(ids) - tail.shape[3] :]), "kv_from_cache(cache, start): the cache's tail"
    # The form the worker stores: the same KV, as a tensor or as blocks of the block size
    size = getattr(backend, "block_tokens", 4)
    stored = backend.kv_to_store(cache, 0, size)
    if isinstance(stored, BlockKV):
        sizes = [int(b.shape[3]) for b in stored.blocks]
        assert all(n == size for n in sizes[:-1]), f"kv_to_store's blocks hold {sizes} tokens, not {size} each"
        stored = stored.joined()
    assert torch.equal(stored, kv), "kv_to_store(cache, 0, ...): the KV kv_from_cache gives"
    return kv


def _generate(backend: Backend, ids: list[int], past, sampling: Sampling) -> GenerationResult:
    backend.reset_engine_cache()  # what the engine kept of an earlier call would hide a load
    res = backend.generate(ids, past, sampling)
    assert isinstance(res, GenerationResult), f"generate returns a GenerationResult, got {type(res).__name__}"
    reused = 0 if past is None else kv_tokens(past)
    assert res.reused_tokens == reused, f"generate reused {res.reused_tokens} tokens of a {reused}-token state"
    assert res.prefill_tokens == len(ids) - reused, f"generate computed {res.prefill_tokens} prompt tokens"
    n = len(res.token_ids)
    assert n == sampling.max_new_tokens or (n and res.token_ids[-1] in backend.eos_ids), "generate: stop at EOS"
    assert res.ttft >= 0 and res.prefill_s >= 0 and res.decode_s >= 0, "generate's timings"
    return res


def _against_model(backend: Backend, ids: list[int], replay: GenerationResult, new_tokens: int) -> None:
    """Text replay against the model's own ``generate`` (only where the model runs in this process)."""
    if backend.model is None:
        return
    import torch

    x = torch.tensor([ids], device=backend.device)
    with torch.inference_mode():
        ref = backend.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False)
    want = ref[0, len(ids) :].tolist()
    assert replay.token_ids == want[: len(replay.token_ids)], f"replay {replay.token_ids}, model.generate {want}"


def _resume(backend: Backend, ids: list[int], kv, greedy: Sampling, replay: GenerationResult) -> None:
    past = kv[:, :, :, : len(ids) - 1]
    forms = {"one tensor": past, "blocks": BlockKV.split(past, int(config.get("block-tokens")))}
    for form, state in forms.items():
        got = _generate(backend, ids, state, greedy).token_ids
        assert got == replay.token_ids, f"resume from {form}: {got}, text replay {replay.token_ids}"


def _batch(backend: Backend, ids: list[int], kv, greedy: Sampling) -> None:
    other = backend.tokenize(TEXT + MORE)
    shared = next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))
    keep = min(shared, len(ids) - 1, len(other) - 1)
    rows = [Row(ids, keep), Row(other, keep)]
    want = [_generate(backend, r.ids, None, greedy).token_ids for r in rows]
    backend.reset_engine_cache()
    results = backend.generate_batch(rows, kv[:, :, :, :keep], greedy, started=0.0)
    assert len(results) == len(rows), f"generate_batch: one result per row, got {len(results)} for {len(rows)}"
    got = [r.token_ids for r in results]
    assert got == want, f"generate_batch: {got}, each row's text replay {want}"


def _engine(backend: Backend) -> None:
    stats = backend.engine_stats()
    assert isinstance(stats, dict) and "engine" in stats, f"engine_stats names the engine, got {stats!r}"
    assert isinstance(backend.reset_engine_cache(), bool), "reset_engine_cache returns whether it reset"
    backend.on_engine_death(lambda error: None)  # registering a hook is always allowed
