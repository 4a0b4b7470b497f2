"""Reuse inside a block: the leading tokens of a stored block a prompt leaves the chain in.

Blocks are found by their chained hash (``dask_kvstate/blocks.py``), so a prompt reuses
the blocks it shares whole with a stored prompt, and the block where the two part ways
is computed again whole: up to ``block_tokens - 1`` tokens the two share. Two cases pay
that on every call: a returning visit to a document with a new question (the stored
prompt, the document and its first question, parts from the new one inside the
document's last block), and a conversation's next turn (the previous prompt ended
inside a block that this one fills further). With 64-token blocks that was 82 tokens
computed for a returning visit to a 3,000-token document that shares all but 26.

:class:`BlockChildren` indexes the blocks stored under each parent by their tokens. A
lookup that stops at block ``i`` asks for the stored child of block ``i - 1`` sharing the
most leading tokens with the prompt's block ``i``: those ``m`` tokens' KV is the
prompt's too, because a token's KV depends on it and the tokens before it only, which
the common parent makes equal. This is what SGLang's radix tree gives at token level;
vLLM's own prefix cache matches whole blocks only. Tenants stay apart as the hashes do:
a chain's first block has its model's and namespace's root as parent.

Only the worker that stored a block knows its tokens (a block pulled from a peer is
not indexed), and the index forgets the oldest entries past its capacity and never
holds a block: a child that has left the store is skipped by the caller.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from dask_kvstate.blocks import parent_of

#: Blocks indexed per worker and model: ~0.9 KB an entry (64 token ids, the keys, the
#: dicts), ~7 MB in all, covering half a million tokens of prompts, whose KV (23 GB of
#: SmolLM2-135M's) is more than a CPU worker's store holds.
CAPACITY = 8_192


class BlockChildren:
    """Stored blocks by parent, with their token ids; thread-safe (tasks run on several threads).

    Examples
    --------
    >>> index = BlockChildren()
    >>> index.add(b"root", b"doc+q0", [5, 6, 7, 8])
    >>> index.longest(b"root", [5, 6, 9, 9])
    (b'doc+q0', 2)
    >>> index.longest(b"root", [1, 2]) is None, index.longest(b"other", [5, 6]) is None
    (True, True)
    """

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._tokens: OrderedDict[bytes, tuple[bytes, np.ndarray]] = OrderedDict()  # child -> (parent, ids)
        self._children: dict[bytes, dict[bytes, None]] = {}  # parent -> its children, oldest first

    def __len__(self) -> int:
        return len(self._tokens)

    def add(self, parent: bytes, child: bytes, ids: Sequence[int]) -> None:
        """Index block ``child`` (tokens ``ids``) under ``parent``; the oldest go past capacity."""
        tokens = np.asarray(ids, dtype=np.int32)  # token ids fit: vocabularies are far below 2**31
        with self._lock:
            if child in self._tokens:  # content-addressed: same parent, same tokens; now the newest
                self._tokens.move_to_end(child)
                siblings = self._children[parent]
                siblings[child] = siblings.pop(child)
                return
            self._tokens[child] = (parent, tokens)
            self._children.setdefault(parent, {})[child] = None
            while len(self._tokens) > self.capacity:
                old, (old_parent, _) = self._tokens.popitem(last=False)
                siblings = self._children[old_parent]
                del siblings[old]
                if not siblings:
                    del self._children[old_parent]

    def add_chain(
        self, hashes: Sequence[bytes], ids: Sequence[int], first: int, root: bytes, block_tokens: int
    ) -> None:
        """Index blocks ``first...`` of the chain ``hashes`` of ``ids`` (``root``: its first block's parent)."""
        for i in range(first, len(hashes)):
            self.add(parent_of(hashes, i, root), hashes[i], ids[i * block_tokens : (i + 1) * block_tokens])

    def longest(self, parent: bytes, ids: Sequence[int]) -> tuple[bytes, int] | None:
        """The child of ``parent`` whose tokens begin with the most of ``ids``, and how many; None if none shares one.

        Newest first among equals: the block most likely still stored.
        """
        want = np.asarray(ids, dtype=np.int32)
        with self._lock:
            children = [(c, self._tokens[c][1]) for c in reversed(self._children.get(parent, ()))]
        best: tuple[bytes, int] | None = None
        for child, tokens in children:
            n = min(len(tokens), len(want))
            differ = np.flatnonzero(tokens[:n] != want[:n])
            shared = int(differ[0]) if len(differ) else n
            if shared and (best is None or shared > best[1]):
                best = (child, shared)
        return best
