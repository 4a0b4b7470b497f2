"""What a backend is: the one interface the worker runtime, the operators and the tests use.

A backend is one loaded model behind the few KV operations a worker needs: tokenize,
say what shape its KV has, prefill into KV, generate reusing KV, decode sibling rows over
one shared prefix, report its stats and close. :class:`Backend` lists them, typed, the
way vLLM's ``KVConnectorBase_V1`` fixes what a connector is, so that a third engine
knows what to provide and mypy checks the two there are (transformers in
:mod:`~dask_kvstate.backends.hf`, vLLM in :mod:`~dask_kvstate.backends.vllm`), which
subclass it explicitly. Nothing outside ``dask_kvstate.backends`` names a concrete
backend: :func:`~dask_kvstate.backends.load_backend` picks one by ``kvstate.backend``.

KV crosses the interface in one form, :data:`KV`: every token of every layer as
``[layers, 2, kv_heads, tokens, head_dim]``, either one tensor or the store's blocks in
token order (:class:`~dask_kvstate.blocks.BlockKV`, for an engine that copies them into
its own pages and would only pay for a join first). Every backend accepts both; its
``reads_blocks`` says which one it would rather be handed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from dask_kvstate.blocks import BlockKV

if TYPE_CHECKING:
    from dask_kvstate.backends.layout import Layout
    from dask_kvstate.generation import Sampling

__all__ = ["KV", "Backend", "GenerationResult", "Row"]

#: A state's KV as it crosses the interface: one ``[L, 2, H, T, D]`` tensor or its blocks.
KV = torch.Tensor | BlockKV


@dataclass
class GenerationResult:
    """Token ids out of one generation, and where the time went (every backend's one result type)."""

    token_ids: list[int]
    ttft: float  # seconds from the call to the first new token
    prefill_s: float
    decode_s: float
    prefill_tokens: int  # tokens pushed through the model before decoding
    reused_tokens: int  # prompt tokens whose KV came from a state


@dataclass
class Row:
    """One sibling of :meth:`Backend.generate_batch`: its prompt ids, how many leading ones the
    shared prefix covers, its own seed (None: the batch's :class:`~dask_kvstate.generation.Sampling` seed)."""

    ids: list[int]
    keep: int = 0  # ids[:keep] are the prefix's first keep tokens; keep < len(ids)
    seed: int | None = None


@runtime_checkable
class Backend(Protocol):
    """One loaded model with the KV operations a worker runs on it.

    Attributes
    ----------
    name : str
        The model name it was loaded under (a known name, a folder or a ``.gguf`` file).
    tokenizer
        The model's tokenizer (a transformers tokenizer for both backends here).
    model
        The in-process transformers model where there is one (references and the batched
        path call it), None for an engine that keeps its model to itself.
    device, dtype
        Where KV handed in and out lives, and its dtype.
    vocab_size : int
        Token ids below it are valid input (probes draw random prompts from it).
    eos_ids : frozenset
        Token ids that end a generation (the tokenizer's and the generation config's).
    layout
        Each layer's kind and window (:class:`~dask_kvstate.backends.layout.Layout`): what a
        block holds for a sliding-window layer differs from a full-attention one.
    num_layers, kv_heads, head_dim : int
        The KV shape ``[num_layers, 2, kv_heads, tokens, head_dim]`` of every block.
    kv_bytes_per_token : int
        Bytes of KV one token takes (the transfer-or-recompute rule and memory budgets price with it).
    model_fingerprint, config_fingerprint : str
        The weights, and everything else that shapes KV (config, dtype, attention, tokenizer,
        engine): reuse is allowed only where both match.
    kv_identity : bytes
        What every block hash folds in, from the two fingerprints.
    reads_blocks : bool
        A resume would rather be handed the state unjoined (:class:`~dask_kvstate.blocks.BlockKV`).
    sequence_kv : bool
        :meth:`generate` takes ``on_sequence``: it can hand out the KV of the tokens it
        generated, not only the prompt's (a backend without it: False, the default).
    elastic_threads : bool
        torch's intra-op thread count is this backend's: a worker may lend it idle threads
        for a long prefill (False for an engine that binds its own threads at start).
    cascade_fallbacks : collections.Counter
        Batched calls run one row at a time instead, by reason (shown in ``kvs.stats``).
    """

    name: str
    tokenizer: Any
    model: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    eos_ids: frozenset[int]
    layout: Layout
    num_layers: int
    kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    model_fingerprint: str
    config_fingerprint: str
    kv_identity: bytes
    reads_blocks: bool
    sequence_kv: bool = False
    elastic_threads: bool
    cascade_fallbacks: Counter[str]

    # -- text ----------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of a whole prompt, as ``tokenizer(text)`` gives them (special tokens included)."""
        ...

    def detokenize(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens skipped."""
        ...

    # -- KV ------------------------------------------------------------------------
    def prefill(
        self, ids: list[int], past_kv: KV | None = None, keep_from: int = 0, *, namespace: str | None = None
    ) -> tuple[Any, torch.Tensor | None]:
        """Compute the KV of ``ids`` on top of ``past_kv`` (the KV of their leading tokens).

        Returns ``(cache, last_logits)``: ``cache`` is the backend's own form, read with
        :meth:`kv_from_cache`, and holds the KV from the block of token ``keep_from`` on at
        least (where the caller's use starts); the logits of the last position, or None
        where the engine keeps them. ``namespace`` is the calling tenant's.
        """
        ...

    def kv_from_cache(self, cache: Any, start: int = 0) -> torch.Tensor:
        """The ``[L, 2, H, T, D]`` tensor of a cache :meth:`prefill` (or ``on_prefill``) handed
        out, from token ``start`` on or earlier (the caller reads where it begins from its length).

        ``start`` is where the caller's use begins (the tokens before are stored already):
        a long cache copied out whole to store the one block a question added would delay
        a returning visit's first token by a copy of its whole context."""
        ...

    def kv_to_store(self, cache: Any, start: int, block_tokens: int) -> torch.Tensor | BlockKV:
        """:meth:`kv_from_cache`'s KV in the form the worker stores, whichever the backend
        can give with the fewest copies: that ``[L, 2, H, T, D]`` tensor (the default,
        which the worker then lays out as blocks, one more copy), or its blocks of
        ``block_tokens`` already laid out in one buffer (:class:`~dask_kvstate.blocks.Arena`,
        from token ``start``, a block boundary), written once from the backend's own
        cache."""
        return self.kv_from_cache(cache, start)

    # -- generation ----------------------------------------------------------------
    def generate(
        self,
        ids: list[int],
        past_kv: KV | None,
        sampling: Sampling,
        *,
        started: float | None = None,
        on_prefill: Callable[[Any], None] | None = None,
        keep_from: int = 0,
        namespace: str | None = None,
    ) -> GenerationResult:
        """Generate from ``ids`` as ``sampling`` says, reusing ``past_kv`` for their leading tokens.

        Greedy output must equal text replay (``past_kv=None``) token for token.
        ``started`` is when the caller began (for TTFT); ``on_prefill`` is called with the
        prompt's cache (see :meth:`kv_from_cache`) before decoding, holding the KV from the
        block of token ``keep_from`` on at least (as :meth:`prefill`'s). A backend with
        :attr:`sequence_kv` also takes ``on_sequence(cache, ids)`` instead: called after
        decoding with the cache of the prompt and the generated tokens but the last (the
        last has no KV yet), from the same block on, and the ids of those tokens.
        """
        ...

    def generate_batch(
        self,
        rows: list[Row],
        prefix: KV | None,
        sampling: Sampling,
        *,
        started: float,
        namespace: str | None = None,
    ) -> list[GenerationResult]:
        """One result per row, each the tokens ``generate(row.ids, prefix's first row.keep tokens, ...)`` gives."""
        ...

    def worth_reusing(self, reused: int, prompt: int) -> bool:
        """Whether a ``prompt``-token prompt is computed sooner over the stored KV of its first
        ``reused`` tokens than whole. The local prefix cache and ``materialize`` ask before
        reusing what they find stored (a shared system prompt before a new document is a
        short past); an explicit state is always reused. Default: always, as an engine
        whose kernels take a past as it comes (vLLM's) is."""
        return True

    # -- engine --------------------------------------------------------------------
    def engine_stats(self) -> dict:
        """What computes here and its counters (``kvs.stats`` shows them under ``engine``)."""
        ...

    def on_engine_death(self, hook: Callable[[BaseException], None]) -> None:
        """Call ``hook(error)`` if the engine stops for good, so the worker leaves the cluster."""
        ...

    def reset_engine_cache(self) -> bool:
        """Drop any prefix cache the engine keeps of its own; True if there was one to drop."""
        ...

    def close(self) -> None:
        """Release what the backend holds beyond Python objects (threads, engine memory)."""
        ...
