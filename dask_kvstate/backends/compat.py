"""The few transformers interfaces that differ across the supported releases, found by inspection.

One environment may need to serve this backend and vLLM's CPU build, which pins an
older transformers than the newest; so the backend runs on every release from 5.16.1
on. Where the releases differ, the difference is detected from transformers itself
(a keyword a forward accepts, a field an output has), never from a version number, so
a release in between or a backport behaves as what it is.

- The cache a forward reads and extends is the keyword ``cache`` in newer releases and
  ``past_key_values`` in older ones (newer ones still accept the old name, with a
  deprecation warning per call site); so is the field of the output that returns it.
- ``logits_to_keep`` as one position per row is understood by newer models only.
- Older releases run Gemma2 on sdpa, which drops its attention softcap; the cascade
  follows the base attention there (:mod:`~dask_kvstate.backends.cascade`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

NEW_CACHE_NAME = "cache"
OLD_CACHE_NAME = "past_key_values"


# Model class -> its cache keyword: looked up on every forward, so inspected once per class.
_CACHE_KEYWORDS: dict[type, str] = {}


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword ``model``'s forward takes its KV cache under (``cache`` or ``past_key_values``)."""
    cls = type(model)
    name = _CACHE_KEYWORDS.get(cls)
    if name is None:
        # inspect.signature follows functools.wraps, so transformers' deprecation wrappers
        # show the signature of the forward they wrap.
        params = inspect.signature(cls.forward).parameters
        name = _CACHE_KEYWORDS[cls] = NEW_CACHE_NAME if NEW_CACHE_NAME in params else OLD_CACHE_NAME
    return name


def cache_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for a call of ``model``: its cache under the name its forward uses."""
    return {cache_keyword(model): cache}


def output_cache(output) -> Any:
    """The cache a forward returned (``output.cache``, or ``output.past_key_values`` where that is its field).

    Read by field name, so a newer output's deprecated ``past_key_values`` alias (which
    warns) is never touched; None where the output has neither field.
    """
    fields = getattr(output, "__dataclass_fields__", {})
    # None for a model whose output has no cache at all (a recurrent one): the backend's
    # load refuses it, naming that (layout.measure).
    return getattr(output, NEW_CACHE_NAME if NEW_CACHE_NAME in fields else OLD_CACHE_NAME, None)


def rows_logits(logits: torch.Tensor) -> torch.Tensor:
    """Each row's logits ``[B, V]`` from a forward given ``logits_to_keep`` = one position per row (``[B, 1]``).

    Newer models keep row b's own position (``[B, 1, V]`` out). A model that predates
    per-row positions indexes every row with all of them (``hidden[:, positions]``), giving
    ``[B, B, 1, V]`` whose entry ``[b, b, 0]`` is row b at its own position: told apart by
    the shape, so either kind of model serves the batch.

    >>> every_row_at_every_position = torch.arange(12).reshape(2, 2, 1, 3)
    >>> rows_logits(every_row_at_every_position).tolist()
    [[0, 1, 2], [9, 10, 11]]
    >>> rows_logits(torch.arange(6).reshape(2, 1, 3)).tolist()
    [[0, 1, 2], [3, 4, 5]]
    """
    if logits.ndim == 4:
        rows = torch.arange(logits.shape[0], device=logits.device)
        return logits[rows, rows, 0]
    return logits[:, -1]
