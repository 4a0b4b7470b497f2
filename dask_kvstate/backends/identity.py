"""What makes two backends' KV interchangeable: the fingerprints every block hash carries.

Shared by the backends so that one rule decides, for all of them, which config fields
change what a model computes and which only say where it was loaded from.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

# Config fields that say where or how a model was loaded, not what it computes (private
# "_" fields too: they are loading state; the attention actually used and the model's
# class, which ``architectures`` names only once saved, are added apart).
NOT_IDENTITY = frozenset(
    {"transformers_version", "torch_dtype", "dtype", "use_cache", "return_dict", "name_or_path", "architectures"}
    | {"output_attentions", "output_hidden_states"}
)


def tokenizer_digest(tokenizer) -> str:
    """A hash of everything the tokenizer maps text to ids with."""
    text = (
        tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer.get_vocab())
    )
    return hashlib.sha256(text.encode()).hexdigest()


def config_fingerprint(
    config: Mapping, *, architecture: str, attention: str, dtype: str, tokenizer, engine: str | None = None
) -> str:
    """The whole model ``config`` (every field that can change K/V or logits), the class,
    the attention implementation, the dtype, the tokenizer and the engine that computes.

    ``engine`` names a backend whose kernels compute K/V differently from transformers'
    (vLLM's): KV of one engine is never resumed in another, since outputs must equal the
    engine's own text replay token for token.
    """
    desc = {
        "config": {k: v for k, v in config.items() if k not in NOT_IDENTITY and not k.startswith("_")},
        "architecture": architecture,
        "attention": attention,
        "dtype": dtype,
        "tokenizer": tokenizer_digest(tokenizer),
    }
    if engine is not None:
        desc["engine"] = engine
    blob = json.dumps(desc, sort_keys=True, default=str).encode()
    return "c-" + hashlib.blake2b(blob, digest_size=16).hexdigest()


def weights_fingerprint(folder: Path) -> str:
    """The bytes of a model folder's weight files: a fine-tuned or re-quantized checkpoint
    under the same name gets a different fingerprint."""
    h = hashlib.blake2b(digest_size=16)
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise ValueError(f"model folder {folder} has no *.safetensors or *.bin weight files")
    for path in files:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return "m-" + h.hexdigest()


def eos_ids(tokenizer, generation_config) -> frozenset[int]:
    """Token ids that end a generation: the tokenizer's and the generation config's."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)
