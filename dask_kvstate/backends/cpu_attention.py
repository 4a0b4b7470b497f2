"""vLLM's CPU attention kernel for the transformers backend, where vLLM is installed.

Why: with the linear layers on packed weights (:mod:`.packed_linear`), what is left of a
long prefill on the transformers backend is mostly attention, and torch's fused CPU kernel
(what sdpa runs, ``is_causal``) is about 2.5x slower there than vLLM's CPU attention
kernel on the same threads; for siblings decoding over one shared prefix, the kernel
reading shared pages takes half the time of the two partial attentions and their merge
(:mod:`.cascade`). So where vLLM is installed (``kvstate.hf.vllm-attention``) two kinds of
attention run it:

- a forward that attends causally over exactly its own tokens (no past, no mask, no
  window it would cut, no logit cap, no sinks): :meth:`CPUAttention.prompt`, reached
  through :mod:`.attention`;
- sibling rows over one prefix, the prefix's full pages shared by every row's block table
  as vLLM's prefix cache shares them (:mod:`.paged_rows`).

Everything else (single resumes, masks, windows, padding) stays where it was. The figures
are in ``docs/design/backends.md``.

How: the kernel reads keys and values from paged blocks in its own layout (keys stored
transposed inside a block), which only its ``cpu_attn_reshape_and_cache`` writes
(:meth:`CPUAttention.write`). It plans its work for the calling thread's OpenMP team
(``cpu_attn_get_scheduler_metadata``) and refuses a plan made for another team size (a
``RuntimeError``), so a plan is made in the thread that uses it (:meth:`CPUAttention.plan`).

Exactness: the same softmax over the same keys, summed in another order: outputs agree
with sdpa to a few 1e-7 in float32. :meth:`CPUAttention.load` runs both on the model's
head shapes before the kernel is used and keeps sdpa where they disagree, or where vLLM
is missing or refuses the shapes. The choice enters the backend's config fingerprint, so
states computed with and without it are never mixed.
"""

from __future__ import annotations

import os
import platform
import threading
from typing import Any

import torch
import torch.nn.functional as F

#: Tokens per page; the kernel wants a multiple of 32.
PAGE_TOKENS = 64

#: The most scratch-page memory a thread keeps between a prompt's layers (64 MiB: a
#: 43,000-token prompt of SmolLM2); longer prompts get pages per layer.
KEEP_SCRATCH_BYTES = 64 << 20

#: Prompt lengths the load-time check compares (one page, several with a partial last one).
CHECK_LENGTHS = (17, 200)

#: What vLLM's CPU attention backend serves (``vllm/v1/attention/backends/cpu_attn.py``,
#: ``CPUAttentionBackend``): written here because importing that module costs a worker
#: ~150 MB and 2 s more than the kernels themselves (``vllm._custom_ops``: ~190 MB, 1.8 s).
#: A build that disagrees fails the load-time check, and the model keeps torch's attention.
HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})
DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})

#: Keywords a layer hands its attention function that change nothing the kernel computes (or
#: that :meth:`CPUAttention.applies_to_prompt` checks itself). A call carrying any other with a
#: value (``position_bias``, say) keeps the model's own attention: the kernel would ignore it.
HARMLESS_KWARGS = frozenset(
    {
        "dropout",
        "scaling",
        "sliding_window",
        "softcap",
        "s_aux",
        "is_causal",
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "output_router_logits",
    }
)


