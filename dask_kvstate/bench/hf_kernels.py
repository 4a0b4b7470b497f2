"""What each of the transformers backend's kernel choices buys, in process, on one model.

::

    python -m dask_kvstate.bench hf-kernels                       # SmolLM2, 4,096- and 3,000-token contexts
    python -m dask_kvstate.bench hf-kernels --lengths 1024 --agents 4 --repeats 5

Three ways to run the same model's linear layers (``backends/packed_linear.py``), and
one more for its attention, switched on one loaded model and timed in turns (interleaved
repeats, medians):

- ``plain``: ``F.linear`` as transformers calls it (``kvstate.hf.packed-linear: false``),
  torch's attention (``kvstate.hf.vllm-attention: false``);
- ``packed``: oneDNN on weights packed once;
- ``fused``: packed, and the gated MLPs' activation and product fused into the GEMMs
  (the default without vLLM);
- ``fused+vllm-attention``: fused, and prompts' and siblings' attention through vLLM's CPU
  kernel (``backends/cpu_attention.py``, ``backends/paged_rows.py``: the default where vLLM
  is installed; left out, saying why, where its kernel does not load).

For each: a prefill of each context length (a state's materialize, a first visit), the
k agents' batch over the longest context (its suffix prefill and decode, the shared
prefix read in place, as ``kvs.resume_many`` runs it) and one resume. The tokens of
every batch and resume must be the same in all three; the command refuses to report
timings of runs that disagree.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

#: The mode that adds vLLM's CPU attention kernel to ``fused``.
VLLM_ATTENTION = "fused+vllm-attention"
MODES = ("plain", "packed", "fused", VLLM_ATTENTION)


@dataclasses.dataclass
class Options:
    """The model, the contexts and the agents over the longest one."""

    model: str = dataclasses.field(default="smollm2-135m", metadata={"help": "the model, loaded in this process"})
    lengths: list[int] = dataclasses.field(
        default_factory=lambda: [4096, 3000],
        metadata={
            "help": "context lengths prefilled, tokens (the longest: the most whole lines of the log within it)",
            "nargs": "+",
        },
    )
    agents: int = dataclasses.field(default=16, metadata={"help": "siblings decoded as one batch over the context"})
    new_tokens: int = dataclasses.field(default=64, metadata={"help": "tokens each agent generates"})
    threads: int = dataclasses.field(default=0, metadata={"help": "torch threads; 0: every core"})
    repeats: int = dataclasses.field(default=3, metadata={"help": "interleaved rounds; the table shows medians"})
    out: str | None = dataclasses.field(default=None, metadata={"help": "folder for hf_kernels.{md,json}"})


def switch(backend, mode: str, kernel=None) -> int:
    """Run ``backend``'s model as ``mode`` (one of :data:`MODES`) says, from whatever it ran;
    ``kernel`` is the backend's vLLM CPU attention kernel, used only by :data:`VLLM_ATTENTION`.
    Returns how many gated MLPs run fused."""
    from dask_kvstate.backends import attention, packed_linear

    model = backend.model
    packed_linear.unpack(model)
    if mode != "plain":
        packed_linear.pack(model)
    fused = packed_linear.fuse_gated_mlps(model) if mode in ("fused", VLLM_ATTENTION) else 0
    backend.cpu_attention = kernel if mode == VLLM_ATTENTION else None
    attention.use_cpu_attention(model, backend.cpu_attention)
    return fused


def command(opts: Options) -> dict[str, Any]:
    """Time every mode in turns; print and return the table (and write it under ``--out``)."""
    import os

    import dask
    import torch

    from dask_kvstate.backends import load_backend
    from dask_kvstate.backends.base import Row
    from dask_kvstate.backends.batch import generate_batch
    from dask_kvstate.bench import workload
    from dask_kvstate.bench.agents_vs_raw import prompts
    from dask_kvstate.bench.raw_vllm import cpu_model
    from dask_kvstate.generation import Sampling

    torch.set_num_threads(opts.threads or len(os.sched_getaffinity(0)))
    with dask.config.set({"kvstate.backend": "hf", "kvstate.hf.packed-linear": False}):
        backend: Any = load_backend(opts.model)  # the transformers backend: its model's layers are switched here
    kernel = backend.cpu_attention
    modes = [m for m in MODES if m != VLLM_ATTENTION or kernel is not None]
    if kernel is None:
        print(f"{VLLM_ATTENTION} left out: {backend.cpu_attention_note}", flush=True)
    longest = max(opts.lengths)
    context = workload.context_text(workload.fit(workload.context_text, longest, backend.tokenize))
    ids = backend.tokenize(context)
    sampling = Sampling(max_new_tokens=opts.new_tokens)
    # Each agent keeps the context but its last token, which its own text may re-tokenize.
    rows = [Row(ids=backend.tokenize(c + s), keep=len(ids) - 1) for c, s in prompts(context, opts.agents)]
    times: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    prefix = None
    outputs: dict[str, list[list[int]]] = {}
    for rnd in range(opts.repeats):
        for mode in modes:
            switch(backend, mode, kernel)
            t = times[mode]
            for n in sorted(opts.lengths, reverse=True):
                t0 = time.perf_counter()
                cache, _ = backend.prefill(ids[:n])
                t.setdefault(f"prefill {min(n, len(ids))}", []).append(time.perf_counter() - t0)
                if n == longest:
                    prefix = backend.kv_from_cache(cache)
            assert prefix is not None
            t0 = time.perf_counter()
            res = generate_batch(backend, rows, prefix, sampling)
            t.setdefault(f"{opts.agents} agents x {opts.new_tokens}", []).append(time.perf_counter() - t0)
            t.setdefault("of it: decode", []).append(res[0].decode_s)
            t0 = time.perf_counter()
            one = backend.generate(rows[0].ids, prefix[:, :, :, : rows[0].keep], sampling)
            t.setdefault("one resume", []).append(time.perf_counter() - t0)
            got = [r.token_ids for r in res] + [one.token_ids]
            if outputs.setdefault(mode, got) != got:
                raise AssertionError(f"{mode}: round {rnd} gave other tokens than its first round")
            print(f"round {rnd + 1} {mode}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in t.items()), flush=True)
    for mode in modes[1:]:
        if outputs[mode] != outputs["plain"]:
            raise AssertionError(f"{mode} gave other tokens than plain transformers: its timings are not reported")
    fused_mlps = switch(backend, modes[-1], kernel)  # left as the backend runs it
    res_: dict[str, Any] = {
        "options": dataclasses.asdict(opts),
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "medians_s": {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()},
        "runs_s": times,
        "outputs_equal": True,
        "fused_mlps": fused_mlps,
    }
    text = markdown(res_)
    print(text)
    if opts.out:
        write(res_, Path(opts.out), text)
    return res_


def markdown(res: dict[str, Any]) -> str:
    o, med = res["options"], res["medians_s"]
    cols = list(med["plain"])
    lines = [
        f"# The transformers backend's kernels: {', '.join(med)} ({res['cpu']})",
        "",
        f"{o['model']}, {res['threads']} threads, medians of {o['repeats']} interleaved rounds, seconds; "
        f"{res['fused_mlps']} gated MLPs fused; tokens of every batch and resume equal in all of them.",
        "",
        "| kernels | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for mode in med:
        lines.append(f"| {mode} | " + " | ".join(f"{med[mode][c]:.2f}" for c in cols) + " |")
    last = list(med)[-1]
    lines.append(f"| plain / {last} | " + " | ".join(f"{med['plain'][c] / med[last][c]:.2f}x" for c in cols) + " |")
    return "\n".join(lines)


def write(res: dict[str, Any], out: Path, text: str) -> None:
    """``hf_kernels.{json,md}`` and a bar per mode and measure (``.png``, where matplotlib is installed)."""
    from dask_kvstate.bench.report import saved

    plt = saved(res, out, "hf_kernels", text + "\n")
    if plt is None:
        return
    med = res["medians_s"]
    cols = list(med["plain"])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(med)
    for i, mode in enumerate(med):
        ax.bar([c + i * width for c in range(len(cols))], [med[mode][c] for c in cols], width, label=mode)
    ax.set_xticks([c + width for c in range(len(cols))], cols, fontsize=8)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"The transformers backend's kernels ({res['cpu']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "hf_kernels.png", dpi=110)
    plt.close(fig)
