"""The paged KV layout of vLLM's CPU attention, and the copies into and out of it.

The layout is the CPU attention backend's (``LBHNC``, ``vec`` kernels): per layer
``[blocks, kv_heads, block_size, 2 * head_dim]``, each head's block holding its keys
transposed (``[head_dim, block_size]``, the kernel's dot-product order) and then its
values (``[block_size, head_dim]``). vLLM documents the outer order only, so
:func:`capture_blocks` was checked against transformers' own KV of the same prompt
(``tests/test_vllm.py``). The connector (:mod:`.vllm_connector`) decides what to copy
and when; this module only copies, between those pages and our ``[L, 2, H, T, D]`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dask_kvstate.blocks import Arena, BlockKV, consecutive_view, follows

# CPU attention kernels whose paged block interior is keys transposed, then values.
PAGED_ISAS = frozenset({"vec"})


def _interior(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's paged keys ``[blocks, H, D, bs]`` and values ``[blocks, H, bs, D]``."""
    blocks, heads, size, content = layer.shape
    dim = content // 2
    halves = layer.view(blocks, heads, 2, size * dim)
    return halves[:, :, 0].view(blocks, heads, dim, size), halves[:, :, 1].view(blocks, heads, size, dim)


def capture_arena(layers: Sequence[torch.Tensor], index: Sequence[int], tokens: int) -> BlockKV:
    """The KV of the first ``tokens`` slots of paged blocks ``index`` of every layer, as
    blocks of the engine's block size laid out in one arena (what the worker stores).

    Each layer's pages go straight into their blocks of the arena (consecutive pages by one
    slice, others by ``index_select``), one copy in all: capturing a ``[L, 2, H, T, D]``
    tensor for the worker to lay out as blocks after copied the KV twice (a 4,074-token
    SmolLM2 state, 187 MB: 0.48 s more in a worker's materialize of 4.7 s).
    """
    size = layers[0].shape[2]
    whole, tail = divmod(tokens, size)
    keys0, _ = _interior(layers[0])
    heads, dim = keys0.shape[1], keys0.shape[2]
    arena = Arena.empty(len(layers), heads, dim, tokens, size, dtype=keys0.dtype, device=keys0.device)
    where = _destination(index[:whole]) if whole else None
    for number, layer in enumerate(layers):
        keys, values = _interior(layer)
        if arena.full is not None and where is not None:
            k = keys[where] if isinstance(where, slice) else keys.index_select(0, where)  # [b, H, D, bs]
            v = values[where] if isinstance(where, slice) else values.index_select(0, where)  # [b, H, bs, D]
            arena.full[:, number, 0].copy_(k.transpose(2, 3))
            arena.full[:, number, 1].copy_(v)
        if arena.tail is not None:
            block = int(index[whole])
            arena.tail[number, 0].copy_(keys[block, :, :, :tail].transpose(1, 2))
            arena.tail[number, 1].copy_(values[block, :, :tail])
    return arena.kv


def capture_blocks(layers: Sequence[torch.Tensor], index: Sequence[int], tokens: int) -> torch.Tensor:
    """:func:`capture_arena` joined into one ``[L, 2, H, tokens, D]`` tensor (a copy more)."""
    return capture_arena(layers, index, tokens).joined()


