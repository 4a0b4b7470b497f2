"""Every causal LM class transformers has, judged by what it is: identical, refused, or not instantiable.

The conformance kit (``tests/test_architectures.py``) runs every path on a cluster for the
families the README lists. This module covers the rest without a list: it walks
transformers' causal-LM auto mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), builds a
tiny random config for each class (the kit's sizes: 3 layers, 4 query heads over 2 KV
heads, 16-dim heads, a 64-wide model, the kit's tokenizer, a 24-token window; MLA ranks,
experts and chunk sizes shrunk alike), and checks, in this process, every path through
the backend against the class's own greedy ``model.generate`` of the whole prompt:

- text replay (``HFBackend.generate`` from no state);
- resume from a state cut into 16-token blocks and joined back as the store hands them
  (``BlockKV.split`` / ``head`` / ``joined``), for prompts whose first new token re-cuts
  the state's last one (the prefix ends mid-word);
- extend: a state prefilled on top of another's blocks, resumed;
- batched resume of siblings over one shared prefix (``generate_batch``: the computation
  of ``resume_many`` and of the compiler's batched siblings; cascade attention where the
  model's attention can be routed, the model's own attention row by row where not).

Moving blocks between workers, tiers and the compiler's graph rewrite copy bytes and do
not depend on the model family; the kit runs them on a cluster for the listed families.

Each class ends as one of: ``identical`` (every path gave ``model.generate``'s tokens),
``refused`` (``kvs.install`` raises the ValueError quoted, from the config check or the
backend's load), ``not instantiable`` (transformers cannot build or run a tiny model of
it, or it is no text-only causal LM; why is quoted), or ``DIFFERENT`` / ``CRASH``, which
the tests keep at zero.

``python -m dask_kvstate.testing.families --out docs/guide/families.md`` writes the table
(about ten minutes on two cores); ``--only llama,stablelm`` checks a few classes.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: The kit's shapes and prompts: the prefix (~190 tokens) crosses twelve 16-token blocks
#: and every 24-token window and ends mid-word, so each state's last token is re-cut.
WINDOW = 24
BLOCK_TOKENS = 16
NEW_TOKENS = 10
_SYSTEM = "You are one agent in a team. Read everything before you answer, and answer in one line.\n"
_CONTEXT = (
    "The planner reads the task and writes a plan. The developer follows the plan and writes the code. "
    "The tester runs the tests and reports what failed, and the developer tries again. "
) * 3
PREFIX = _SYSTEM + _CONTEXT + "The plan"
SUFFIXES = ("ner speaks. Verdict:", "ets align. Verdict:", "t grows. Verdict:")
EXTENSION = " Answer:"
#: A tiny model has well under this many parameters; more means the shrinking knobs missed.
MAX_PARAMETERS = 20_000_000
#: Seconds one class may take before it is recorded as a crash (a hang is a failure too).
TIMEOUT_S = 120

#: Config fields set wherever a class's config has them (names differ across families).
KNOBS: dict[str, Any] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model"), 64),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 64),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers"), 3),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads"), 2),
    **dict.fromkeys(("head_dim", "kv_channels"), 16),
    **dict.fromkeys(("max_position_embeddings", "n_positions"), 4096),
    **dict.fromkeys(("sliding_window", "attention_chunk_size"), WINDOW),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts"), 4),
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "max_window_layers": 1,
    # MLA: a 16-wide latent, 8-dim rotary and non-rotary query/key parts, 8-dim values.
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    # Wide random weights give peaked logits: greedy choices are decisive, not rounding ties.
    "initializer_range": 0.3,
    "tie_word_embeddings": False,
}
#: Grouped-query attention off, for classes whose attention takes no GQA (MLA's, DeepSeek's).
_NO_GQA = dict.fromkeys(("num_key_value_heads", "num_kv_heads"), 4)

IDENTICAL, REFUSED, NOT_INSTANTIABLE, DIFFERENT, CRASH = (
    "identical",
    "refused",
    "not instantiable",
    "DIFFERENT",
    "CRASH",
)


@dataclass(frozen=True)
class Outcome:
    """What one class came to: its model type, class name, outcome and why (the error, or the paths)."""

    model_type: str
    class_name: str
    outcome: str
    why: str = ""


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def on_alarm(signum, frame):
        raise _Timeout(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def causal_lm_classes() -> dict[str, str]:
    """``{model_type: class name}`` of every class in transformers' causal-LM auto mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


