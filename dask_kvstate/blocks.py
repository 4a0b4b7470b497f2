"""KV blocks: fixed runs of tokens, named by a content hash chained over their prefix.

A block holds K and V for every layer over ``block_tokens`` consecutive tokens, as one
tensor ``[layers, 2, kv_heads, tokens, head_dim]``. Its name is

    hash_i = H(hash_{i-1} || kv_identity || namespace || token_ids_i)

as vLLM names prefix blocks: equal token prefixes under the same model give equal hash
chains, so forks and independent materializations of one prefix dedupe by themselves,
while a different model, dtype, tokenizer or namespace (tenant) never collides.
The last block of a state may be partial; its hash covers exactly its tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # for annotations only: this module never imports torch, so the scheduler need not
    import torch

HASH_BYTES = 16


def kv_identity(model_fingerprint: str, config_fingerprint: str) -> bytes:
    """The part of every block hash that pins it to one model and one KV layout."""
    return hashlib.blake2b(f"{model_fingerprint}|{config_fingerprint}".encode(), digest_size=HASH_BYTES).digest()


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    *,
    identity: bytes,
    namespace: str,
    block_tokens: int,
) -> tuple[bytes, ...]:
    """Hash chain of the blocks covering ``token_ids`` (the last block may be partial).

    Examples
    --------
    >>> ident = kv_identity("m", "c")
    >>> a = block_hashes(range(10), identity=ident, namespace="t", block_tokens=4)
    >>> b = block_hashes(range(12), identity=ident, namespace="t", block_tokens=4)
    >>> len(a), a[:2] == b[:2], a[2] == b[2]
    (3, True, False)
    >>> block_hashes(range(10), identity=ident, namespace="u", block_tokens=4)[0] == a[0]
    False
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens!r}")
    ids = np.asarray(token_ids, dtype=np.int64)
    prefix = chain_root(identity, namespace)
    hashes = []
    parent = b""
    for start in range(0, len(ids), block_tokens):
        h = hashlib.blake2b(prefix + parent, digest_size=HASH_BYTES)
        h.update(ids[start : start + block_tokens].tobytes())
        parent = h.digest()
        hashes.append(parent)
    return tuple(hashes)


def chain_root(identity: bytes, namespace: str) -> bytes:
    """What every block hash of ``identity`` and ``namespace`` starts from: the parent of a chain's first block.

    A fixed-size digest of the namespace, so no namespace can end where another's token
    bytes begin and tenants never collide; twice a hash's length, so it is never one.

    >>> ident = kv_identity("m", "c")
    >>> len(chain_root(ident, "t")) == 2 * HASH_BYTES, chain_root(ident, "t") != chain_root(ident, "u")
    (True, True)
    """
    return identity + hashlib.blake2b(namespace.encode(), digest_size=HASH_BYTES).digest()


def parent_of(hashes: Sequence[bytes], i: int, root: bytes) -> bytes:
    """The parent of block ``i`` of a chain: block ``i - 1``'s hash, or ``root`` (:func:`chain_root`) for the first."""
    return hashes[i - 1] if i else root


def nbytes(t) -> int:
    """Bytes of tensor ``t``'s own elements, not of the storage behind it (an arena, a frame).

    Typed loosely (any object with torch's ``nelement`` and ``element_size``), so this
    module never imports torch.
    """
    return int(t.nelement() * t.element_size())


def num_blocks(num_tokens: int, block_tokens: int) -> int:
    """Blocks needed for ``num_tokens`` tokens.

    Examples
    --------
    >>> num_blocks(0, 64), num_blocks(64, 64), num_blocks(65, 64)
    (0, 1, 2)
    """
    return -(-num_tokens // block_tokens)


@dataclass(frozen=True)
class KVBlock:
    """One block: its hash, its position range and its K/V tensor.

    ``tensor`` has shape ``[layers, 2, kv_heads, tokens, head_dim]``; ``start`` is the
    position of its first token in the sequence.
    """

    hash: bytes
    start: int
    tensor: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.tensor.shape[3])

    @property
    def nbytes(self) -> int:
        return nbytes(self.tensor)


