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
not indexed). The index never holds a block: past its capacity it forgets the least
recently used entries, and a child that has left the store is forgotten when a lookup
finds it gone (``KVEngine.stored_past`` then tries the next).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from dask_kvstate.blocks import parent_of

#: Blocks indexed per worker and model: ~0.9 KB an entry (64 token ids, the keys, the
#: dicts), ~7 MB in all, covering half a million tokens of prompts, whose KV (23 GB of
#: SmolLM2-135M's) is more than a CPU worker's store holds.
CAPACITY = 8_192
#: Siblings are found by their first tokens: a match shorter than this saves too little to
#: look for, and keying on them keeps a lookup off the many prompts that part right after a
#: shared system prompt (a scan of 8,192 siblings took ~15 ms).
KEY_TOKENS = 4
#: Candidates compared per lookup, newest first: bounds a lookup where many siblings begin alike.
SCAN = 64


class BlockChildren:
    """Stored blocks by parent and first tokens, with their token ids; thread-safe (tasks run
    on several threads). Entries are refreshed when found and forgotten oldest first.

    Examples
    --------
    >>> index = BlockChildren()
    >>> index.add(b"root", b"doc+q0", [5, 6, 7, 8, 9])
    >>> index.matches(b"root", [5, 6, 7, 8, 1])
    [(b'doc+q0', 4)]
    >>> index.matches(b"root", [5, 6, 1, 1]), index.matches(b"other", [5, 6, 7, 8])
    ([], [])
    """

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, tuple[tuple, np.ndarray]] = OrderedDict()  # child -> (key, ids)
        self._siblings: dict[tuple, dict[bytes, None]] = {}  # (parent, first tokens) -> children, oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, parent: bytes, child: bytes, ids: Sequence[int]) -> None:
        """Index block ``child`` (tokens ``ids``) under ``parent``; the oldest go past capacity."""
        if len(ids) < KEY_TOKENS:
            return
        tokens = np.asarray(ids, dtype=np.int32)  # token ids fit: vocabularies are far below 2**31
        with self._lock:
            if child in self._entries:  # content-addressed: the same parent and tokens
                self._refresh(child)
                return
            key = (parent, tokens[:KEY_TOKENS].tobytes())
            self._entries[child] = (key, tokens)
            self._siblings.setdefault(key, {})[child] = None
            while len(self._entries) > self.capacity:
                self._drop(next(iter(self._entries)))

    def add_chain(
        self, hashes: Sequence[bytes], ids: Sequence[int], first: int, root: bytes, block_tokens: int
    ) -> None:
        """Index blocks ``first...`` of the chain ``hashes`` of ``ids`` (``root``: its first block's parent)."""
        for i in range(first, len(hashes)):
            self.add(parent_of(hashes, i, root), hashes[i], ids[i * block_tokens : (i + 1) * block_tokens])

    def matches(self, parent: bytes, ids: Sequence[int]) -> list[tuple[bytes, int]]:
        """Children of ``parent`` sharing at least ``KEY_TOKENS`` leading tokens with ``ids``,
        with how many: the most shared first, the newest first among equals (the likeliest
        still stored)."""
        if len(ids) < KEY_TOKENS:
            return []
        want = np.asarray(ids, dtype=np.int32)
        with self._lock:
            children = self._siblings.get((parent, want[:KEY_TOKENS].tobytes()), {})
            found = [(c, self._entries[c][1]) for c in itertools.islice(reversed(children), SCAN)]
        out = []
        for child, tokens in found:
            n = min(len(tokens), len(want))
            differ = np.flatnonzero(tokens[:n] != want[:n])
            out.append((child, int(differ[0]) if len(differ) else n))
        return sorted(out, key=lambda m: -m[1])  # stable: newest first among equals

    def used(self, child: bytes) -> None:
        """``child`` served a prompt: the newest now, the last to be forgotten."""
        with self._lock:
            if child in self._entries:
                self._refresh(child)

    def forget(self, child: bytes) -> None:
        """Drop ``child`` (it left the store)."""
        with self._lock:
            if child in self._entries:
                self._drop(child)

    def _refresh(self, child: bytes) -> None:
        self._entries.move_to_end(child)
        siblings = self._siblings[self._entries[child][0]]
        siblings[child] = siblings.pop(child)

    def _drop(self, child: bytes) -> None:
        key, _ = self._entries.pop(child)
        siblings = self._siblings[key]
        del siblings[child]
        if not siblings:
            del self._siblings[key]
