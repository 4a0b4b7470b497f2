"""Our vLLM KV connector: moves a request's KV between vLLM's paged cache and block tensors.

vLLM's ``KVConnectorBase_V1`` is the interface LMCache, NIXL and Mooncake plug into. It
has a scheduler half (how many prompt tokens an external store can supply, and which
paged blocks the request got) and a worker half (copy into and out of those blocks
around a forward pass). The vLLM backend runs the engine core and its model executor in
the Dask worker's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni``
executor), so both halves and the backend share one process: the KV crosses from the
worker's block store into the engine as tensor views and copies, never through pickle.

A request opts in through ``SamplingParams.extra_args["kv_transfer_params"]`` (vLLM's
own channel for connector parameters) with one key, ``kvstate``, naming an order in the
process's :class:`Exchange`:

- a **load**: the ``[layers, 2, kv_heads, tokens, head_dim]`` KV of the prompt's leading
  tokens. The scheduler half offers its tokens beyond what vLLM's own prefix cache already
  holds; the worker half writes them into the request's paged blocks before the
  forward that needs them;
- a **capture**: the number of leading prompt tokens whose KV to copy out, in the same
  layout, once the forward that computes the last of them has run.

The paged layout is the CPU attention backend's (``LBHNC``, ``vec`` kernels): per layer
``[blocks, kv_heads, block_size, 2 * head_dim]``, each head's block holding its keys
transposed (``[head_dim, block_size]``, the kernel's dot-product order) and then its
values (``[block_size, head_dim]``). vLLM documents the outer order only, so
:func:`read_blocks` was checked against transformers' own KV of the same prompt
(``tests/test_vllm.py``).
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from dask_kvstate.blocks import BlockKV, consecutive_view, follows

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# The key of our orders in a request's kv_transfer_params, and of the exchange in the
# connector's extra config.
PARAM = "kvstate"
EXCHANGE_KEY = "kvstate_exchange"


@dataclass
class Order:
    """What one request wants from the connector."""

    load: BlockKV | None = None  # KV of the prompt's leading tokens, as blocks of the engine's size
    capture: int = 0  # leading prompt tokens whose KV to copy out...
    capture_from: int = 0  # ...from this one on (a block boundary)
    captured: torch.Tensor | None = None  # set by the worker half
    loaded_tokens: int = 0  # tokens written into the engine from ``load``
    engine_hit_tokens: int = 0  # tokens vLLM's own prefix cache already held


class Exchange:
    """Orders by key, shared by the backend and both connector halves of one engine."""

    def __init__(self):
        self.orders: dict[str, Order] = {}
        self.lock = threading.Lock()
        self.counters: defaultdict[str, float] = defaultdict(float)  # tokens, and seconds copying (load_s, capture_s)

    def put(self, key: str, order: Order) -> None:
        with self.lock:
            self.orders[key] = order

    def get(self, key: str | None) -> Order | None:
        if key is None:
            return None
        with self.lock:
            return self.orders.get(key)

    def pop(self, key: str) -> Order | None:
        with self.lock:
            return self.orders.pop(key, None)


# One exchange per engine in this process, found by the name in the connector's config.
_EXCHANGES: dict[str, Exchange] = {}


def forget(name: str) -> None:
    """Drop exchange ``name`` once its engine is closed."""
    _EXCHANGES.pop(name, None)


def exchange(name: str) -> Exchange:
    """The exchange named ``name`` in this process (made on first use)."""
    return _EXCHANGES.setdefault(name, Exchange())


# CPU attention kernels whose paged block interior is keys transposed, then values.
PAGED_ISAS = frozenset({"vec"})


def _interior(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's paged keys ``[blocks, H, D, bs]`` and values ``[blocks, H, bs, D]``."""
    blocks, heads, size, content = layer.shape
    dim = content // 2
    halves = layer.view(blocks, heads, 2, size * dim)
    return halves[:, :, 0].view(blocks, heads, dim, size), halves[:, :, 1].view(blocks, heads, size, dim)


