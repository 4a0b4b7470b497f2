"""GGUF files to cached safetensors folders, converted once per machine.

transformers reads GGUF (``gguf_file=``) by dequantizing every tensor, which takes tens
of seconds; a safetensors folder of the same weights loads in a few. So a GGUF model is
converted once into a folder under the model cache, and every later load reads the
folder. Workers on one machine start at once: they serialize on a file lock, and the
folder appears by one rename, so a crash mid-conversion never leaves half a model.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: bytes read from each end of a GGUF file for its identity (see :func:`file_tag`)
SAMPLE_BYTES = 1 << 20


def file_tag(path: Path) -> str:
    """A short content identity of a GGUF file: its size, its first and its last MiB.

    The head holds the metadata and the tensor table (architecture, shapes, quant
    types), the tail holds weights, so another model or another fine-tune of the same
    shape gets another tag, while a copy or a reinstall of the same file keeps it (no
    reconversion). Reads 2 MiB whatever the file's size.

    Examples
    --------
    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
    ...     _ = f.write(b"GGUF" + bytes(100)); f.flush()
    ...     len(file_tag(Path(f.name)))
    12
    """
    size = path.stat().st_size
    h = hashlib.blake2b(str(size).encode(), digest_size=6)
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE_BYTES))
        f.seek(max(0, size - SAMPLE_BYTES))
        h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def cached_folder(root: Path, name: str, produce: Callable[[Path], None]) -> Path:
    """``root / name``, made by ``produce(empty_dir)`` the first time, under a file lock.

    ``produce`` fills a fresh folder beside the target; the folder is renamed into
    place only when ``produce`` returns, and removed when it raises. A folder counts
    as present when it holds ``config.json``.
    """
    folder = root / name
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f"{name}.lock"):
        if (folder / "config.json").is_file():  # another process made it while we waited
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            produce(tmp)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder


def converted_folder(gguf: Path, root: Path, label: str | None = None) -> Path:
    """The safetensors folder of GGUF file ``gguf`` under ``root``, converting it on first use.

    The folder is named ``<label or file stem>-<file_tag>``.
    """
    name = f"{label or gguf.stem}-{file_tag(gguf)}"
    return cached_folder(root, name, lambda tmp: convert(gguf, tmp, label or gguf.name))


@contextlib.contextmanager
def file_lock(path: Path):
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert(gguf: Path, dest: Path, label: str) -> None:
    """Write ``gguf``'s model (float32, dequantized) and tokenizer into folder ``dest``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dask_kvstate import progress

    # Tens of seconds, once per machine: worth a bar (on a terminal only; see dask_kvstate.progress).
    with (
        progress.bar(total=3, desc=f"{label}: GGUF -> safetensors (once)", unit="step") as bar,
        progress.quiet_transformers_unless_enabled(),
    ):
        # The tokenizer first: it is quick, and a file whose tokenizer is refused is refused
        # before its weights are dequantized.
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True, **tokenizer_flags(gguf)
        )
        check_tokenizer(gguf, tokenizer, label)
        align_special_tokens(gguf, tokenizer)
        bar.update()
        bar.set_postfix_str("dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        bar.update()
        # The weights are already dequantized to float32; drop the GGUF quantizer so
        # transformers agrees to save them as plain safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        bar.set_postfix_str("writing safetensors")
        model.save_pretrained(dest)
        tokenizer.save_pretrained(dest)
        source = {"gguf": str(gguf), "size": gguf.stat().st_size, "tag": file_tag(gguf)}
        (dest / "kvstate-source.json").write_text(json.dumps(source))
        bar.update()


# Where transformers keeps its GGUF tokenizer mapping, newest layout first.
_TOKENIZER_MAPPING_MODULES = ("transformers.integrations.gguf.gguf_tokenizer_mapping", "transformers.integrations.ggml")


def tokenizer_flags(gguf: Path) -> dict[str, bool]:
    """The file's :func:`file_tokenizer_flags` where transformers does not read them itself, else ``{}``.

    Some transformers releases ignore the flags, so Gemma's tokenizer loses the BOS every
    prompt of it starts with (and the model drifts without); newer ones read them, and also
    apply llama.cpp's default and their own per-family rules, which are left to them. So
    the flags are passed only where transformers' GGUF tokenizer mapping lacks them, and
    the same file gives the same tokenizer (and the same fingerprint) in every release.
    """
    for name in _TOKENIZER_MAPPING_MODULES:
        try:
            mapping = importlib.import_module(name).GGUF_TOKENIZER_MAPPING
        except (ImportError, AttributeError):
            continue
        if "ggml.add_bos_token" in mapping.get("tokenizer_config", {}):
            return {}
        break
    return file_tokenizer_flags(gguf)


def file_tokenizer_flags(gguf: Path) -> dict[str, bool]:
    """``add_bos_token`` / ``add_eos_token`` for ``AutoTokenizer`` as GGUF file ``gguf`` says.

    A sentencepiece (``llama``) vocabulary without a BOS flag adds BOS, as llama.cpp does.
    """
    meta = _tokenizer_metadata(gguf)
    flags: dict[str, bool] = {n: bool(meta[n]) for n in ("add_bos_token", "add_eos_token") if n in meta}
    if "add_bos_token" not in flags and meta.get("model") == "llama":
        flags["add_bos_token"] = True
    return flags


#: llama.cpp's vocabulary kinds (``tokenizer.ggml.model``) that are BPE: sentencepiece BPE and byte-level BPE
_BPE_VOCABULARIES = ("llama", "gpt2")


def check_tokenizer(gguf: Path, tokenizer, label: str | None = None) -> None:
    """Raise ValueError, naming ``label`` (default: the file), if transformers built ``gguf``'s tokenizer with
    another algorithm than its vocabulary's.

    Some transformers releases build a Gemma file's sentencepiece BPE vocabulary as a
    Unigram model, which cuts text into other tokens than the model was trained on
    ("world" as "w", "or", "ld"): its outputs would drift, and the converted folder is
    kept, so it is refused before anything is written.
    """
    vocabulary = _tokenizer_metadata(gguf).get("model")
    built = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["type"]
    if vocabulary in _BPE_VOCABULARIES and built != "BPE":
        import transformers

        raise ValueError(
            f"{label or gguf}: transformers {transformers.__version__} builds its {vocabulary!r} (BPE) vocabulary as a "
            f"{built} tokenizer, which splits text differently from the model's own; convert it with a "
            "transformers release that builds it as BPE (5.19 does), or load a model folder with its tokenizer.json"
        )


#: the tokenizer's special tokens and the GGUF fields naming their ids
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def align_special_tokens(gguf: Path, tokenizer) -> None:
    """Make ``tokenizer``'s BOS, EOS, UNK and pad tokens the ones ``gguf`` names, where transformers set others.

    Some transformers releases give a GGUF tokenizer its BOS as EOS too (SmolLM2's EOS
    became ``<|im_start|>``) and no pad token; the file's ids are what the model was
    trained with, so they win. A tokenizer that already agrees is left as it is.
    """
    meta = _tokenizer_metadata(gguf)
    for name, field in _SPECIAL_TOKENS.items():
        want = meta.get(field)
        if want is not None and getattr(tokenizer, f"{name}_id") != want:
            setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(int(want)))


