"""Sibling rows over one prefix in vLLM's paged layout, attended by vLLM's CPU kernel.

Why: siblings decoding over one prefix read it once per step in :mod:`.cascade` (two
partial attentions merged by their log-sum-exp), which on the CPU is two calls of torch's
flash kernel and a merge per layer. vLLM's CPU kernel (:mod:`.cpu_attention`) over pages
that every row's block table shares does the same in one call, and faster: one decode
step's attention for 16 rows over a 4,074-token prefix (SmolLM2's heads, 2 threads) takes
1.64 ms a layer through the merge and 0.84 ms through the kernel (figures in
``docs/design/backends.md``). It costs a copy of the prefix into pages, once per batch,
so it serves batches of :data:`MIN_ROWS` rows or more; a single resume keeps reading the
state where it lies.

How: the prefix's full pages are written once, and each row's block table lists those its
kept prefix covers, as vLLM's prefix cache shares blocks; each row owns the pages after
them, which hold the prefix tokens it keeps past its last full page (fewer than a page),
then its own tokens. A
forward writes its new tokens' keys and values into the rows' own pages and runs the
kernel over each row's table causally (each row's queries are its last tokens; the pads
of a shorter row come after its real tokens, so causality keeps them out). A row that
leaves the batch leaves the table; nothing is copied.

Only models on sdpa get the kernel (:mod:`.cpu_attention`), and batches of models with a
sliding window are not paged (:func:`~.batch.generate_batch` checks); what the kernel path
does not compute (a window, a logit cap, attention sinks) raises :class:`CascadeUnsupported`
at the first layer should a model ask for it anyway, and the batch runs row by row.
"""

from __future__ import annotations

import torch

from dask_kvstate.backends.cascade import CascadeUnsupported
from dask_kvstate.backends.cpu_attention import PAGE_TOKENS, CPUAttention, tokens_major

#: The fewest rows a batch must have to be paged: below, the prefix's copy outweighs the steps it speeds.
MIN_ROWS = 2


