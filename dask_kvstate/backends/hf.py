"""Hugging Face transformers backend: prefill into KV tensors, resume from them, decode.

All KV handed in or out is one tensor ``[layers, 2, kv_heads, tokens, head_dim]`` (the
block layout), every token for every layer, sliding-window layers included, keys and
values of different head sizes (MLA) padded to the wider (see
:mod:`~dask_kvstate.backends.layout`). Inside a forward pass transformers wants a
``DynamicCache``; a forward with a cache appends to it in place, so a cache is always
built fresh from the stored tensors (``torch.cat`` copies) and stored tensors are
never mutated.

Decoding is a plain greedy / seeded-sampling loop rather than ``model.generate`` so
that text replay and every reuse path run the very same decode steps, and so that time
to first token is measured where it happens.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from dask_kvstate import config
from dask_kvstate.backends import attention, batch, compat, identity, layout, models, packed_linear
from dask_kvstate.backends.base import KV, Backend, GenerationResult, Row
from dask_kvstate.backends.cpu_attention import CPUAttention
from dask_kvstate.backends.decoding import generator, pick_token
from dask_kvstate.blocks import BlockKV, kv_identity
from dask_kvstate.generation import Sampling


def _joined(kv: KV | None) -> torch.Tensor | None:
    """``kv`` as one tensor: this backend reads a state joined (it is handed one unless it asks otherwise)."""
    return kv.joined() if isinstance(kv, BlockKV) else kv


class HFBackend(Backend):
    """One loaded causal LM with the few KV operations stateflow needs (the :class:`~.base.Backend` protocol).

    Parameters
    ----------
    name : str
        The model name it was loaded under (``smollm2-135m``, ``tiny-llama`` or a folder).
    model, tokenizer
        A transformers causal LM (eval mode) and its tokenizer.
    """

    #: torch's intra-op threads are this backend's threads: a worker may lend it idle ones
    elastic_threads = True
    #: ``generate`` hands out the generated tokens' KV too (``on_sequence``)
    sequence_kv = True
    #: a resume reads the state as one joined tensor, in place (shared-prefix attention)
    reads_blocks = False

    def __init__(self, name: str, model, tokenizer, device: str | None = None):
        self.name = name
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.to(self.device)
        # oneDNN on packed weights for the linear layers on CPU, gated MLPs fused
        # (kvstate.hf.packed-linear); how many, or why none, goes to engine_stats.
        self.packed_linear, self.packed_linear_skipped = (
            packed_linear.pack(self.model) if config.get("hf.packed-linear") else (0, "kvstate.hf.packed-linear is off")
        )
        self.fused_mlps = packed_linear.fuse_gated_mlps(self.model) if self.packed_linear else 0
        self.tokenizer = tokenizer
        self.config = model.config.get_text_config(decoder=True)
        # a config without the field (none known) falls back on the tokenizer's count
        self.vocab_size = int(getattr(self.config, "vocab_size", None) or len(tokenizer))
        # Refuses, naming the capability, a model whose KV is not per-token blocks.
        self.layout = layout.describe(model.config)
        layout.check_positions(model, self.layout.model_type)
        self.dtype = next(model.parameters()).dtype
        self.num_layers = self.layout.num_layers
        # What the cache really holds, from a one-token prefill: families name heads and head
        # sizes differently (or not at all: MLA's key size is two config fields).
        self.layout = layout.measure(self.layout, self.prefill([0])[0])
        assert self.layout.kv_heads is not None, "layout.measure sets the heads"
        self.kv_heads = self.layout.kv_heads
        self.head_dim = self.layout.head_dim  # stored width: keys and values padded to the wider
        self.kv_bytes_per_token = self.num_layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize
        # Attention routed through ours (.attention); shared-prefix (cascade) attention for
        # resumes where the model's attention reads what it caches (not MLA's latents).
        routed = attention.enable(self.model)
        self.cascade = routed and attention.attention_reads_cache(self.prefill) is None
        # vLLM's CPU attention kernel for prompts over themselves and sibling rows (kvstate.hf.vllm-attention).
        self.cpu_attention, self.cpu_attention_note = self._cpu_attention(routed)
        attention.use_cpu_attention(self.model, self.cpu_attention)
        self.config_fingerprint = self._config_fingerprint()
        self.model_fingerprint = self._model_fingerprint()
        self.kv_identity = kv_identity(self.model_fingerprint, self.config_fingerprint)
        self.eos_ids = identity.eos_ids(tokenizer, model.generation_config)
        self.cascade_fallbacks: Counter[str] = Counter()  # batched calls run per row instead, by reason
        # Tokenizers' Rust core is not re-entrant for one object across threads.
        self._tok_lock = threading.Lock()
        self._check_kv_shape()

    @classmethod
    def load(cls, name: str, cache_dir: str | None = None, device: str | None = None) -> HFBackend:
        """Load a model by name (raises ValueError listing the known names)."""
        model, tokenizer = models.load(name, cache_dir)
        return cls(name, model, tokenizer, device)

    # -- identity ------------------------------------------------------------------
    def _config_fingerprint(self) -> str:
        """The whole model config, the dtype, the attention implementation and the tokenizer
        (:func:`identity.config_fingerprint`): the same model loaded from two paths shares its blocks."""
        return identity.config_fingerprint(
            self.model.config.to_dict(),
            architecture=type(self.model).__name__,
            attention=getattr(self.model.config, "_kvstate_base_attn", self.model.config._attn_implementation)
            + ("+vllm-cpu-attention" if self.cpu_attention else ""),
            dtype=str(self.dtype),
            tokenizer=self.tokenizer,
        )

    def _cpu_attention(self, routed: bool) -> tuple[CPUAttention | None, str]:
        """vLLM's CPU attention kernel for this model's heads, or None; and what was chosen, or why not."""
        if not config.get("hf.vllm-attention"):
            return None, "kvstate.hf.vllm-attention is off"
        if self.device.type != "cpu":
            return None, f"the model runs on {self.device.type}, the kernel is vLLM's CPU one"
        base = getattr(self.model.config, "_kvstate_base_attn", None) if routed else None
        if base != "sdpa":  # eager's causal mask is always explicit, and eager may cap logits
            return None, f"the model's attention is {base or self.model.config._attn_implementation!r}, not sdpa"
        heads = getattr(self.config, "num_attention_heads", None)
        if not isinstance(heads, int):
            return None, "the config names no num_attention_heads"
        return CPUAttention.load(heads, self.kv_heads, self.head_dim, self.dtype)

    def _model_fingerprint(self) -> str:
        # The weights themselves: a re-quantized or fine-tuned checkpoint under the
        # same name gets a different fingerprint, so its KV is never mixed in.
        h = hashlib.blake2b(digest_size=16)
        for name, t in sorted(self.model.state_dict().items()):
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
            # reshape: a 0-dim parameter (a learned scalar) has no bytes view of its own
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return "m-" + h.hexdigest()

    # -- text ----------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of a whole prompt ``text``, as ``tokenizer(text)`` gives them to ``model.generate``.

        With the tokenizer's own special tokens: a model trained with a leading BOS
        (Gemma) drifts without it, and a chat template that carries its own (SmolLM2)
        adds none. Every state is the prefill of the tokens of its whole text, so the BOS
        sits at position 0 of the prefix and of every prompt that continues it.
        """
        with self._tok_lock:
            return list(self.tokenizer(text)["input_ids"])

    def detokenize(self, ids: list[int]) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- KV ------------------------------------------------------------------------
    def cache_from_kv(self, kv: torch.Tensor | None):
        """A fresh ``DynamicCache`` holding a copy of ``kv`` ([L, 2, H, T, D]) or empty."""
        if kv is not None:
            kv = kv.to(self.device, non_blocking=True)
        return layout.new_cache(self.layout, kv)

    @staticmethod
    def kv_from_cache(cache, start: int = 0) -> torch.Tensor:
        """The tokens of a batch-1 cache from ``start`` on as one ``[L, 2, H, T, D]`` tensor."""
        return layout.kv_of(cache, start)

    def kv_to_store(self, cache, start: int, block_tokens: int) -> torch.Tensor | BlockKV:
        """The tokens from ``start`` on as blocks laid out in one arena, each layer copied
        once from the cache (joining the layers first, then laying them out, copied twice)."""
        if start % block_tokens:
            return self.kv_from_cache(cache, start)
        return layout.blocks_of(cache, start, block_tokens)

    def _check_kv_shape(self) -> None:
        """Prefill one token and check its KV has the shape blocks assume (at load, not at first use).

        Also after routing attention through the cascade: the one-token KV must come out as
        it did before.
        """
        kv = self.kv_from_cache(self.prefill([0])[0])
        want = (self.num_layers, 2, self.kv_heads, 1, self.head_dim)
        if tuple(kv.shape) != want or kv.dtype != self.dtype:
            raise layout.UnsupportedModel(
                f"model type {self.layout.model_type!r} is not supported: its KV is {tuple(kv.shape)} {kv.dtype}, "
                f"expected [layers, 2, kv_heads, tokens, head_dim] = {want} {self.dtype} (every layer alike)"
            )

    def worth_reusing(self, reused: int, prompt: int) -> bool:
        """A past of a quarter of the prompt or more. Over a shorter one, the new tokens'
        attention costs more than computing the past again: a 3,025-token first visit over
        the 5 tokens of a header it shares took 4.2-4.5 s through the shared-prefix path and
        5.6-6.3 s through transformers' cache (whose attention over a past reads a mask
        whole), 3.5-3.8 s from scratch (SmolLM2-135M, 2 threads)."""
        return 4 * reused >= prompt

    @torch.inference_mode()
    def prefill(
        self, ids: list[int], past_kv: KV | None = None, keep_from: int = 0, *, namespace: str | None = None
    ) -> tuple[Any, torch.Tensor]:
        """Run ``ids[past_len:]`` through the model on top of ``past_kv``.

        ``namespace`` (the calling tenant) changes nothing here: the model keeps no KV
        between calls, and what is reused is the block store's, hashed with the namespace.

        Returns ``(cache, last_logits)``: the cache covers all of ``ids`` (``keep_from``,
        where the caller's use of the KV starts, changes nothing here: the cache holds it
        all anyway); the logits are those of the last position (only those are computed).
        """
        past_kv = _joined(past_kv)
        past_len = 0 if past_kv is None else int(past_kv.shape[3])
        assert past_len < len(ids), f"prefill needs at least one new token ({past_len} cached of {len(ids)})"
        cache = self.cache_from_kv(past_kv)
        x = torch.tensor([ids[past_len:]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, **compat.cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=1)
        return compat.output_cache(out), out.logits[0, -1].float()

    @torch.inference_mode()
    def decode(self, cache, logits: torch.Tensor, sampling: Sampling) -> tuple[list[int], float]:
        """Decode up to ``sampling.max_new_tokens`` from ``logits``; returns (ids, time of first token)."""
        gen = generator(self.device, sampling.temperature, sampling.seed)
        layout.stop_recording(cache)  # any state was taken at prefill; only the window is needed now
        out: list[int] = []
        first_at = time.perf_counter()
        for step in range(sampling.max_new_tokens):
            tok = pick_token(logits, sampling.temperature, sampling.top_p, gen)
            if step == 0:
                first_at = time.perf_counter()
            out.append(tok)
            if tok in self.eos_ids or step == sampling.max_new_tokens - 1:
                break
            x = torch.tensor([[tok]], dtype=torch.long, device=self.device)
            res = self.model(input_ids=x, **compat.cache_kwargs(self.model, cache), use_cache=True)
            cache, logits = compat.output_cache(res), res.logits[0, -1].float()
        return out, first_at

    def generate(
        self,
        ids: list[int],
        past_kv: KV | None,
        sampling: Sampling,
        *,
        started: float | None = None,
        on_prefill: Callable[[Any], None] | None = None,
        on_sequence: Callable[[Any, list[int]], None] | None = None,
        keep_from: int = 0,
        namespace: str | None = None,
    ) -> GenerationResult:
        """Generate from prompt ``ids`` as ``sampling`` says, reusing ``past_kv`` (or None) for its leading tokens.

        ``past_kv`` must be the KV of ``ids[:past_len]`` with ``past_len < len(ids)``.
        ``started`` is when the caller began (for TTFT); defaults to now. ``on_prefill``
        is called with the prompt's KV (a cache :meth:`kv_to_store` reads) before decoding
        goes on (the local prefix cache keeps the prompt's blocks there); its time counts
        as decode time. It holds every token, whatever ``keep_from`` says. ``on_sequence``
        instead gets the cache after decoding, holding the generated tokens' KV too (all
        but the last), with the ids it covers; where a sliding-window layer of
        transformers' own cache has dropped tokens (text replay of such a model), it gets
        the prompt's before decoding, with the prompt's ids.

        With ``past_kv``, the state is read where it lies (shared-prefix attention, as a
        resume reads it: :func:`batch.generate_batch` with one row), not copied into a
        transformers cache that each decode step then copies again: a returning visit to a
        3,000-token document (SmolLM2, 82 new prompt tokens) took 0.29 s to its first token
        through the cache, 0.21 s in place. Without, it is text replay
        (:meth:`generate_in_cache`), transformers' own computation.
        """
        t0 = time.perf_counter() if started is None else started
        if not ids:
            raise ValueError("cannot generate from an empty prompt: give at least one token of text")
        if on_prefill is not None and on_sequence is not None:
            raise ValueError("give on_prefill or on_sequence, not both: the sequence holds the prompt")
        past_kv = _joined(past_kv)
        if past_kv is None:
            return self.generate_in_cache(
                ids, None, sampling, started=t0, on_prefill=on_prefill, on_sequence=on_sequence
            )
        row = Row(list(ids), int(past_kv.shape[3]))
        return batch.generate_batch(
            self, [row], past_kv, sampling, started=t0, on_prefill=on_prefill, on_sequence=on_sequence
        )[0]

    def generate_in_cache(
        self,
        ids: list[int],
        past_kv: torch.Tensor | None,
        sampling: Sampling,
        *,
        started: float | None = None,
        on_prefill: Callable[[Any], None] | None = None,
        on_sequence: Callable[[Any, list[int]], None] | None = None,
    ) -> GenerationResult:
        """:meth:`generate` through transformers' own cache, ``past_kv`` (joined) copied into it:
        text replay, and the per-row fallback of a model the shared-prefix path cannot serve
        (both callers have checked ``ids``)."""
        t0 = time.perf_counter() if started is None else started
        p0 = time.perf_counter()
        cache, logits = self.prefill(ids, past_kv)
        p1 = time.perf_counter()
        # Decoding appends to the cache in place; a sliding-window layer drops what leaves its window.
        keeps_every_token = all(w is None for w in self.layout.windows)
        if on_prefill is not None:
            on_prefill(cache)
        elif on_sequence is not None and not keeps_every_token:
            on_sequence(cache, list(ids))
        out, first_at = self.decode(cache, logits, sampling)
        if on_sequence is not None and keeps_every_token:
            seq = list(ids) + out[:-1]
            # The decode steps' KV went into this cache object (transformers appends in place): checked, not assumed.
            if cache.get_seq_length() == len(seq):
                on_sequence(cache, seq)
        reused = 0 if past_kv is None else int(past_kv.shape[3])
        return GenerationResult(
            token_ids=out,
            ttft=(first_at - t0) if out else 0.0,
            prefill_s=p1 - p0,
            decode_s=time.perf_counter() - p1,
            prefill_tokens=len(ids) - reused,
            reused_tokens=reused,
        )

    def engine_stats(self) -> dict:
        """What computes here (the vLLM backend adds its engine's counters), how many linear
        layers run on oneDNN-packed weights (with the reason when none do), how many MLPs are
        fused, and whether vLLM's CPU attention kernel serves (with the layer calls it served)."""
        stats: dict[str, Any] = {
            "engine": "transformers",
            "packed_linear": self.packed_linear,
            "fused_mlps": self.fused_mlps,
        }
        if self.packed_linear_skipped:
            stats["packed_linear_skipped"] = self.packed_linear_skipped
        stats["vllm_attention"] = self.cpu_attention_note
        if self.cpu_attention is not None:
            stats["vllm_attention_layers"] = self.cpu_attention.calls
        return stats

    def generate_batch(
        self,
        rows: list[Row],
        prefix: KV | None,
        sampling: Sampling,
        *,
        started: float,
        namespace: str | None = None,
    ) -> list[GenerationResult]:
        """Rows sharing ``prefix``, decoded as one batch (:func:`batch.generate_batch`); ``namespace``
        as in :meth:`prefill`."""
        return batch.generate_batch(self, rows, _joined(prefix), sampling, started=started)

    # -- engine --------------------------------------------------------------------
    def on_engine_death(self, hook: Callable[[BaseException], None]) -> None:
        """Nothing to watch: the model runs in the calling thread, so a failure raises in the task itself."""

    def reset_engine_cache(self) -> bool:
        """False: no prefix cache of its own (the model keeps no KV between calls)."""
        return False

    def close(self) -> None:
        """Nothing to release: no thread or engine of its own; the model's memory goes with the object."""