# GGUF value types (the format's own numbering) and how a scalar of each is packed.
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _tokenizer_metadata(gguf: Path) -> dict[str, Any]:
    """The scalar ``tokenizer.ggml.*`` fields of ``gguf`` (``model``, ``add_bos_token``, ...), by short name.

    Reads the header's key-value section only, stepping over arrays without decoding them:
    ``gguf.GGUFReader`` builds an object per vocabulary entry, ten seconds for Gemma's
    262,144 tokens, where this takes a fraction of one. A file it cannot read gives ``{}``
    (transformers is then left to do as it does).
    """
    with open(gguf, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            return {}
        # A big-endian file's version reads as a multiple of 2**16 little-endian.
        order = ">" if struct.unpack_from("<I", m, 4)[0] & 0xFFFF == 0 else "<"
        if struct.unpack_from(order + "I", m, 4)[0] < 2:  # version 1 used 32-bit lengths
            return {}

        def string(pos: int) -> tuple[str, int]:
            (n,) = struct.unpack_from(order + "Q", m, pos)
            return m[pos + 8 : pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n

        def skip(kind: int, pos: int, count: int = 1) -> int:
            if kind == _GGUF_STRING:
                for _ in range(count):
                    pos += 8 + struct.unpack_from(order + "Q", m, pos)[0]
            elif kind == _GGUF_ARRAY:
                for _ in range(count):
                    inner, n = struct.unpack_from(order + "IQ", m, pos)
                    pos = skip(inner, pos + 12, n)
            else:
                pos += count * struct.calcsize(_GGUF_SCALARS[kind])
            return pos

        out: dict[str, Any] = {}
        pos = 24  # magic, version, tensor count, key-value count
        for _ in range(struct.unpack_from(order + "Q", m, 16)[0]):
            key, pos = string(pos)
            (kind,) = struct.unpack_from(order + "I", m, pos)
            pos += 4
            if key.startswith("tokenizer.ggml."):
                name = key.removeprefix("tokenizer.ggml.")
                if kind == _GGUF_STRING:
                    out[name] = string(pos)[0]
                elif kind in _GGUF_SCALARS:
                    out[name] = struct.unpack_from(order + _GGUF_SCALARS[kind], m, pos)[0]
            pos = skip(kind, pos)
    return out