def page_count(prefix_lengths: list[int], capacity: int) -> tuple[int, int]:
    """``(shared, own)``: the prefix's full pages some row keeps, and the pages each row owns
    (its part of a page of the prefix, then ``capacity`` own tokens)."""
    shared = max(prefix_lengths, default=0) // PAGE_TOKENS
    tail = max((p % PAGE_TOKENS for p in prefix_lengths), default=0)
    return shared, -(-(tail + capacity) // PAGE_TOKENS)


def kv_bytes(kernel: CPUAttention, num_layers: int, prefix_lengths: list[int], capacity: int) -> int:
    """The pages :class:`PagedRows` allocates for these rows (the prefix's copy included)."""
    shared, own = page_count(prefix_lengths, capacity)
    page = kernel.kv_heads * 2 * PAGE_TOKENS * kernel.head_dim * kernel.dtype.itemsize
    return num_layers * (shared + len(prefix_lengths) * own) * page


class PagedRows:
    """KV for rows sharing a prefix, in pages: the same calls as :class:`~.cascade.SharedPrefixKV`.

    Parameters
    ----------
    kernel : CPUAttention
        The model's kernel (its heads, dtype and the vLLM ops).
    prefix : tensor ``[L, 2, H, P, D]`` or None
        The shared prefix's KV; copied into pages here.
    prefix_lengths : list of int
        How many prefix tokens row b keeps (``<= P``).
    capacity : int
        Own tokens a row can hold (its suffix plus the tokens it will generate).
    """

    def __init__(self, kernel: CPUAttention, prefix, prefix_lengths: list[int], capacity: int, *, num_layers: int):
        P = 0 if prefix is None else int(prefix.shape[3])
        if any(p > P or p < 0 for p in prefix_lengths):
            raise ValueError(f"prefix lengths {prefix_lengths} exceed the prefix's {P} tokens")
        self.kernel, self.num_layers, self.capacity = kernel, num_layers, capacity
        rows = len(prefix_lengths)
        shared, own = page_count(prefix_lengths, capacity)
        self.keep = torch.tensor(prefix_lengths, dtype=torch.long)
        full = self.keep // PAGE_TOKENS  # the shared pages a row's table lists
        self.tail = self.keep - full * PAGE_TOKENS  # prefix tokens a row holds in its own pages
        self.base = shared + torch.arange(rows) * own  # a row's first own page
        self.offsets = torch.zeros(rows, dtype=torch.long)  # own tokens written per row
        # Row b: shared pages [0, full_b), then its own; the rest of the row is never read
        # (the kernel reads a row's pages up to its length).
        self.table = torch.zeros((rows, shared + own), dtype=torch.int32)
        for b, f in enumerate(full.tolist()):
            self.table[b, :f] = torch.arange(f)
            self.table[b, f : f + own] = self.base[b] + torch.arange(own)
        self.pages = [kernel.pages(shared + rows * own) for _ in range(num_layers)]
        if prefix is not None:
            self._write_prefix(prefix, shared)
        self._attended: set[int] = set()
        self._forward: tuple | None = None

    @property
    def rows(self) -> int:
        return int(self.keep.shape[0])

    def _write_prefix(self, prefix: torch.Tensor, shared: int) -> None:
        """The shared pages, then each row's tail of the prefix into its own first pages."""
        head = shared * PAGE_TOKENS
        # (row, first prefix token of its tail, tokens in it)
        tails = [(b, int(k - t), int(t)) for b, (k, t) in enumerate(zip(self.keep, self.tail, strict=True)) if t]
        tail_slots = torch.cat(
            [self.base[b] * PAGE_TOKENS + torch.arange(t) for b, _, t in tails] or [torch.zeros(0, dtype=torch.long)]
        )
        for layer, (key_pages, value_pages) in enumerate(self.pages):
            k, v = prefix[layer, 0].transpose(0, 1), prefix[layer, 1].transpose(0, 1)  # [P, H, D]
            if head:
                self.kernel.write(k[:head], v[:head], key_pages, value_pages, torch.arange(head))
            if tails:
                tk = torch.cat([k[start : start + t] for _, start, t in tails])
                tv = torch.cat([v[start : start + t] for _, start, t in tails])
                self.kernel.write(tk, tv, key_pages, value_pages, tail_slots)

    def position_ids(self, q: int) -> torch.Tensor:
        """Positions of the next ``q`` tokens of every row: ``keep_b + offset_b + i``."""
        return (self.keep + self.offsets)[:, None] + torch.arange(q)

    def begin(self, q: int) -> None:
        """Prepare a forward of ``q`` new tokens per row: their slots, the rows' lengths, the kernel's plan
        (made here, in the thread that runs the forward)."""
        width = int(self.offsets.max()) + q
        if width > self.capacity:
            raise ValueError(f"a row would hold {width} own tokens, more than the capacity {self.capacity}")
        at = (self.tail + self.offsets)[:, None] + torch.arange(q)  # [B, q]: index in the row's own pages
        slots = ((self.base[:, None] + at // PAGE_TOKENS) * PAGE_TOKENS + at % PAGE_TOKENS).reshape(-1)
        starts = (torch.arange(self.rows + 1) * q).to(torch.int32)
        lengths = (self.keep + self.offsets + q).to(torch.int32)
        self._forward = (q, slots, starts, lengths, torch.get_num_threads(), self.kernel.plan(starts, lengths))
        self._attended = set()

    def check_attended(self) -> None:
        """After a forward: raise unless every layer's attention came here (see ``SharedPrefixKV``)."""
        missing = sorted(set(range(self.num_layers)) - self._attended)
        if missing:
            raise CascadeUnsupported(f"the attention of layers {missing} did not go through the paged rows")

    def attend(self, layer, query, key, value, scaling, *, softcap=None, sinks=None, window=None) -> torch.Tensor:
        """One layer's attention for all rows; ``[B, q, heads, D]`` as transformers expects."""
        if window is not None or softcap or sinks is not None:
            raise CascadeUnsupported("a sliding window, a logit cap or attention sinks")
        k = self.kernel
        B, Hq, q, D = query.shape
        if (Hq, key.shape[1], D, key.shape[-1], value.shape[-1]) != (k.heads, k.kv_heads, k.head_dim, D, D):
            raise CascadeUnsupported(f"layer {layer} attends with other heads than the kernel was loaded for")
        if {query.dtype, key.dtype, value.dtype} != {k.dtype}:
            raise CascadeUnsupported(f"layer {layer} attends in {query.dtype}, the kernel was loaded for {k.dtype}")
        if self._forward is None or self._forward[0] != q or self.rows != B:
            raise RuntimeError(f"a forward of {B} rows x {q} tokens without begin({q}) for {self.rows} rows")
        _, slots, starts, lengths, threads, plan = self._forward
        if threads != torch.get_num_threads():  # the kernel refuses a plan made for another team size
            plan = k.plan(starts, lengths)
            self._forward = (q, slots, starts, lengths, torch.get_num_threads(), plan)
        self._attended.add(layer)
        key_pages, value_pages = self.pages[layer]
        k.write(tokens_major(key), tokens_major(value), key_pages, value_pages, slots)
        out = k.attend(tokens_major(query), key_pages, value_pages, starts, lengths, self.table, plan, scaling)
        return out.view(B, q, Hq, D)

    def advance(self, counts) -> None:
        """After a forward: row b keeps ``counts[b]`` of the ``q`` tokens it wrote (padding dropped)."""
        self.offsets += torch.as_tensor(counts, dtype=torch.long)

    def select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (finished rows leave the table; their pages are not reused)."""
        idx = torch.tensor(keep, dtype=torch.long)
        self.keep, self.tail, self.base = self.keep[idx], self.tail[idx], self.base[idx]
        self.offsets, self.table = self.offsets[idx], self.table[idx]