def _next_block(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether block ``b`` lies right after block ``a`` in memory, shaped alike (one run)."""
    return b.shape == a.shape and follows(a, b)


def _runs(chunks: Sequence[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """``chunks`` (whole blocks of ``[L, 2, H, bs, D]``) as ``(first, run)`` pairs, each
    ``run`` a ``[n, L, 2, H, bs, D]`` view of blocks ``first...first + n - 1``.

    As few runs as their memory allows: token slices of one joined tensor are one, and
    so are blocks lying back to back (an arena, each frame a pull arrived in); any other
    block is a run of its own.
    """
    joined = consecutive_view(chunks)
    if joined is not None:  # token slices of one [L, 2, H, T, D] tensor (a joined state)
        layers, two, heads, tokens, dim = joined.shape
        n = len(chunks)
        return [(0, joined.reshape(layers, two, heads, n, tokens // n, dim).permute(3, 0, 1, 2, 4, 5))]
    starts = [i for i in range(len(chunks)) if i == 0 or not _next_block(chunks[i - 1], chunks[i])]
    runs = []
    for first, stop in zip(starts, [*starts[1:], len(chunks)]):
        head = chunks[first]  # a block alone keeps whatever strides it has
        runs.append(
            (first, head.as_strided((stop - first, *head.shape), (head.numel(), *head.stride()), head.storage_offset()))
        )
    return runs


def _destination(ids: Sequence[int]) -> slice | torch.Tensor:
    """Paged block ids as a slice where they are consecutive, else as an index tensor.

    >>> _destination([4, 5, 6]), _destination([4, 6]).tolist()
    (slice(4, 7, None), [4, 6])
    """
    first = int(ids[0])
    if all(int(b) == first + i for i, b in enumerate(ids)):
        return slice(first, first + len(ids))
    return torch.tensor([int(b) for b in ids], dtype=torch.long)


def write_blocks(layers: Sequence[torch.Tensor], index: Sequence[int], chunks: Sequence[torch.Tensor]) -> None:
    """Write ``chunks`` (``[L, 2, H, t, D]`` each, one per paged block, all but the last
    whole) into paged blocks ``index`` of every layer.

    One copy, straight from the blocks' own memory into the engine's pages: each run of
    whole blocks (:func:`_runs`) that lands on consecutive paged blocks by one slice
    assignment per layer and half, else by one ``index_copy_``; a last partial block by
    slices. A slice is the faster copy (a 4,091-token SmolLM2 state, 179 MiB in 64-token
    blocks, on one core here: 42.5 ms against 51.0 ms), and a fresh engine hands out
    consecutive blocks. The tail slots are left as they were: the forward that follows
    writes the prompt's next tokens there before anything reads them.
    """
    size = layers[0].shape[2]
    tail = chunks[-1] if chunks and chunks[-1].shape[3] < size else None
    whole = list(chunks[:-1] if tail is not None else chunks)
    if any(c.shape[3] != size for c in whole):
        raise ValueError(
            f"KV to load has blocks of {[c.shape[3] for c in chunks]} tokens: all but the last need {size}"
        )
    runs = [(_destination(index[first : first + len(run)]), run) for first, run in (_runs(whole) if whole else [])]
    for number, layer in enumerate(layers):
        keys, values = _interior(layer)
        for where, run in runs:
            src = run[:, number]  # [n, 2, H, bs, D]
            if isinstance(where, slice):
                keys[where] = src[:, 0].transpose(2, 3)
                values[where] = src[:, 1]
            else:
                keys.index_copy_(0, where, src[:, 0].transpose(2, 3))
                values.index_copy_(0, where, src[:, 1])
        if tail is not None:
            t, block = int(tail.shape[3]), int(index[len(whole)])
            keys[block, :, :, :t].copy_(tail[number, 0].transpose(1, 2))
            values[block, :, :t].copy_(tail[number, 1])


def load_chunks(load: BlockKV, start: int, stop: int, size: int) -> list[torch.Tensor]:
    """Tokens ``start:stop`` of ``load`` (``start`` on a block boundary) as one view per
    paged block of ``size`` tokens."""
    if any(b.shape[3] != size for b in load.blocks[:-1]):  # blocks of another size: cut the joined state
        load = BlockKV.split(load.joined(), size)
    picked = list(load.blocks[start // size : -(-stop // size)])
    cut = stop - (start // size + len(picked) - 1) * size  # tokens of the last picked block to load
    if picked and cut < picked[-1].shape[3]:
        picked[-1] = picked[-1][:, :, :, :cut]
    return picked