@dataclass(frozen=True)
class BlockKV:
    """A state's KV as its block tensors in token order, not joined into one tensor.

    What a backend that keeps KV in its own paged cache (``reads_blocks``: the vLLM
    backend) resumes from. Joining first would copy the state into fresh memory only
    for the engine to copy it once more into its pages: the join writes into fresh memory
    (page faults, mostly), many times slower than the copy into the engine's warm pages.

    Examples
    --------
    >>> import torch
    >>> kv = BlockKV.split(torch.arange(2 * 10.0).view(1, 2, 1, 10, 1), 4)
    >>> [b.shape[3] for b in kv.blocks], kv.tokens
    ([4, 4, 2], 10)
    >>> [b.shape[3] for b in kv.head(5).blocks], kv.head(5).joined().flatten()[:6].tolist()
    ([4, 1], [0.0, 1.0, 2.0, 3.0, 4.0, 10.0])
    """

    blocks: tuple[torch.Tensor, ...]

    @classmethod
    def split(cls, kv: torch.Tensor, block_tokens: int) -> BlockKV:
        """``kv`` (``[L, 2, H, T, D]``) as views of ``block_tokens`` tokens each (the last may be shorter)."""
        return cls(tuple(kv[:, :, :, i : i + block_tokens] for i in range(0, int(kv.shape[3]), block_tokens)))

    @property
    def tokens(self) -> int:
        return sum(int(b.shape[3]) for b in self.blocks)

    @property
    def nbytes(self) -> int:
        return sum(nbytes(b) for b in self.blocks)

    def head(self, tokens: int) -> BlockKV:
        """The KV of the first ``tokens`` tokens: the blocks covering them, the last one cut (views)."""
        out, have = [], 0
        for b in self.blocks:
            if have >= tokens:
                break
            n = min(int(b.shape[3]), tokens - have)
            out.append(b if n == b.shape[3] else b[:, :, :, :n])
            have += n
        return BlockKV(tuple(out))

    def joined(self) -> torch.Tensor:
        """One ``[L, 2, H, T, D]`` tensor (a view when the blocks are consecutive slices of one)."""
        joined = join_blocks(self.blocks)
        assert joined is not None, "a BlockKV has blocks"
        return joined