#: Per-class settings a default config lacks: LFM2's default is attention on every layer,
#: its checkpoints mix in short-convolution layers (whose state is not per-token KV).
FAMILY_KNOBS: dict[str, dict[str, Any]] = {
    "lfm2": {"layer_types": ["conv", "full_attention", "conv"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"]},
}
_MAX_LAYERS = 6


def _layer_picks(defaults: dict[str, Any]) -> dict[str, Any]:
    """Per-layer fields for a few layers that keep every kind of layer the default config has.

    A per-layer field is a list as long as the default's layers of strings, bools or 0/1
    flags (``layer_types``, ``no_rope_layers``): the layers picked are the first of each
    distinct combination of those fields' values (so SmolLM3 keeps a NoPE layer, Llama 4 a
    global one among its chunked), topped up to 3 layers; none when there are no such fields.
    """
    n = next((defaults[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in defaults), None)
    if not isinstance(n, int):
        return {}
    fields = {
        k: v
        for k, v in defaults.items()
        if isinstance(v, list) and len(v) == n and v and all(isinstance(x, str) or x in (0, 1) for x in v)
    }
    if not fields:
        return {}
    picks: dict[tuple, int] = {}
    for i in range(n):
        picks.setdefault(tuple(repr(v[i]) for v in fields.values()), i)
    chosen = sorted(picks.values())[:_MAX_LAYERS]
    chosen = sorted([*chosen, *[i for i in range(n) if i not in chosen][: max(0, 3 - len(chosen))]])
    layers: dict[str, Any] = {
        k: len(chosen) for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in defaults
    }
    return {**layers, **{k: [v[i] for i in chosen] for k, v in fields.items()}}


def tiny_config(model_type: str, *, gqa: bool = True):
    """A tiny config of ``model_type`` for the kit's tokenizer: :data:`KNOBS` where its config has them."""
    from transformers import AutoConfig

    from dask_kvstate.testing import architectures

    tok = architectures.tokenizer()
    defaults = AutoConfig.for_model(model_type).to_dict()
    knobs = {**KNOBS, **({} if gqa else _NO_GQA)}
    if "qk_rope_head_dim" in defaults:
        del knobs["head_dim"]  # MLA's configs derive it from the rotary part
    overrides = {k: v for k, v in knobs.items() if k in defaults}
    overrides.update(_layer_picks(defaults))
    overrides.update(FAMILY_KNOBS.get(model_type, {}))
    if "is_decoder" in defaults:
        overrides["is_decoder"] = True  # an encoder's class in the causal-LM mapping runs as a decoder
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.eos_token_id}
    return AutoConfig.for_model(model_type, vocab_size=len(tok), **overrides, **special)


def _build(config):
    import torch
    from transformers import AutoModelForCausalLM

    from dask_kvstate.testing import architectures

    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if n > MAX_PARAMETERS:
        raise ValueError(f"the tiny config still has {n:,} parameters (a size field this module does not know)")
    with torch.random.fork_rng():
        torch.manual_seed(architectures.SEED)
        model = AutoModelForCausalLM.from_config(config)
    return model.eval()


def _reference(model, tok, text: str) -> list[int]:
    import torch

    ids = tok(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, ids.shape[1] :].tolist()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _stored(kv, tokens: int):
    """The first ``tokens`` tokens of ``kv`` as a state's blocks hand them to a resume."""
    from dask_kvstate.blocks import BlockKV

    return BlockKV.split(kv.clone(), BLOCK_TOKENS).head(tokens).joined().contiguous()


def run_paths(backend, want) -> dict[str, bool]:
    """Every path's tokens equal to ``want(text)`` (``model.generate``'s), by path name."""
    from dask_kvstate.backends.batch import Row, generate_batch
    from dask_kvstate.generation import Sampling

    greedy = Sampling(NEW_TOKENS)
    prefix_ids = backend.tokenize(PREFIX)
    state = backend.kv_from_cache(backend.prefill(prefix_ids)[0])
    rows, ok = [], {"text replay": True, "resume": True, "extend": True}
    for s in SUFFIXES:
        ids = backend.tokenize(PREFIX + s)
        keep = min(_common_prefix(prefix_ids, ids), len(ids) - 1)
        ok["text replay"] &= backend.generate(ids, None, greedy).token_ids == want(PREFIX + s)
        ok["resume"] &= backend.generate(ids, _stored(state, keep), greedy).token_ids == want(PREFIX + s)
        rows.append(Row(ids, keep))
    # extend: the state of PREFIX + SUFFIXES[0] computed on top of PREFIX's blocks, then resumed.
    ext_ids = backend.tokenize(PREFIX + SUFFIXES[0])
    keep = min(_common_prefix(prefix_ids, ext_ids), len(ext_ids) - 1)
    extended = backend.kv_from_cache(backend.prefill(ext_ids, _stored(state, keep))[0])
    full = backend.tokenize(PREFIX + SUFFIXES[0] + EXTENSION)
    keep = min(_common_prefix(ext_ids, full), len(full) - 1)
    got = backend.generate(full, _stored(extended, keep), greedy).token_ids
    ok["extend"] = got == want(PREFIX + SUFFIXES[0] + EXTENSION)
    batch = generate_batch(backend, rows, _stored(state, len(prefix_ids)), greedy)
    ok["batched resume"] = [r.token_ids for r in batch] == [want(PREFIX + s) for s in SUFFIXES]
    return ok


def judge(model_type: str, class_name: str) -> Outcome:
    """The outcome of one class (never raises: an unexpected error is a :data:`CRASH`)."""
    try:
        with _time_limit(TIMEOUT_S):
            return _judge(model_type, class_name)
    except Exception as e:
        traceback.print_exc()
        return Outcome(model_type, class_name, CRASH, _one_line(e))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:300]}"