def read_blocks(layer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Paged blocks ``index`` of one layer as ``[2, H, len(index) * bs, D]`` (a copy)."""
    keys, values = _interior(layer)
    k = keys.index_select(0, index).transpose(2, 3)  # [b, H, bs, D]
    v = values.index_select(0, index)
    b, heads, size, dim = v.shape
    return torch.stack([k, v]).permute(0, 2, 1, 3, 4).reshape(2, heads, b * size, dim)


def capture_blocks(layers: Sequence[torch.Tensor], index: Sequence[int], tokens: int) -> torch.Tensor:
    """The KV of the first ``tokens`` slots of paged blocks ``index`` of every layer, as one
    ``[L, 2, H, tokens, D]`` tensor.

    Each layer's blocks go straight into their place in the result (consecutive blocks by
    one slice, others by ``index_select``), one copy in all: stacking :func:`read_blocks`
    per layer copies the KV four times (a 4,091-token SmolLM2 state, 179 MiB in 64-token
    blocks, on one core here: 94 ms against 151 ms).
    """
    size = layers[0].shape[2]
    whole, tail = divmod(tokens, size)
    keys0, _ = _interior(layers[0])
    heads, dim = keys0.shape[1], keys0.shape[2]
    out = layers[0].new_empty((len(layers), 2, heads, tokens, dim))
    where = _destination(index[:whole]) if whole else None
    for number, layer in enumerate(layers):
        keys, values = _interior(layer)
        if where is not None:
            k = keys[where] if isinstance(where, slice) else keys.index_select(0, where)  # [b, H, D, bs]
            v = values[where] if isinstance(where, slice) else values.index_select(0, where)  # [b, H, bs, D]
            out[number, 0, :, : whole * size].view(heads, whole, size, dim).copy_(k.permute(1, 0, 3, 2))
            out[number, 1, :, : whole * size].view(heads, whole, size, dim).copy_(v.permute(1, 0, 2, 3))
        if tail:
            block = int(index[whole])
            out[number, 0, :, whole * size :].copy_(keys[block, :, :, :tail].transpose(1, 2))
            out[number, 1, :, whole * size :].copy_(values[block, :, :tail])
    return out


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


@dataclass
class Copy:
    """Blocks of one request to copy: paged block ids and the token range they hold."""

    key: str
    block_ids: list[int]
    start: int  # first token (a multiple of the block size)
    stop: int  # one past the last token


@dataclass
class Metadata(KVConnectorMetadata):
    loads: list[Copy] = field(default_factory=list)
    saves: list[Copy] = field(default_factory=list)


@dataclass
class _Tracked:
    """A request the scheduler half follows until its capture is taken."""

    key: str
    block_ids: list[int]
    computed: int = 0  # prompt tokens computed after this step's forward
    load: Copy | None = None


def _order_key(request: Request) -> str | None:
    params = request.kv_transfer_params or {}
    key = params.get(PARAM)
    return key if isinstance(key, str) else None


def _layer_index(name: str) -> int:
    found = re.findall(r"\d+", name)
    if not found:
        raise ValueError(f"cannot order KV cache layer {name!r}: no layer number in its name")
    return int(found[0])


class KVStateConnector(KVConnectorBase_V1):
    """Loads our blocks into vLLM's paged cache and captures a prompt's KV out of it."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        name = self._kv_transfer_config.get_from_extra_config(EXCHANGE_KEY, "default")
        self.exchange = exchange(str(name))
        self._tracked: dict[str, _Tracked] = {}  # scheduler half, by request id
        self._matched: dict[str, int] = {}  # block-aligned local hit the last match was offered at
        self._layers: list[torch.Tensor] = []  # worker half: paged KV per layer, in layer order
        self._isa_checked = False

    # -- scheduler half ------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        key = _order_key(request)
        order = self.exchange.get(key)
        if order is None or order.load is None:
            return 0, False
        order.engine_hit_tokens = num_computed_tokens
        self._matched[request.request_id] = num_computed_tokens  # where a load would start
        # Every token the state has (vLLM starts a load on a block boundary and lets it end
        # anywhere, as NIXL's loads do), but never the last prompt token: its logits start decoding.
        have = min(order.load.tokens, request.num_prompt_tokens - 1)
        return max(0, have - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        key = _order_key(request)
        if key is None:
            return
        tracked = self._tracked.setdefault(request.request_id, _Tracked(key, []))
        if num_external_tokens > 0:
            start = self._matched[request.request_id]
            tracked.load = Copy(key, [], start, start + num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = Metadata()
        for req in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(req.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(req.block_ids[0])
            tracked.computed = req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req.req_id]
            self._plan(tracked, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:  # a preempted request gets all its blocks anew
                    tracked.block_ids = list(new_ids[0])
                else:
                    tracked.block_ids.extend(new_ids[0])
            tracked.computed = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._plan(tracked, meta)
        return meta

    def _plan(self, tracked: _Tracked, meta: Metadata) -> None:
        bs = self.block_size
        if tracked.load is not None:
            load = tracked.load
            load.block_ids = tracked.block_ids[load.start // bs : -(-load.stop // bs)]
            meta.loads.append(load)
            tracked.load = None
        order = self.exchange.get(tracked.key)
        if order is not None and 0 < order.capture <= tracked.computed and order.captured is None:
            first = order.capture_from // bs
            ids = tracked.block_ids[first : -(-order.capture // bs)]
            meta.saves.append(Copy(tracked.key, ids, first * bs, order.capture))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return False, None

    # -- worker half ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = [kv_caches[name] for name in sorted(kv_caches, key=_layer_index)]
        for name, layer in kv_caches.items():
            if layer.device.type != "cpu" or layer.dim() != 4 or layer.shape[3] % 2:
                raise RuntimeError(
                    f"KV cache layer {name!r} is {tuple(layer.shape)} on {layer.device}: this connector knows "
                    "vLLM's CPU paged layout only ([blocks, kv_heads, block_size, 2 * head_dim])"
                )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, Metadata)
        self._check_isa(forward_context)
        t0 = time.perf_counter()
        for copy in meta.loads:
            order = self.exchange.get(copy.key)
            if order is None or order.load is None:
                raise RuntimeError(f"KV load order {copy.key!r} vanished before its forward pass")
            write_blocks(self._layers, copy.block_ids, load_chunks(order.load, copy.start, copy.stop, self.block_size))
            order.loaded_tokens += copy.stop - copy.start
        if meta.loads:
            self.exchange.counters["load_s"] += time.perf_counter() - t0

    def _check_isa(self, forward_context: ForwardContext) -> None:
        """Refuse a paged layout other than the one :func:`read_blocks` knows, before any copy."""
        if self._isa_checked:
            return
        for layer in forward_context.no_compile_layers.values():
            isa = getattr(layer, "isa", None)
            if isa is not None and isa not in PAGED_ISAS:
                raise RuntimeError(
                    f"vLLM's CPU attention runs with ISA {isa!r}, whose paged KV layout this connector does not "
                    f"know (known: {sorted(PAGED_ISAS)}); use kvstate.dtype float32 or the Hugging Face backend"
                )
        self._isa_checked = True

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copies every layer before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # captures are taken whole in wait_for_save, after the forward

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, Metadata)
        t0 = time.perf_counter()
        for copy in meta.saves:
            order = self.exchange.get(copy.key)
            if order is None:
                continue
            order.captured = capture_blocks(self._layers, copy.block_ids, copy.stop - copy.start)
            self.exchange.counters["captured_tokens"] += copy.stop - copy.start
        if meta.saves:
            self.exchange.counters["capture_s"] += time.perf_counter() - t0
