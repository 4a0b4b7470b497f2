"""KV layout per layer kind: every layer stores every token; sliding-window layers attend to their window.

Why every token, for every layer: a state's blocks are addressed by a hash chain over
token positions, and a state can be resumed, extended or forked from any of its
prefixes (the prefix cache and the compiler do exactly that). A sliding-window layer
keeping only its last ``W - 1`` tokens would make a block's content depend on where the
state ends, so a prefix of a state could not be cut from it, and an ``extend`` from a
mid-window point would need tokens already dropped. Storing all tokens keeps one
tensor shape for all layers (``[layers, 2, kv_heads, tokens, head_dim]``, so blocks
of layers of different kinds are never mis-joined), at a memory cost measured per
layer kind in :func:`memory_per_token`: a sliding layer holds what a full one does,
where an engine holding a single sequence needs only its window.

Inside a forward pass the model sees exactly what transformers' own cache gives it
(so text replay is ``model.generate``'s computation): sliding layers are transformers'
``DynamicSlidingWindowLayer``, which hands attention the window, plus a record of every
token they saw (:class:`RecordingSlidingWindowLayer`), which is what a state stores.
Which kind a layer is comes from transformers itself (the layer classes a
``DynamicCache`` builds for the config), so the mask the model builds and the cache we
build always agree.

Keys and values of different head sizes (multi-head latent attention: DeepSeek-V2/V3 and
their kin cache a compressed latent, ``kv_lora_rank`` wide, in the key slot and the shared
rotary key, ``qk_rope_head_dim`` wide, in the value slot, one "head" each) are stored in
the one tensor at the wider of the two sizes, the narrower zero-padded (:func:`kv_of`) and
cut back when a cache is built (:func:`new_cache`): one tensor per block keeps the block
store, the transport, the disk format and the pull's expected shapes as they are for every
model, at the cost of the padding's bytes (DeepSeek-V3: 512 beside 64, so 448 of every
1,024 stored values are zeros), which ``kv_bytes_per_token`` counts because they are
stored and moved. Storing K and V as two tensors per block would save them; it is not
built. How wide each is comes from a one-token prefill at load
(:func:`measure`), not from config fields, which families name differently (Falcon's
``multi_query``, GPT-NeoX's heads with no ``num_key_value_heads``).

Models whose layers keep something other than per-token keys and values (recurrent or
state-space states, KV shared across layers, sparse-attention indexers) or that attend
to an encoder are refused by :func:`describe` with the missing capability named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from dask_kvstate.blocks import Arena, BlockKV

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"

# What the refused cache layers keep instead of per-token KV, for the error message.
_MISSING = {
    "LinearAttentionLayer": "per-token KV (its layers keep a recurrent / state-space state)",
    "LinearAttentionAndFullAttentionLayer": "per-token KV alone (hybrid layers also keep a recurrent state)",
    "LinearAttentionAndSlidingWindowAttentionLayer": "per-token KV alone (hybrid layers also keep a recurrent state)",
    "DummyLayer": "a KV per layer (some layers reuse another layer's KV, or have no attention)",
    "DynamicIndexedLayer": "plain KV (its sparse attention also caches indexer keys)",
}


#: Sub-config names of a model beside the text decoder (a vision tower, an audio encoder, a patcher).
_OTHER_MODEL = re.compile(r"vision|audio|image|video|speech|vq|encoder|patcher|depth_decoder")


class UnsupportedModel(ValueError):
    """A model whose KV cannot be stored as per-token blocks."""


@dataclass(frozen=True)
class Layout:
    """Each layer's kind (``full_attention``, ``sliding_attention``, ``chunked_attention``) and window.

    ``windows[i]`` is the sliding window (or chunk size) of layer ``i``, None for full attention.
    ``kv_heads``, ``key_dim`` and ``value_dim`` are what every layer's cache holds per token
    (:func:`measure`; None until measured); a stored tensor is ``max(key_dim, value_dim)`` wide.
    """

    model_type: str
    kinds: tuple[str, ...]
    windows: tuple[int | None, ...]
    kv_heads: int | None = None
    key_dim: int | None = None
    value_dim: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.kinds)

    @property
    def head_dim(self) -> int:
        """The stored head size: keys and values share one tensor at the wider of the two."""
        assert self.key_dim is not None and self.value_dim is not None, "layout.measure gives the head sizes"
        return max(self.key_dim, self.value_dim)

    @property
    def uniform(self) -> bool:
        """Every layer full attention (the cascade needs no per-layer masks)."""
        return all(k == FULL for k in self.kinds)

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for kind, window in zip(self.kinds, self.windows, strict=True):
            label = kind if window is None else f"{kind}(window {window})"
            counts[label] = counts.get(label, 0) + 1
        return ", ".join(f"{n} x {label}" for label, n in counts.items())


def describe(config) -> Layout:
    """The layout of the KV of a model with ``config``, or :class:`UnsupportedModel` naming what it lacks.

    Reads the config only (no weights), so a client can check a model folder before any
    worker loads it.
    """
    model_type = getattr(config, "model_type", None) or type(config).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(
            f"model type {model_type!r} is not supported: it attends to an encoder (cross-attention), "
            "and only decoder-only causal LMs with self-attention KV can be stored as states"
        )
    # Sub-configs of parts of one decoder (DBRX's attn_config, MPT's) are no other model.
    others = sorted(k for k in getattr(config, "sub_configs", None) or {} if _OTHER_MODEL.search(k))
    if others:
        raise UnsupportedModel(
            f"model type {model_type!r} is not supported: it holds models beside its text decoder "
            f"({', '.join(others)}: other modalities or encoders), and only text-only causal LMs are served; "
            "give its text model (a text-only config of the same weights)"
        )
    text = config.get_text_config(decoder=True)
    try:
        layer_types, _ = get_layer_types_and_kwargs(text)
        layers = DynamicCache(config=config).layers
    except (KeyError, AttributeError, TypeError) as e:
        raise UnsupportedModel(
            f"model type {model_type!r} is not supported: transformers builds no per-layer KV cache for it ({e!r})"
        ) from e
    for i, layer in enumerate(layers):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            what = _MISSING.get(type(layer).__name__, f"per-token KV (its cache layers are {type(layer).__name__})")
            raise UnsupportedModel(
                f"model type {model_type!r} is not supported: layer {i} ({layer_types[i]}) lacks {what}; "
                "supported are full-attention and sliding-window attention layers"
            )
    windows = tuple(int(layer.sliding_window) if type(layer) is DynamicSlidingWindowLayer else None for layer in layers)
    kinds = tuple(
        (CHUNKED if t == CHUNKED else SLIDING) if w is not None else FULL
        for t, w in zip(layer_types, windows, strict=True)
    )
    return Layout(model_type, kinds, windows)


def check_positions(model: torch.nn.Module, model_type: str) -> None:
    """Refuse a model whose positions are numbered from its token ids (:class:`UnsupportedModel`).

    RoBERTa and its kin count positions from ``padding_idx + 1`` over the non-pad tokens of
    the ids a forward is given; ``model.generate`` hands the same model positions of its own
    (from 0), so the two disagree on what a prompt's continuation is, and no state's
    resume can be proven equal to both. Found by what the model has (a position embedding
    with a padding index), not by its name.
    """
    for name, module in model.named_modules():
        if (
            isinstance(module, torch.nn.Embedding)
            and name.rsplit(".", 1)[-1].startswith("position")
            and module.padding_idx is not None
        ):
            raise UnsupportedModel(
                f"model type {model_type!r} is not supported: it lacks positions independent of the token ids "
                f"({name} numbers positions from the padding index, and model.generate numbers them otherwise)"
            )


def _joined_from(chunks: list[torch.Tensor], start: int) -> torch.Tensor:
    """The tokens (dim -2) of ``chunks`` laid end to end, from token ``start`` on, as one tensor."""
    seen = 0
    for i, chunk in enumerate(chunks):
        if seen + chunk.shape[-2] > start:
            return torch.cat([chunk[..., start - seen :, :], *chunks[i + 1 :]], dim=-2)
        seen += chunk.shape[-2]
    return chunks[-1][..., :0, :]  # start at or past the end: no tokens


class RecordingSlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window layer, plus every token it saw, so a state keeps them all.

    Attention gets exactly what the base layer returns; the record is kept as a list of
    the chunks handed in (no copy per decode step) and joined only when a state is taken.
    :meth:`stop_recording` drops it when no state will be taken (decoding).
    """

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window)
        self._keys: list[torch.Tensor] | None = []
        self._values: list[torch.Tensor] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._keys is not None:
            self._keys.append(key_states)
            self._values.append(value_states)
        return super().update(key_states, value_states, *args, **kwargs)

    def all_tokens(self, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every token seen from ``start`` on, joined (chunks wholly before it are not copied)."""
        if self._keys is None:
            raise RuntimeError("this cache layer stopped recording: its tokens outside the window are gone")
        if not self._keys:
            raise RuntimeError("this cache layer holds no tokens yet")
        return _joined_from(self._keys, start), _joined_from(self._values, start)

    def stop_recording(self) -> None:
        self._keys, self._values = None, []


def new_cache(layout: Layout, kv: torch.Tensor | None = None) -> DynamicCache:
    """A fresh cache for a model of ``layout`` holding ``kv`` (``[L, 2, H, T, D]``, every token) or empty.

    Full layers get a copy of their tokens; sliding layers keep their window (as
    transformers' own cache would after those tokens) and record everything.
    """
    # Built from the layout, which read the config once at load, not from the config on every prefill.
    layers: list[DynamicLayer] = [
        RecordingSlidingWindowLayer(w) if w is not None else DynamicLayer() for w in layout.windows
    ]
    cache = DynamicCache()
    cache.layers = list(layers)
    if kv is not None and kv.shape[3] > 0:
        if kv.shape[0] != layout.num_layers:
            raise ValueError(f"KV for {kv.shape[0]} layers given to a {layout.num_layers}-layer model")
        k_dim, v_dim = layout.key_dim or kv.shape[4], layout.value_dim or kv.shape[4]
        for i, layer in enumerate(layers):
            # Cut the padding kv_of added: the model's attention gets exactly what it cached.
            layer.update(kv[i, 0, :, :, :k_dim][None], kv[i, 1, :, :, :v_dim][None])
    return cache


@dataclass(frozen=True)
class PromptKV:
    """A batch-1 prompt's KV as the shared-prefix path (``backends/cascade.py``) holds it after
    its prefill, in place of a ``DynamicCache``: the state's first ``keep`` tokens, read where
    they lie (``prefix``, ``[L, 2, H, P, D]``, ``P >= keep``), then the prompt's own ``own``
    tokens (``keys`` and ``values``, ``[L, H, capacity, D]``, at the stored width).

    Why: a call that reuses a state reads it in place rather than copying it into a cache,
    and still hands its new tokens to the store (:func:`kv_of` and :func:`blocks_of` read it).
    """

    prefix: torch.Tensor | None
    keep: int
    keys: torch.Tensor
    values: torch.Tensor
    own: int

    def layer_kv(self, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's ``[H, T, D]`` keys and values from token ``start`` on (views of the own
        tokens; joined with the prefix's last tokens where ``start`` lies inside the prefix)."""
        per_layer = []
        for number in range(self.keys.shape[0]):
            k = self.keys[number, :, max(start - self.keep, 0) : self.own]
            v = self.values[number, :, max(start - self.keep, 0) : self.own]
            if start < self.keep:
                assert self.prefix is not None, "a prompt keeping prefix tokens has a prefix"
                k = torch.cat((self.prefix[number, 0, :, start : self.keep], k), dim=1)
                v = torch.cat((self.prefix[number, 1, :, start : self.keep], v), dim=1)
            per_layer.append((k, v))
        return per_layer


def _layer_kv(cache: DynamicCache | PromptKV, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``[H, T, D]`` keys and values from token ``start`` on (views where the
    layer keeps every token), ``D`` the wider of the key and value head sizes, the narrower
    zero-padded (see the module docstring for why one width); checked to form one state."""
    if isinstance(cache, PromptKV):
        return cache.layer_kv(start)
    per_layer = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
            raise ValueError(f"cache layer {layer!r} holds no per-token KV")
        if isinstance(layer, RecordingSlidingWindowLayer):
            k, v = layer.all_tokens(start)
        elif type(layer) is DynamicSlidingWindowLayer:
            raise ValueError("a sliding-window cache layer without a record: build caches with layout.new_cache")
        else:
            k, v = layer.keys[:, :, start:], layer.values[:, :, start:]
        width = max(k.shape[-1], v.shape[-1])
        k, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (k, v))
        per_layer.append((k[0], v[0]))
    shapes = {(k.shape[0], k.shape[2]) for k, _ in per_layer}
    if len(shapes) != 1:
        raise ValueError(f"cache layers hold KV of different (heads, head size) {sorted(shapes)}: not one tensor")
    lengths = {k.shape[1] for k, _ in per_layer}
    if len(lengths) != 1:
        raise ValueError(f"cache layers hold different token counts {sorted(lengths)}: not one state")
    return per_layer


def kv_of(cache: DynamicCache | PromptKV, start: int = 0) -> torch.Tensor:
    """The tokens of a batch-1 cache (or :class:`PromptKV`) from ``start`` on (all by default) as one
    ``[L, 2, H, T, D]`` tensor.

    Only the tokens from ``start`` are copied, once, into the result.
    """
    per_layer = _layer_kv(cache, start)
    keys = per_layer[0][0]
    out = keys.new_empty((len(per_layer), 2, *keys.shape))
    for number, (k, v) in enumerate(per_layer):
        out[number, 0].copy_(k)
        out[number, 1].copy_(v)
    return out


def blocks_of(cache: DynamicCache | PromptKV, start: int, block_tokens: int) -> BlockKV:
    """The tokens of a batch-1 cache from ``start`` on as blocks of ``block_tokens`` laid out
    in one arena, each layer copied once, straight into place (see ``Arena``)."""
    per_layer = _layer_kv(cache, start)
    heads, tokens, dim = per_layer[0][0].shape
    arena = Arena.empty(
        len(per_layer), heads, dim, tokens, block_tokens, dtype=per_layer[0][0].dtype, device=per_layer[0][0].device
    )
    for number, (k, v) in enumerate(per_layer):
        arena.write_layer(number, k, v)
    return arena.kv


def measure(layout: Layout, cache: DynamicCache) -> Layout:
    """``layout`` with the KV heads and key / value head sizes that ``cache`` (a prefill's) holds.

    Raises :class:`UnsupportedModel` naming the layers when they differ in heads or sizes
    (one tensor holds every layer), or when a layer holds no per-token KV at all.
    """
    if not isinstance(cache, DynamicCache):
        raise UnsupportedModel(
            f"model type {layout.model_type!r} is not supported: a forward with use_cache returns "
            f"{type(cache).__name__}, not a DynamicCache of per-layer keys and values "
            "(it keeps none, or state of another kind)"
        )
    shapes = []
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None or keys.ndim != 4 or values.ndim != 4:
            raise UnsupportedModel(
                f"model type {layout.model_type!r} is not supported: layer {i} cached no [batch, heads, tokens, dim] "
                "keys and values in a prefill"
            )
        if keys.shape[1] != values.shape[1]:
            raise UnsupportedModel(
                f"model type {layout.model_type!r} is not supported: layer {i} caches {keys.shape[1]} key heads "
                f"and {values.shape[1]} value heads"
            )
        shapes.append((int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3])))
    if len(set(shapes)) != 1:
        per_layer = ", ".join(f"layer {i}: {h} heads, K {k}, V {v}" for i, (h, k, v) in enumerate(shapes))
        raise UnsupportedModel(
            f"model type {layout.model_type!r} is not supported: its layers cache KV of different shapes "
            f"({per_layer}); supported are models whose layers all cache the same heads and head sizes"
        )
    heads, k_dim, v_dim = shapes[0]
    return replace(layout, kv_heads=heads, key_dim=k_dim, value_dim=v_dim)


def stop_recording(cache: DynamicCache) -> None:
    """Let sliding layers forget tokens outside their window (after the state was taken)."""
    for layer in cache.layers:
        if isinstance(layer, RecordingSlidingWindowLayer):
            layer.stop_recording()


def memory_per_token(layout: Layout, kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes a stored state spends per token on each layer kind (all layers together).

    >>> memory_per_token(Layout("t", (FULL, SLIDING, SLIDING), (None, 512, 512)), 1, 256, torch.float32)
    {'full_attention': 2048, 'sliding_attention(window 512)': 4096}
    """
    per_layer = 2 * kv_heads * head_dim * dtype.itemsize
    out: dict[str, int] = {}
    for kind, window in zip(layout.kinds, layout.windows, strict=True):
        label = kind if window is None else f"{kind}(window {window})"
        out[label] = out.get(label, 0) + per_layer
    return out