def _judge(model_type: str, class_name: str) -> Outcome:
    from dask_kvstate.backends import from_model, layout
    from dask_kvstate.testing import architectures

    tok = architectures.tokenizer()
    model, error = None, None
    for gqa in (True, False):
        try:
            config = tiny_config(model_type, gqa=gqa)
        except Exception as e:
            return Outcome(model_type, class_name, NOT_INSTANTIABLE, f"no tiny config: {_one_line(e)}")
        try:
            # What kvs.install checks from the config alone, before any worker loads a model.
            layout.describe(config)
        except ValueError as e:
            return Outcome(model_type, class_name, REFUSED, _one_line(e))
        try:
            model = _build(config)
            refs = {text: _reference(model, tok, text) for text in _texts()}
            break
        except _Timeout:
            raise
        except Exception as e:
            model, error = None, e
    if model is None:
        assert error is not None, "a build that failed has an error"
        return Outcome(model_type, class_name, NOT_INSTANTIABLE, f"model.generate fails: {_one_line(error)}")
    try:
        backend = from_model(model_type, model, tok, device="cpu")
    except ValueError as e:  # what kvs.install raises when a worker's load refuses the model
        return Outcome(model_type, class_name, REFUSED, _one_line(e))
    ok = run_paths(backend, refs.__getitem__)
    wrong = [path for path, same in ok.items() if not same]
    if wrong:
        return Outcome(model_type, class_name, DIFFERENT, "tokens differ on " + ", ".join(wrong))
    fallbacks = ", ".join(sorted(backend.cascade_fallbacks))
    how = f"own attention per row ({fallbacks})" if fallbacks else "cascade attention"
    return Outcome(model_type, class_name, IDENTICAL, f"{backend.layout.describe()}; batched: {how}")


def _texts() -> list[str]:
    return [PREFIX + s for s in SUFFIXES] + [PREFIX + SUFFIXES[0] + EXTENSION]


def table(outcomes: list[Outcome]) -> str:
    """The Markdown page ``--out`` writes: counts, then one row per class."""
    import torch
    import transformers

    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.outcome] = counts.get(o.outcome, 0) + 1
    lines = [
        "# Causal LM classes of transformers and the transformers backend",
        "",
        "Generated by `python -m dask_kvstate.testing.families --out docs/guide/families.md` "
        f"(transformers {transformers.__version__}, torch {torch.__version__}); do not edit by hand. "
        "What each outcome means, and which paths were run: the docstring of "
        "`dask_kvstate/testing/families.py`.",
        "",
        ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())),
        "",
        "| model type | class | outcome | why |",
        "| --- | --- | --- | --- |",
    ]
    for o in outcomes:
        why = o.why.replace("|", "\\|")
        lines.append(f"| `{o.model_type}` | `{o.class_name}` | {o.outcome} | {why} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the Markdown table here (default: print it)")
    parser.add_argument("--only", help="comma-separated model types to check (default: every one)")
    args = parser.parse_args(argv)
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    classes = causal_lm_classes()
    if args.only:
        unknown = sorted(set(args.only.split(",")) - set(classes))
        if unknown:
            parser.error(f"not in transformers' causal-LM mapping: {', '.join(unknown)}")
        classes = {k: v for k, v in classes.items() if k in args.only.split(",")}
    outcomes = []
    for model_type, class_name in classes.items():
        t0 = time.perf_counter()
        outcome = judge(model_type, class_name)
        outcomes.append(outcome)
        print(f"{model_type:28s} {outcome.outcome:16s} {time.perf_counter() - t0:5.1f}s {outcome.why}", file=sys.stderr)
    text = table(outcomes)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 1 if any(o.outcome in (DIFFERENT, CRASH) for o in outcomes) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(130)
