"""Block arenas: a prefill's blocks laid out back to back in one buffer.

vLLM keeps KV in a block pool so that a block is a fixed slice of one big tensor. We
do the same per prefill: :func:`lay_out` copies the ``[L, 2, H, T, D]`` output of a
prefill once, block-major, into one flat buffer, and every block is a contiguous
``[L, 2, H, t, D]`` view of it (the last one may be partial: it is just shorter).
That copy replaces the per-block ``.contiguous()`` copies made before, so building an
arena costs nothing extra. A backend that can write its own cache (vLLM's pages,
transformers' per-layer cache) straight into such a buffer hands the blocks over laid out
(``Backend.kv_to_store``, :class:`~dask_kvstate.blocks.Arena`), and
:func:`blocks_to_store` keeps them as they are: one copy out of the engine, not two.

Why: a pull of a state's blocks is then one run of memory, and :func:`span` finds it
by pointer arithmetic (same storage, each block starting where the previous one
ends), so the holder can hand that memory to the comm as one frame without packing
it (``serve.serve_blocks``). Blocks received in one frame are views of it in the
same way, so a puller that serves them on finds one run too.

Costs, by design: a view keeps its whole arena alive. When some blocks of an arena
spill to disk or are dropped while others stay in memory, the arena's memory is not
freed until the last of them leaves; the tier budgets (and ``dask.sizeof`` of a ref)
count each block's own bytes, so they under-count memory by the bytes of blocks that
left (:func:`overhang` reports it, ``kvs.stats`` shows it as ``arena_overhang_bytes``).
Blocks of one arena belong to one state, are used together and score alike, so they
usually spill and drop together.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from dask_kvstate.blocks import Arena, BlockKV, KVBlock, follows, nbytes


def lay_out(kv, block_tokens: int, first_token: int = 0) -> list:
    """Views of one new buffer holding ``kv[:, :, :, first_token:]`` block-major.

    ``kv`` is ``[L, 2, H, T, D]``; block ``i`` of the result covers tokens
    ``first_token + i * block_tokens`` up to ``block_tokens`` more (the last may hold
    fewer), as a contiguous ``[L, 2, H, t, D]`` tensor on ``kv``'s device and dtype.

    Examples
    --------
    >>> import torch
    >>> kv = torch.arange(2 * 2 * 1 * 5 * 3, dtype=torch.float32).reshape(2, 2, 1, 5, 3)
    >>> blocks = lay_out(kv, block_tokens=2)
    >>> [tuple(b.shape) for b in blocks]
    [(2, 2, 1, 2, 3), (2, 2, 1, 2, 3), (2, 2, 1, 1, 3)]
    >>> all(torch.equal(b, kv[:, :, :, 2 * i : 2 * i + 2]) for i, b in enumerate(blocks))
    True
    >>> span(blocks) is not None   # one run of memory
    True
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens!r}")
    if kv.dim() != 5:
        raise ValueError(f"expected a KV tensor [layers, 2, kv_heads, tokens, head_dim], got shape {tuple(kv.shape)}")
    L, _, H, T, D = kv.shape
    if T - first_token <= 0:
        return []
    arena = Arena.empty(L, H, D, T - first_token, block_tokens, dtype=kv.dtype, device=kv.device)
    for layer in range(L):
        arena.write_layer(layer, kv[layer, 0, :, first_token:], kv[layer, 1, :, first_token:])
    return list(arena.kv.blocks)


def span(tensors: Sequence):
    """The bytes of ``tensors`` as one flat uint8 CPU tensor sharing their memory, or None.

    Not None only when they are contiguous CPU tensors of one dtype in one storage,
    each starting where the previous one ends (an arena, or one received frame).
    CUDA blocks return None: they must be staged through host memory anyway.
    """
    import torch

    if not tensors:
        return None
    first = tensors[0]
    if first.device.type != "cpu" or not first.is_contiguous():
        return None
    if not all(follows(a, b) for a, b in itertools.pairwise(tensors)):
        return None
    storage = first.untyped_storage()
    base = storage.data_ptr()
    end = tensors[-1].data_ptr() + nbytes(tensors[-1])
    out = torch.empty(0, dtype=torch.uint8)
    out.set_(storage, first.data_ptr() - base, (end - first.data_ptr(),))  # type: ignore[call-overload]
    return out


