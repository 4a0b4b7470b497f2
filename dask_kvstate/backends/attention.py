"""Where a transformers model's attention goes when the transformers backend runs it.

The model keeps its attention implementation, but under a name of ours
(``kvstate_cascade_<base>``, :func:`attn_name`) whose function, :func:`_dispatch`,
sends each layer's call to one of three places:

- a forward run inside :func:`~.cascade.serving` (a context variable, so per thread): the
  rows' shared-prefix attention, :meth:`~.cascade.SharedPrefixKV.attend`;
- a forward attending causally over exactly its own tokens, where the backend loaded vLLM's
  CPU kernel for the model (:func:`use_cpu_attention`, :mod:`.cpu_attention`): that kernel;
- anything else: the implementation the model had (sdpa or eager), with the same
  arguments, so text replay and the block-store paths compute what they did.

A context variable rather than a forward keyword, because some decoder layers drop the
keywords they do not know instead of passing them on to attention (StableLM's), and
their attention would then silently attend to its own tokens only.
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from dask_kvstate.backends.cascade import _SERVING, CascadeUnsupported
from dask_kvstate.backends.cpu_attention import CPUAttention

ATTN_PREFIX = "kvstate_cascade_"


def attn_name(base: str) -> str:
    """The name a model of base implementation ``base`` runs under.

    One per base, not one for all: transformers picks a model's *mask* function by its
    attention name, and eager and sdpa want different masks (eager an additive float
    mask, sdpa a boolean one), so models of both kinds on one worker need two names.
    """
    return ATTN_PREFIX + base


#: Where :func:`attention_reads_cache` collects what each layer's attention was handed, or None.
_WATCHING: contextvars.ContextVar[list | None] = contextvars.ContextVar("kvstate_cascade_watch", default=None)


def _dispatch(module, query, key, value, attention_mask, **kwargs):
    """One layer's attention: the cascade's inside :func:`~.cascade.serving`, else vLLM's CPU
    kernel's for a prompt over itself, else the model's own implementation."""
    kvstate_cascade = _SERVING.get()
    if kvstate_cascade is not None:
        if kwargs.get("dropout"):
            raise CascadeUnsupported("attention dropout")
        # sdpa has no logit softcap: some transformers releases run Gemma2 on sdpa and drop
        # its softcap there, others refuse sdpa for it; either way the model's own attention
        # applies none, so neither does the cascade.
        softcap = None if module.config._kvstate_base_attn == "sdpa" else kwargs.get("softcap")
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise CascadeUnsupported(f"attention module {type(module).__name__} names no layer_idx")
        out = kvstate_cascade.attend(
            layer,
            query,
            key,
            value,
            kwargs.get("scaling"),
            softcap=softcap,
            sinks=kwargs.get("s_aux"),
            window=kwargs.get("sliding_window"),
        )
        return out, None
    watching = _WATCHING.get()
    if watching is not None:
        watching.append((getattr(module, "layer_idx", None), key, value))
    kernel = getattr(module, CPU_ATTENTION_ATTR, None)
    if kernel is not None and kernel.applies_to_prompt(module, query, key, value, attention_mask, kwargs):
        return kernel.prompt(query, key, value, kwargs.get("scaling")), None
    base = _base_attention(module.config._kvstate_base_attn, type(module).__module__)
    return base(module, query, key, value, attention_mask, **kwargs)


def attention_reads_cache(prefill: Callable[[list[int]], Any]) -> str | None:
    """Why the cascade can't serve a model, found by one prefill: None when its attention reads the cache.

    The cascade stands in for attention over the cached keys and values, so it is exact
    only where each layer's attention is handed exactly what that layer caches. Where it
    is not (multi-head latent attention caches a compressed latent and expands it into
    keys and values per head after the cache), the model keeps its own attention over a
    cache built from the state, row by row. ``prefill(ids)`` returns ``(cache, logits)``.
    """
    seen: list = []
    token = _WATCHING.set(seen)
    try:
        cache, _ = prefill([0])
    finally:
        _WATCHING.reset(token)
    layers = cache.layers
    if sorted(i for i, _, _ in seen if isinstance(i, int)) != list(range(len(layers))):
        return "its attention modules do not run once per cache layer, each naming its layer_idx"
    for i, key, value in seen:
        cached = layers[i]
        if not all(a.shape == b.shape and torch.equal(a, b) for a, b in ((key, cached.keys), (value, cached.values))):
            return f"layer {i}'s attention is handed keys and values other than those it caches"
    return None


@functools.cache
def _base_attention(base: str, module_name: str) -> Callable[..., Any]:
    """The implementation a model had: sdpa from transformers' registry, or eager from the
    model's own modeling file (each family has its own eager function, so it is looked up
    by the attention module's file, never shared across models). Cached: it runs for every
    layer of every forward that is not a cascade one."""
    if base == "eager":
        return sys.modules[module_name].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


def enable(model) -> bool:
    """Route ``model``'s attention through :func:`_dispatch`; False if the model can't be routed.

    Registers :func:`attn_name` of its base with transformers' attention and mask interfaces (the
    mask function is the base implementation's, so non-cascade calls are unchanged).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    base = model.config._attn_implementation
    if base.startswith(ATTN_PREFIX):
        return True
    if base not in ("sdpa", "eager") or base not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return False
    if base == "eager" and getattr(sys.modules[type(model).__module__], "eager_attention_forward", None) is None:
        return False
    name = attn_name(base)
    AttentionInterface.register(name, _dispatch)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    for config in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
        config._kvstate_base_attn = base
    model.set_attn_implementation(name)
    return model.config._attn_implementation == name


#: The attribute of a model's attention modules that holds its :class:`CPUAttention`.
CPU_ATTENTION_ATTR = "_kvstate_cpu_attention"


def use_cpu_attention(model, kernel: CPUAttention | None) -> int:
    """Give ``model``'s layers ``kernel`` for prompts attending over themselves (None: take it
    away); returns how many modules hold it. On the modules, not the config: the config is
    serialized (and fingerprinted), a kernel is not data."""
    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)]
    for m in modules:
        setattr(m, CPU_ATTENTION_ATTR, kernel)
    return len(modules) if kernel is not None else 0