@dataclass(frozen=True)
class Arena:
    """A state's blocks laid out back to back in one new buffer, written once.

    Block ``i`` is a contiguous ``[L, 2, H, t, D]`` view of the buffer (every block
    ``block_tokens`` tokens but the last), so a pull of consecutive blocks is one run of
    memory (``plugins/worker/arena.py`` says why the store wants that). A backend whose
    KV is not one ``[L, 2, H, T, D]`` tensor to begin with (transformers' per-layer cache,
    vLLM's pages) writes each layer straight into place: joining the layers first and
    laying the join out after copied a 4,074-token SmolLM2 state (187 MB) into fresh
    memory twice or three times instead of once.

    Examples
    --------
    >>> import torch
    >>> kv = torch.arange(2 * 2 * 1 * 5 * 3, dtype=torch.float32).reshape(2, 2, 1, 5, 3)
    >>> arena = Arena.empty(2, 1, 3, 5, 2, dtype=kv.dtype, device=kv.device)
    >>> for layer in range(2):
    ...     arena.write_layer(layer, kv[layer, 0], kv[layer, 1])
    >>> [b.shape[3] for b in arena.kv.blocks], torch.equal(arena.kv.joined(), kv)
    ([2, 2, 1], True)
    """

    full: torch.Tensor | None  # the whole blocks, [n, L, 2, H, block_tokens, D]
    tail: torch.Tensor | None  # a last partial block, [L, 2, H, rest, D]
    kv: BlockKV  # every block, in token order

    @classmethod
    def empty(cls, layers: int, heads: int, head_dim: int, tokens: int, block_tokens: int, *, dtype, device) -> Arena:
        """Room for ``tokens`` tokens of KV in blocks of ``block_tokens``, on ``device``."""
        import torch

        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens!r}")
        n_full, rest = divmod(tokens, block_tokens)
        per_token = layers * 2 * heads * head_dim
        n = tokens * per_token
        # torch's allocator, in ordinary pages. numpy's buffer asks the kernel for transparent
        # huge pages, and on a kernel that compacts memory for them when asked (``defrag:
        # madvise``) each new arena's huge pages cost a compaction; a worker keeps its states,
        # so every capture paid it (a 3,026-token SmolLM2 state, 139 MB, out of vLLM's pages:
        # 0.25-0.31 s, against 0.035-0.041 s now). TCP pulls from these arenas measured the same.
        buffer = torch.empty(n, dtype=dtype, device=device)
        cut = n_full * block_tokens * per_token
        full = buffer[:cut].view(n_full, layers, 2, heads, block_tokens, head_dim) if n_full else None
        tail = buffer[cut:].view(layers, 2, heads, rest, head_dim) if rest else None
        blocks = [] if full is None else list(full.unbind(0))
        return cls(full, tail, BlockKV(tuple(blocks + ([tail] if tail is not None else []))))

    def write_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy one layer's ``[H, T, D]`` keys and values (token-major, any strides) into place."""
        whole = 0
        if self.full is not None:
            n, _, _, heads, size, dim = self.full.shape
            whole = n * size
            for half, src in ((0, keys), (1, values)):
                self.full[:, layer, half].copy_(src[:, :whole].reshape(heads, n, size, dim).transpose(0, 1))
        if self.tail is not None:
            self.tail[layer, 0].copy_(keys[:, whole:])
            self.tail[layer, 1].copy_(values[:, whole:])


def kv_tokens(kv: torch.Tensor | BlockKV) -> int:
    """Tokens of a state's KV: a ``[L, 2, H, T, D]`` tensor's ``T``, or a ``BlockKV``'s."""
    return kv.tokens if isinstance(kv, BlockKV) else int(kv.shape[3])


def join_blocks(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Concatenate block tensors along the token axis (``None`` when there are none).

    Blocks that are consecutive token slices of one tensor (see
    ``TieredBlockStore.adopt``) join as a view of it, without copying.
    """
    import torch

    if not tensors:
        return None
    if len(tensors) == 1:
        return tensors[0]
    joined = consecutive_view(tensors)
    return joined if joined is not None else torch.cat(list(tensors), dim=3)


def consecutive_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One view spanning ``tensors`` if each starts where the previous ends in one storage, else None."""
    first = tensors[0]
    try:
        storage = first.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError):
        return None
    stride, dtype, device = first.stride(), first.dtype, first.device
    offset, tokens = first.storage_offset(), 0
    for t in tensors:
        if (
            t.dtype != dtype
            or t.device != device
            or t.stride() != stride
            or t.shape[:3] != first.shape[:3]
            or t.shape[4] != first.shape[4]
            or t.untyped_storage().data_ptr() != storage
            or t.storage_offset() != offset + tokens * stride[3]
        ):
            return None
        tokens += t.shape[3]
    return first.as_strided((*first.shape[:3], tokens, first.shape[4]), stride, first.storage_offset())


def follows(a, b) -> bool:
    """Whether contiguous tensor ``b`` starts where contiguous tensor ``a`` ends, in one storage.

    >>> import torch
    >>> x = torch.zeros(6)
    >>> follows(x[:2], x[2:4]), follows(x[:2], x[3:5]), follows(x[:2], torch.zeros(2))
    (True, False, False)
    """
    return (
        a.dtype == b.dtype
        and a.is_contiguous()
        and b.is_contiguous()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.data_ptr() == a.data_ptr() + nbytes(a)
    )


def same_storage(a, b) -> bool:
    """Whether tensors ``a`` and ``b`` share memory (one is a view of the other's storage)."""
    if a is None or b is None:
        return False
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError):
        return False