class CPUAttention:
    """vLLM's CPU attention kernel for one model's heads; ``calls`` counts the layer calls it served."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, isa: str, ops) -> None:
        self.heads, self.kv_heads, self.head_dim, self.dtype = heads, kv_heads, head_dim, dtype
        self.isa, self._ops = isa, ops
        self.calls = 0
        self._local = threading.local()  # this thread's scratch pages and prompt plans

    @classmethod
    def load(cls, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[CPUAttention | None, str]:
        """The kernel for these heads, or None and why not (vLLM missing, shapes it refuses,
        results that differ from sdpa's)."""
        if heads % kv_heads:
            return None, f"{heads} query heads do not group over {kv_heads} kv heads"
        if head_dim not in HEAD_SIZES:
            return None, f"head size {head_dim} is not one vLLM's CPU kernel supports"
        if dtype not in DTYPES:
            return None, f"vLLM's CPU kernel does not run {dtype}"
        # vLLM's import sets process-wide variables for its own engines (inductor's compile
        # threads and cache folder, the library path); kvstate imports it for a kernel only,
        # so the worker's environment is put back as it was.
        environ = dict(os.environ)
        try:
            from vllm import _custom_ops as ops
        except Exception as e:  # not installed, or a build without the CPU kernels
            return None, f"vLLM's CPU attention kernel is not importable ({type(e).__name__}: {e})"
        finally:
            os.environ.clear()
            os.environ.update(environ)
        try:
            kernel = cls(heads, kv_heads, head_dim, dtype, _isa(dtype, head_dim), ops)
            worst = kernel._check()
        except Exception as e:
            return None, f"vLLM's CPU kernel failed its check ({type(e).__name__}: {e})"
        if worst > _tolerance(dtype):
            return None, f"vLLM's CPU kernel differs from sdpa by {worst:.2e} on these heads"
        kernel.calls = 0
        return kernel, f"vLLM cpu_attention_with_kv_cache ({kernel.isa})"

    # -- the kernel's pieces ----------------------------------------------------------
    def pages(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` zeroed pages, as the kernel's key and value views of them. Zeroed: the kernel
        reads a sequence's last page whole, and NaN in a slot past its end would reach the output."""
        return self._views(torch.zeros((n, self.kv_heads, 2 * PAGE_TOKENS, self.head_dim), dtype=self.dtype))

    @staticmethod
    def _views(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key_pages, value_pages = pages.chunk(2, dim=2)
        return key_pages, value_pages

    def write(self, key: torch.Tensor, value: torch.Tensor, key_pages, value_pages, slots: torch.Tensor) -> None:
        """Tokens' keys and values (``[tokens, kv_heads, D]``) into page slots (``page * PAGE_TOKENS + i``).

        The kernel checks none of this itself: a value narrower than the pages, or of another
        dtype, would be read past its end or reinterpreted."""
        want = (int(slots.shape[0]), self.kv_heads, self.head_dim)
        if tuple(key.shape) != want or tuple(value.shape) != want or {key.dtype, value.dtype} != {self.dtype}:
            raise ValueError(
                f"keys {tuple(key.shape)} {key.dtype} and values {tuple(value.shape)} {value.dtype} "
                f"for pages of {want} {self.dtype}"
            )
        self._ops.cpu_attn_reshape_and_cache(
            key.contiguous(),
            value.contiguous(),
            key_pages,
            value_pages,
            slots,
            self.isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )

    def plan(self, starts: torch.Tensor, lengths: torch.Tensor):
        """The kernel's work plan for sequences of ``lengths`` whose queries start at ``starts``
        (int32), for this thread's team size: use it in this thread only."""
        return self._ops.cpu_attn_get_scheduler_metadata(
            num_reqs=int(lengths.shape[0]),
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            seq_lens=lengths,
            dtype=self.dtype,
            query_start_loc=starts,
            causal=True,
            sliding_window_size=-1,
            isa=self.isa,
            enable_kv_split=False,
            dynamic_causal=None,
            kv_cache_dtype="auto",
        )

    def attend(self, query, key_pages, value_pages, starts, lengths, table, plan, scaling: float | None):
        """Causal attention of ``query`` (``[tokens, heads, D]``, each sequence's queries its last
        tokens) over the pages ``table`` lists per sequence, scaled by the module's ``scaling``
        (None: ``D ** -0.5``); ``[tokens, heads, D]``."""
        out = torch.empty(query.shape, dtype=query.dtype)
        self._ops.cpu_attention_with_kv_cache(
            query=query.contiguous(),
            key_cache=key_pages,
            value_cache=value_pages,
            output=out,
            query_start_loc=starts,
            seq_lens=lengths,
            scale=float(scaling if scaling is not None else self.head_dim**-0.5),
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=table,
            softcap=0.0,
            scheduler_metadata=plan,
            s_aux=None,
            dynamic_causal=None,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        self.calls += 1
        return out

    # -- a prompt attending over itself ------------------------------------------------
    def applies_to_prompt(
        self,
        module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask,
        kwargs: dict[str, Any],
    ) -> bool:
        """Whether this layer call is causal attention over exactly its own tokens, as :meth:`prompt` computes it.

        transformers hands sdpa no mask exactly when none is needed beyond causality (no
        padding, no past); a window longer than the prompt cuts nothing. Not a call that needs
        gradients: the kernel has no backward.
        """
        T = query.shape[2]
        window = kwargs.get("sliding_window")
        return (
            attention_mask is None
            and query.device.type == "cpu"
            and query.dtype == key.dtype == value.dtype == self.dtype
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
            and key.shape[2] == T
            and query.shape[0] == key.shape[0]
            and query.shape[1] == self.heads
            and key.shape[1] == self.kv_heads
            and query.shape[-1] == key.shape[-1] == self.head_dim
            and value.shape == key.shape
            and all(v is None or k in HARMLESS_KWARGS for k, v in kwargs.items())
            and kwargs.get("is_causal", getattr(module, "is_causal", True))
            and (window is None or window >= T)
            and not kwargs.get("softcap")
            and kwargs.get("s_aux") is None
            and not kwargs.get("dropout")
        )

    def prompt(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        """``[B, T, heads, D]`` (transformers' layout for an attention output) from ``[B, heads, T, D]`` inputs."""
        B, H, T, D = query.shape
        pages = -(-T // PAGE_TOKENS)
        key_pages, value_pages = self._scratch(B * pages)
        slots = (torch.arange(B)[:, None] * (pages * PAGE_TOKENS) + torch.arange(T)[None, :]).reshape(-1)
        if T % PAGE_TOKENS:  # a reused page's slots past the prompt's end hold an earlier prompt's
            last = torch.arange(1, B + 1) * pages - 1
            key_pages[last] = 0
            value_pages[last] = 0
        self.write(tokens_major(key), tokens_major(value), key_pages, value_pages, slots)
        starts, lengths, table, plan = self._prompt_plan(B, T, pages)
        out = self.attend(tokens_major(query), key_pages, value_pages, starts, lengths, table, plan, scaling)
        return out.view(B, T, H, D)

    def _scratch(self, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This thread's scratch pages, at least ``pages`` of them, kept for the next layer up
        to :data:`KEEP_SCRATCH_BYTES` (memory no budget counts: a few MiB for most prompts)."""
        have = getattr(self._local, "pages", None)
        if have is None or have.shape[0] < pages:
            have = torch.zeros((pages, self.kv_heads, 2 * PAGE_TOKENS, self.head_dim), dtype=self.dtype)
            self._local.pages = have if have.nbytes <= KEEP_SCRATCH_BYTES else None
        return self._views(have[:pages])

    def _prompt_plan(self, B: int, T: int, pages: int):
        """Query starts, lengths, block table and plan for B prompts of T tokens, cached per
        team size and shape (every layer of a forward asks for the same)."""
        threads = torch.get_num_threads()
        plans = getattr(self._local, "plans", None)
        if plans is None:
            plans = self._local.plans = {}
        key = (threads, B, T)
        if key not in plans:
            if len(plans) > 64:  # prompts of many lengths: keep the recent ones
                plans.clear()
            starts = torch.arange(B + 1, dtype=torch.int32) * T
            lengths = torch.full((B,), T, dtype=torch.int32)
            table = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
            plans[key] = (starts, lengths, table, self.plan(starts, lengths))
        return plans[key]

    def _check(self) -> float:
        """The largest difference from sdpa over both uses: prompts of :data:`CHECK_LENGTHS`
        (two at once), and two rows decoding one token each over a page they share and a page
        each (the layout :mod:`.paged_rows` builds)."""
        g = torch.Generator().manual_seed(0)
        group = self.heads // self.kv_heads

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=g).to(self.dtype)

        def plain(q, k, v, mask=None):
            k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None).transpose(-3, -2)

        worst = 0.0
        for T in CHECK_LENGTHS:
            q = rand(2, self.heads, T, self.head_dim)
            k, v = rand(2, self.kv_heads, T, self.head_dim), rand(2, self.kv_heads, T, self.head_dim)
            worst = max(worst, float((self.prompt(q, k, v, None).float() - plain(q, k, v).float()).abs().max()))
        # Rows 0 and 1: the shared page 0 (64 tokens), then 10 tokens of their own in pages 1 and 2.
        shared_k, shared_v = (
            rand(PAGE_TOKENS, self.kv_heads, self.head_dim),
            rand(PAGE_TOKENS, self.kv_heads, self.head_dim),
        )
        own_k, own_v = rand(2, 10, self.kv_heads, self.head_dim), rand(2, 10, self.kv_heads, self.head_dim)
        key_pages, value_pages = self.pages(3)
        self.write(shared_k, shared_v, key_pages, value_pages, torch.arange(PAGE_TOKENS))
        slots = torch.cat([torch.arange(10) + PAGE_TOKENS * (1 + b) for b in range(2)])
        self.write(
            own_k.reshape(20, self.kv_heads, -1), own_v.reshape(20, self.kv_heads, -1), key_pages, value_pages, slots
        )
        q = rand(2, self.heads, self.head_dim)
        starts, lengths = torch.arange(3, dtype=torch.int32), torch.full((2,), PAGE_TOKENS + 10, dtype=torch.int32)
        table = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)
        got = self.attend(q, key_pages, value_pages, starts, lengths, table, self.plan(starts, lengths), None)
        for b in range(2):
            keys = torch.cat([shared_k, own_k[b]]).transpose(0, 1)  # [H, 74, D]
            values = torch.cat([shared_v, own_v[b]]).transpose(0, 1)
            want = plain(q[b][:, None], keys, values, torch.ones(1, PAGE_TOKENS + 10, dtype=torch.bool))[0]
            worst = max(worst, float((got[b].float() - want.float()).abs().max()))
        return worst


def _isa(dtype: torch.dtype, head_dim: int) -> str:
    """The kernel variant vLLM's CPU backend picks for these heads on this CPU with pages of
    :data:`PAGE_TOKENS` (its ``_get_attn_isa``; see :data:`HEAD_SIZES` for why not imported)."""
    if head_dim % 32 and head_dim % 16 == 0:
        return "vec16"
    if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        return "amx"
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "neon"
    return "vec"


def tokens_major(t: torch.Tensor) -> torch.Tensor:
    """``[B, heads, T, D]`` (transformers' layout) as the kernel's ``[B * T, heads, D]``."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def _tolerance(dtype: torch.dtype) -> float:
    """How far two correct attentions over unit-normal inputs may differ in ``dtype``."""
    return 1e-4 if dtype == torch.float32 else 3e-2
