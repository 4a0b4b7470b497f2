"""What k siblings over one shared prefix cost in vLLM's CPU attention, one layer call at a time.

::

    python -m dask_kvstate.bench vllm-shared-prefix                      # SmolLM2's heads, 16 rows, 4,096 tokens
    python -m dask_kvstate.bench vllm-shared-prefix --rows 8 --prefix 1024 --queries 1 32

The question behind it: would a shared-prefix ("cascade") attention kernel make kvstate's
siblings over vLLM faster, as it does over transformers? It times vLLM's own paged
attention kernel (``cpu_attention_with_kv_cache``, the one its CPU backend calls) on
``rows`` requests, each ``queries`` new tokens after a ``prefix``-token prefix and a short
suffix of its own, in two block layouts:

- ``shared``: every row's block table points at the same prefix blocks, as vLLM's prefix
  cache gives siblings (and kvstate's branches over vLLM);
- ``copies``: each row has its own copy of the prefix (what an engine without shared
  blocks reads: ``rows`` times the bytes);

and, beside them, ``two-gemms``: the prefix part as a shared-prefix kernel would compute
it at best (the rows' queries against the prefix's keys in one batched matmul, then the
weights against its values, contiguous, no softmax, no suffix): the arithmetic floor in
torch. Each figure is the median of ``repeats`` calls, with the attention FLOPs it did
(4 x rows x queries x heads x keys x head_dim) per second. A shared-prefix kernel can
only save what ``copies`` costs over ``shared`` (the prefix's bytes, read once instead
of once per row); it cannot save FLOPs, which are per query. The kernel's outputs in the
two layouts are checked equal (the same keys, in other blocks).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from dask_kvstate.bench.raw_vllm import cpu_model
from dask_kvstate.bench.serve_path import median_ms


@dataclasses.dataclass
class Options:
    """The attention shape; the defaults are SmolLM2-135M's (9 query heads, 3 KV heads of 64)."""

    rows: int = dataclasses.field(default=16, metadata={"help": "requests sharing the prefix"})
    prefix: int = dataclasses.field(default=4096, metadata={"help": "tokens of the shared prefix"})
    suffix: int = dataclasses.field(default=32, metadata={"help": "tokens each row has after the prefix"})
    queries: list[int] = dataclasses.field(
        default_factory=lambda: [1, 32],
        metadata={"help": "new tokens per row in a call: 1 is a decode step, more a suffix prefill", "nargs": "+"},
    )
    heads: int = dataclasses.field(default=9, metadata={"help": "query heads"})
    kv_heads: int = dataclasses.field(default=3, metadata={"help": "KV heads"})
    head_dim: int = dataclasses.field(default=64, metadata={"help": "head size"})
    block_tokens: int = dataclasses.field(default=64, metadata={"help": "tokens per KV block"})
    repeats: int = dataclasses.field(default=20, metadata={"help": "timed calls per figure (the median is shown)"})