def overhang(tensors: Iterable) -> int:
    """Bytes held by the storages behind ``tensors`` beyond the tensors' own bytes.

    What the tier budgets do not see: the rest of arenas (or received frames) whose
    other blocks left memory. Tensors on CUDA count the same way.

    Examples
    --------
    >>> import torch
    >>> blocks = lay_out(torch.zeros(1, 2, 1, 8, 4), block_tokens=2)   # 4 blocks of 64 bytes
    >>> overhang(blocks), overhang(blocks[:1])
    (0, 192)
    """
    storages: dict[tuple[str, int], int] = {}
    own = 0
    for t in tensors:
        s = t.untyped_storage()
        storages[(str(t.device), s.data_ptr())] = s.nbytes()
        own += nbytes(t)
    return max(0, sum(storages.values()) - own)


def split_blocks(kv, hashes: Sequence[bytes], block_tokens: int, first: int = 0, first_token: int = 0) -> list[KVBlock]:
    """Cut a sequence KV tensor ``[L, 2, H, T, D]`` (the KV of tokens ``first_token...``,
    a block boundary no later than block ``first``) into blocks ``first, first+1, ...``.

    The blocks are contiguous views of one new buffer, laid out block-major
    (:func:`lay_out`): one copy for all of them, and a pull of
    consecutive blocks is one run of memory the holder sends without packing.
    """
    total = first_token + kv.shape[3]
    assert total <= len(hashes) * block_tokens, "more tokens than hashed blocks"
    assert first_token % block_tokens == 0 and first_token <= first * block_tokens, "KV starts after its first block"
    tensors = lay_out(kv, block_tokens, first * block_tokens - first_token)
    assert len(tensors) == len(hashes) - first, f"{len(tensors)} blocks for {len(hashes) - first} hashes"
    return [KVBlock(hashes[first + i], (first + i) * block_tokens, t) for i, t in enumerate(tensors)]


def blocks_to_store(
    kv, hashes: Sequence[bytes], block_tokens: int, first: int = 0, first_token: int = 0
) -> list[KVBlock]:
    """Blocks ``first, first+1, ...`` of a state's KV, which starts at token ``first_token``
    (a block boundary no later than block ``first``): ``kv`` a ``[L, 2, H, T, D]`` tensor
    (laid out by :func:`split_blocks`) or a :class:`~dask_kvstate.blocks.BlockKV` a backend
    already laid out in one arena (its blocks kept as they are: no copy), e.g.

    >>> import torch
    >>> from dask_kvstate.blocks import Arena
    >>> arena = Arena.empty(1, 1, 2, 5, 2, dtype=torch.float32, device="cpu")
    >>> blocks = blocks_to_store(arena.kv, [b"a", b"b", b"c"], 2)
    >>> [(b.hash, b.start, b.num_tokens) for b in blocks], blocks[1].tensor is arena.kv.blocks[1]
    ([(b'a', 0, 2), (b'b', 2, 2), (b'c', 4, 1)], True)

    Blocks it would not store (here the first, stored already) are not kept alive by the
    others: those are copied into an arena of their own.

    >>> later = blocks_to_store(arena.kv, [b"a", b"b", b"c"], 2, first=1)
    >>> [b.start for b in later], later[0].tensor is arena.kv.blocks[1]
    ([2, 4], False)
    """
    if not isinstance(kv, BlockKV):
        return split_blocks(kv, hashes, block_tokens, first, first_token)
    laid_out = (
        first_token == first * block_tokens  # else blocks before would stay allocated, unstored, in the arena
        and len(kv.blocks) == len(hashes) - first
        and all(int(b.shape[3]) == block_tokens for b in kv.blocks[:-1])
        and span(kv.blocks) is not None
    )
    if not laid_out:  # blocks of another size or memory: one copy into an arena of our own
        return split_blocks(kv.joined(), hashes, block_tokens, first, first_token)
    return [KVBlock(hashes[first + i], (first + i) * block_tokens, t) for i, t in enumerate(kv.blocks)]
