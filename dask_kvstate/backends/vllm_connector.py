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
  layout, once the forward that computes the last of them has run;
- a **sequence capture**: the KV of the prompt *and* the tokens the request generated
  (all but the last, whose KV no forward computed), copied out when the request
  finishes, before vLLM frees its blocks. The next turn of a conversation starts with
  this answer: kept, it is loaded instead of prefilled again (SGLang's radix cache keeps
  generated tokens too; vLLM's own prefix cache keeps only their whole blocks).

The copies themselves, and the paged layout they read and write, are in
:mod:`.vllm_pages`.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from dask_kvstate.backends.vllm_pages import PAGED_ISAS, capture_arena, load_chunks, write_blocks
from dask_kvstate.blocks import BlockKV

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
    capture_sequence: bool = False  # at the finish, copy out prompt and generated KV from capture_from on
    captured: BlockKV | None = None  # set by the connector: the KV from capture_from on, as blocks
    sequence_ids: list[int] | None = None  # a sequence capture's token ids (from the first on)
    loaded_tokens: int = 0  # tokens written into the engine from ``load``
    engine_hit_tokens: int = 0  # tokens vLLM's own prefix cache already held

    def reset(self) -> None:
        """Forget what the connector did for an attempt of this order (before it is submitted again)."""
        self.captured, self.sequence_ids, self.loaded_tokens, self.engine_hit_tokens = None, None, 0, 0


class Exchange:
    """Orders by key, shared by the backend and both connector halves of one engine."""

    def __init__(self):
        self.orders: dict[str, Order] = {}
        self.lock = threading.Lock()
        # tokens, and seconds: copying (load_s, capture_s) and in the engine's steps (step_s)
        self.counters: defaultdict[str, float] = defaultdict(float)
        #: the engine's paged KV per layer, in layer order (set by the worker half): the scheduler
        #: half copies a finished request's sequence out of it, in this same process
        self.layers: list[torch.Tensor] = []

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


#: How a request ends with every token's KV written (not aborted, not cut off by an error).
_COMPLETED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_REPETITION}
)

# One exchange per engine in this process, found by the name in the connector's config.
_EXCHANGES: dict[str, Exchange] = {}


def forget(name: str) -> None:
    """Drop exchange ``name`` once its engine is closed."""
    _EXCHANGES.pop(name, None)


def exchange(name: str) -> Exchange:
    """The exchange named ``name`` in this process (made on first use)."""
    return _EXCHANGES.setdefault(name, Exchange())


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


def _windowed_layers(kv_cache_config) -> list[str]:
    """The layers vLLM's cache manager keeps only a window (or chunk) of blocks for."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    if kv_cache_config is None:
        return []
    found: list[str] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs = getattr(spec, "kv_cache_specs", None) or dict.fromkeys(group.layer_names, spec)
        found += [name for name, s in specs.items() if isinstance(s, (SlidingWindowSpec, ChunkedLocalAttentionSpec))]
    return found


class KVStateConnector(KVConnectorBase_V1):
    """Loads our blocks into vLLM's paged cache and captures a prompt's KV out of it."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        windowed = _windowed_layers(kv_cache_config)
        if windowed:  # vLLM would free their blocks below the window: a state there would be wrong
            raise RuntimeError(
                f"vLLM keeps only a window of KV blocks for layers {', '.join(windowed[:3])}"
                f"{' and more' if len(windowed) > 3 else ''}, while a state keeps every token: kvstate's "
                "connector serves models vLLM allocates as full attention throughout (any with a "
                "full-attention layer, its hybrid KV cache manager off); use the transformers backend"
            )
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
        order = self.exchange.get(_order_key(request))
        if order is not None and order.capture_sequence and request.status in _COMPLETED:
            self._capture_sequence(order, request, block_ids)
        return False, None

    def _capture_sequence(self, order: Order, request: Request, block_ids: list[int]) -> None:
        """Copy the finished request's KV out of ``block_ids`` from ``order.capture_from`` on.

        Called by vLLM's scheduler after the request's last forward and before it frees
        the blocks; the engine runs in this process with synchronous scheduling (vLLM's
        CPU platform turns async scheduling off), so no forward overwrites them meanwhile.
        The tokens covered are those the engine computed KV for: every prompt token and
        every generated one but the last.
        """
        t0 = time.perf_counter()
        bs = self.block_size
        tokens = min(request.num_computed_tokens, len(block_ids) * bs)
        first = order.capture_from // bs
        if tokens <= first * bs:
            return
        order.captured = capture_arena(self.exchange.layers, block_ids[first : -(-tokens // bs)], tokens - first * bs)
        order.sequence_ids = list(request.all_token_ids[:tokens])
        self.exchange.counters["captured_tokens"] += tokens - first * bs
        self.exchange.counters["captured_output_tokens"] += max(0, tokens - request.num_prompt_tokens)
        self.exchange.counters["capture_s"] += time.perf_counter() - t0

    # -- worker half ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = [kv_caches[name] for name in sorted(kv_caches, key=_layer_index)]
        self.exchange.layers = self._layers
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
        """Refuse a paged layout other than the one :mod:`.vllm_pages` knows, before any copy."""
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
            order.captured = capture_arena(self._layers, copy.block_ids, copy.stop - copy.start)
            self.exchange.counters["captured_tokens"] += copy.stop - copy.start
        if meta.saves:
            self.exchange.counters["capture_s"] += time.perf_counter() - t0