class _Paged:
    """``rows`` requests' KV in vLLM's CPU block layout, written by vLLM's own cache writer."""

    def __init__(self, args: Options, *, shared: bool, keys: torch.Tensor, values: torch.Tensor) -> None:
        from vllm import _custom_ops as ops

        # vLLM's own choice of kernel variant for this dtype and block size (private, but the
        # probe must time the kernel vLLM's CPU backend would run, not one picked by hand).
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        bs, rows = args.block_tokens, args.rows
        prefix_blocks = args.prefix // bs
        own_blocks = -(-(args.suffix + max(args.queries)) // bs)
        self.isa = _get_attn_isa(torch.float32, bs, args.head_dim)
        per_row = own_blocks + (0 if shared else prefix_blocks)
        num_blocks = (prefix_blocks if shared else 0) + rows * per_row
        cache = torch.zeros(num_blocks, args.kv_heads, 2 * bs, args.head_dim)
        self.key_cache, self.value_cache = cache.chunk(2, dim=2)
        self.block_table = torch.zeros(rows, prefix_blocks + own_blocks, dtype=torch.int32)
        for r in range(rows):
            first = (prefix_blocks if shared else 0) + r * per_row
            prefix = torch.arange(prefix_blocks) if shared else torch.arange(first, first + prefix_blocks)
            own = torch.arange(own_blocks) + first + (0 if shared else prefix_blocks)
            self.block_table[r] = torch.cat([prefix, own]).int()
        # Row r's token t (prefix tokens the same in every row) -> its slot, written by vLLM.
        tokens = keys.shape[1]
        for r in range(rows):
            blocks = self.block_table[r].long()
            slots = blocks[torch.arange(tokens) // bs] * bs + torch.arange(tokens) % bs
            ops.cpu_attn_reshape_and_cache(
                keys[r], values[r], self.key_cache, self.value_cache, slots, self.isa,
                k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
            )  # fmt: skip

    def plan(self, queries: int, seq_lens: torch.Tensor, args: Options) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' query offsets and the kernel's work plan: built once a step in vLLM, for every layer."""
        from vllm import _custom_ops as ops

        starts = torch.arange(args.rows + 1, dtype=torch.int32) * queries
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=args.rows, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
            seq_lens=seq_lens, dtype=torch.float32, query_start_loc=starts, causal=True,
            sliding_window_size=-1, isa=self.isa, enable_kv_split=False, dynamic_causal=None,
            kv_cache_dtype="auto",
        )  # fmt: skip
        return starts, metadata

    def attend(self, query: torch.Tensor, seq_lens: torch.Tensor, plan: tuple, args: Options) -> torch.Tensor:
        """One layer's attention call, as vLLM's CPU backend makes it."""
        from vllm import _custom_ops as ops

        starts, metadata = plan
        out = torch.empty_like(query)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=self.key_cache, value_cache=self.value_cache, output=out,
            query_start_loc=starts, seq_lens=seq_lens, scale=args.head_dim**-0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=self.block_table, softcap=0,
            scheduler_metadata=metadata, s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0,
            kv_cache_dtype="auto",
        )  # fmt: skip
        return out


def command(args: Options) -> dict[str, Any]:
    """Time each layout for each query count; print and return the table."""
    if args.prefix % args.block_tokens or args.heads % args.kv_heads:
        raise ValueError(
            f"--prefix {args.prefix} must be a multiple of --block-tokens {args.block_tokens}, "
            f"and --heads {args.heads} of --kv-heads {args.kv_heads}"
        )
    gen = torch.Generator().manual_seed(0)
    tokens = args.prefix + args.suffix + max(args.queries)
    shape = (args.rows, tokens, args.kv_heads, args.head_dim)
    keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    keys[:, : args.prefix], values[:, : args.prefix] = keys[0, : args.prefix], values[0, : args.prefix]
    layouts = {name: _Paged(args, shared=name == "shared", keys=keys, values=values) for name in ("shared", "copies")}
    group = args.heads // args.kv_heads
    prefix_k = keys[0, : args.prefix].permute(1, 2, 0).contiguous()  # kv_heads, head_dim, prefix
    prefix_v = values[0, : args.prefix].transpose(0, 1).contiguous()  # kv_heads, prefix, head_dim
    table = []
    for q in args.queries:
        query = torch.randn(args.rows * q, args.heads, args.head_dim, generator=gen)
        seq_lens = torch.full((args.rows,), args.prefix + args.suffix + q, dtype=torch.int32)
        plans = {name: paged.plan(q, seq_lens, args) for name, paged in layouts.items()}
        outs = {name: paged.attend(query, seq_lens, plans[name], args) for name, paged in layouts.items()}
        if not torch.equal(outs["shared"], outs["copies"]):
            raise AssertionError("vLLM's kernel gave other outputs for the same keys in other blocks")
        grouped = query.view(args.rows * q, args.kv_heads, group, args.head_dim).transpose(0, 1)
        grouped = grouped.reshape(args.kv_heads, args.rows * q * group, args.head_dim).contiguous()

        def two_gemms(grouped=grouped):
            torch.bmm(torch.bmm(grouped, prefix_k), prefix_v)

        flops = 4 * args.rows * q * args.heads * (args.prefix + args.suffix + q) * args.head_dim
        row: dict[str, Any] = {"queries": q}
        for name, paged in layouts.items():
            call = functools.partial(paged.attend, query, seq_lens, plans[name], args)
            row[f"{name}_ms"] = median_ms(call, args.repeats)
        row["two_gemms_ms"] = median_ms(two_gemms, args.repeats)
        row["shared_gflops"] = flops / row["shared_ms"] / 1e6
        row["copies_over_shared"] = row["copies_ms"] / row["shared_ms"]
        table.append(row)
    res = {"options": dataclasses.asdict(args), "cpu": cpu_model(), "threads": torch.get_num_threads(), "table": table}
    print(markdown(res))
    return res


def markdown(res: dict[str, Any]) -> str:
    o = res["options"]
    lines = [
        f"vLLM CPU attention, {o['rows']} rows over a shared {o['prefix']}-token prefix (+{o['suffix']} own tokens), "
        f"{o['heads']}/{o['kv_heads']} heads of {o['head_dim']}, {res['threads']} threads, {res['cpu']}; "
        f"ms per layer call, medians of {o['repeats']}.",
        "| new tokens per row | shared prefix blocks | a copy per row | copies / shared | two GEMMs (floor) "
        "| shared: GFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["table"]:
        lines.append(
            f"| {r['queries']} | {r['shared_ms']:.2f} | {r['copies_ms']:.2f} | {r['copies_over_shared']:.2f}x "
            f"| {r['two_gemms_ms']:.2f} | {r['shared_gflops']:.0f} |"
        )
    return "\n".join(lines)
