"""How often each reuse path gives exactly ``model.generate``'s tokens, per dtype.

::

    python -m dask_kvstate.bench agreement --model smollm2-135m --dtypes float32 bfloat16 --out results/agreement

For each dtype, the model is loaded in that dtype and every prompt (the bench's shared
incident-log context plus one agent's suffix) is decoded greedily four ways:
transformers' own ``model.generate`` (the reference), text replay (this backend, no
state), a batch-1 resume from the stored context state, and a batched resume of all
agents over the one shared state (cascade attention). A path *agrees* on a prompt when
its tokens equal the reference's; for a disagreement the report gives the first
position that differs.

Why it can differ at all: a resume computes the same function as the one-shot prompt,
but with the arithmetic split differently (the prefix's KV was computed without the
suffix in the same matmul; the batched path merges two partial attentions), so the
last bits of a logit may differ; a greedy choice flips only where the top two logits
are that close (a near-tie). In float32 that is rare; in bfloat16 (8 bits of mantissa)
the rounding is 65,536 times coarser.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from dask_kvstate.bench.workload import context_text, suffix
from dask_kvstate.generation import Sampling

PATHS = ("replay", "resume", "batched")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None if equal).

    >>> first_difference([1, 2, 3], [1, 2, 4]), first_difference([1], [1])
    (2, None)
    """
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(model: str, dtype: str, *, agents: int, context_lines: int, new_tokens: int) -> dict:
    """One dtype's agreement counts for every path over ``agents`` prompts."""
    from dask_kvstate.backends import from_model
    from dask_kvstate.backends.batch import Row, generate_batch
    from dask_kvstate.backends.models import load

    hf_model, tokenizer = load(model)
    backend = from_model(model, hf_model.to(getattr(torch, dtype)), tokenizer)
    context = backend.tokenize(context_text(context_lines))
    prompts = [context + backend.tokenize(suffix(i)) for i in range(agents)]
    sampling = Sampling(new_tokens)
    t0 = time.perf_counter()
    with torch.inference_mode():
        reference = [
            backend.model.generate(
                torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    state = backend.kv_from_cache(backend.prefill(context)[0])
    out = {
        "replay": [backend.generate(p, None, sampling).token_ids for p in prompts],
        "resume": [backend.generate(p, state, sampling).token_ids for p in prompts],
        "batched": [
            r.token_ids for r in generate_batch(backend, [Row(p, len(context)) for p in prompts], state, sampling)
        ],
    }
    report: dict = {
        "dtype": dtype,
        "prompts": agents,
        "context_tokens": len(context),
        "new_tokens": new_tokens,
        "seconds": 0.0,
    }
    for path, got in out.items():
        # Our decode stops at EOS; the reference is forced on, so compare up to our length.
        diffs = [first_difference(g, r[: len(g)]) for g, r in zip(got, reference, strict=True)]
        report[path] = {
            "agree": sum(d is None for d in diffs),
            "first_difference": [d for d in diffs if d is not None],
        }
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


@dataclasses.dataclass
class Options:
    """The model, the dtypes it is loaded in, and the prompts' shape."""

    model: str = dataclasses.field(default="smollm2-135m", metadata={"help": "the model, loaded in this process"})
    dtypes: list[str] = dataclasses.field(
        default_factory=lambda: ["float32", "bfloat16"], metadata={"help": "torch dtypes, one measurement each"}
    )
    agents: int = dataclasses.field(default=16, metadata={"help": "prompts: the shared context and one suffix each"})
    context_lines: int = dataclasses.field(default=40, metadata={"help": "incident-log lines in the shared context"})
    new_tokens: int = dataclasses.field(default=32, metadata={"help": "tokens decoded greedily per prompt and path"})
    out: Path | None = dataclasses.field(default=None, metadata={"help": "folder for <model>.json"})


def command(opts: Options) -> list[dict]:
    """:func:`measure` per dtype, a line each; the reports also go to ``<out>/<model>.json``."""
    reports = []
    for dtype in opts.dtypes:
        r = measure(opts.model, dtype, agents=opts.agents, context_lines=opts.context_lines, new_tokens=opts.new_tokens)
        reports.append(r)
        cells = ", ".join(f"{p} {r[p]['agree']}/{r['prompts']}" for p in PATHS)
        print(f"{opts.model} {dtype} ({r['context_tokens']}-token context): {cells} agree ({r['seconds']} s)")
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / f"{Path(opts.model).name}.json").write_text(json.dumps(reports, indent=1))
    return reports


def main(argv: list[str] | None = None) -> list[dict]:
    """``python -m dask_kvstate.bench.agreement``: the same as ``python -m dask_kvstate.bench agreement``."""
    import sys

    from dask_kvstate.bench.registry import main as bench

    return bench(["agreement", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
