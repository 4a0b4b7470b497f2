"""Tiny random models of every supported architecture family, saved as model folders.

The conformance kit (``tests/test_architectures.py``) runs every operator path of every
family against transformers' own ``model.generate``; these factories give it the models.
Each family keeps what makes it different from Llama at a size that runs in milliseconds:
a 24-token sliding window (Mistral, Qwen2, Phi-3), sliding and full layers alternating
(Gemma2, Gemma3, GPT-OSS; Qwen2 through ``max_window_layers``), attention and final logit
softcaps (Gemma2), attention sinks (GPT-OSS), scaled logits (Granite's ``logits_scaling``,
Cohere's ``logit_scale``), q/k norms (Qwen3, Gemma3) and routed experts (Mixtral, GPT-OSS,
Qwen3-MoE), partial rotary (StableLM), multi-head latent attention (DeepSeek-V3), one KV
head (Falcon with multi-query attention) and absolute positions (GPT-2). Weights are
seeded and wide (``initializer_range=0.3``, as tiny-llama's) so
greedy choices are decisive rather than ties broken by rounding, and the tokenizer is
tiny-llama's byte-level BPE, so prompts written for tiny-llama cross the same token
boundaries here (the Gemma families' copy also starts every prompt with BOS, as Gemma's does).

Importing this module loads nothing; :func:`build` writes a folder once and reuses it.

Examples
--------
>>> "gemma2" in FAMILIES and FAMILIES["gemma2"].window == WINDOW
True
>>> sorted(UNSUPPORTED)
['mamba', 't5']
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

#: The sliding window of every family that has one, in tokens: shorter than the kit's
#: shared prefixes and not a multiple of the 16-token test blocks, so windows end mid-block.
WINDOW = 24
SEED = 0

#: What every family shares: 3 layers, 4 query heads over 2 kv heads (grouped-query
#: attention), 16-dim heads.
_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "initializer_range": 0.3,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Family:
    """One architecture family: its transformers config class and what sets it apart.

    ``options`` override :data:`_COMMON`; ``window`` is the sliding window some of its
    layers use (None: full attention everywhere); ``bos``: its tokenizer starts every
    prompt with the BOS token, as Gemma's does.
    """

    name: str
    config_class: str
    options: dict[str, Any] = field(default_factory=dict)
    window: int | None = None
    bos: bool = False

    def config(self, vocab_size: int, bos: int, eos: int):
        """The family's transformers config for a tokenizer of ``vocab_size`` tokens."""
        import transformers

        cls = getattr(transformers, self.config_class)
        special = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}
        return cls(vocab_size=vocab_size, **{**_COMMON, **special, **self.options})

    def tag(self) -> str:
        """A digest of everything the saved folder depends on (a stale cached folder is never reused)."""
        import transformers

        spec = [self.config_class, _COMMON, self.options, self.bos, SEED, transformers.__version__]
        blob = json.dumps(spec, sort_keys=True)
        return hashlib.blake2b(blob.encode(), digest_size=5).hexdigest()


_SLIDE, _FULL = "sliding_attention", "full_attention"

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaConfig"),
        Family("mistral", "MistralConfig", {"head_dim": 16, "sliding_window": WINDOW}, WINDOW),
        Family(
            "qwen2",
            "Qwen2Config",
            # Layers at or past max_window_layers slide: layer 0 full, layers 1-2 sliding.
            {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
            WINDOW,
        ),
        Family("qwen3", "Qwen3Config", {"head_dim": 16}),
        Family(
            "gemma2",
            "Gemma2Config",
            {
                "head_dim": 16,
                "query_pre_attn_scalar": 16,
                "sliding_window": WINDOW,
                "layer_types": [_SLIDE, _FULL, _SLIDE],
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
            },
            WINDOW,
            bos=True,
        ),
        Family(
            "gemma3",
            "Gemma3TextConfig",
            {
                "head_dim": 16,
                "query_pre_attn_scalar": 16,
                "sliding_window": WINDOW,
                "layer_types": [_SLIDE, _FULL, _SLIDE],
            },
            WINDOW,
            bos=True,
        ),
        Family("phi3", "Phi3Config", {"sliding_window": WINDOW}, WINDOW),
        Family(
            "granite",
            "GraniteConfig",
            {
                "logits_scaling": 2.0,
                "embedding_multiplier": 4.0,
                "residual_multiplier": 0.5,
                "attention_multiplier": 0.25,
            },
        ),
        Family("cohere", "CohereConfig", {"logit_scale": 0.25}),
        Family("mixtral", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        Family(
            "gpt_oss",
            "GptOssConfig",
            {
                "head_dim": 16,
                "sliding_window": WINDOW,
                "layer_types": [_SLIDE, _FULL, _SLIDE],
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
            },
            WINDOW,
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeConfig",
            {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
        ),
        # Partial rotary (a quarter of each head), LayerNorm, and decoder layers that pass no
        # keywords on to attention.
        Family("stablelm", "StableLmConfig"),
        # Multi-head latent attention: the cache holds a 16-wide latent beside an 8-wide rotary
        # key (K and V slots of different sizes); its attention takes no grouped-query heads.
        Family(
            "deepseek_v3",
            "DeepseekV3Config",
            {
                "num_key_value_heads": 4,
                "q_lora_rank": 16,
                "kv_lora_rank": 16,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 8,
                "v_head_dim": 8,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "first_k_dense_replace": 1,
                "n_group": 1,
                "topk_group": 1,
            },
        ),
        # Multi-query attention: one KV head, named by Falcon's own ``multi_query`` field.
        Family("falcon_mqa", "FalconConfig", {"multi_query": True, "new_decoder_architecture": False}),
        # Absolute position embeddings, no rotary.
        Family("gpt2", "GPT2Config"),
    )
}

#: Models no KV operator can serve, which ``kvs.install`` must refuse: a state-space model
#: (no attention KV at all) and an encoder-decoder (its cache is the encoder's too).
UNSUPPORTED: dict[str, Family] = {
    f.name: f
    for f in (
        Family("mamba", "MambaConfig", {"hidden_size": 64, "state_size": 8, "num_hidden_layers": 2}),
        Family("t5", "T5Config", {"d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4, "d_kv": 16}),
    )
}


@functools.cache
def tokenizer():
    """tiny-llama's tokenizer: a byte-level BPE trained on a fixed corpus (trained once per process)."""
    from dask_kvstate.backends import models

    return models.load(models.TINY_LLAMA)[1]


def build(name: str, root: str | os.PathLike, *, wide: bool = False) -> Path:
    """The folder of family ``name``'s tiny model under ``root``, saved on first use.

    ``name`` is a key of :data:`FAMILIES` or :data:`UNSUPPORTED`; ``wide`` gives it
    32-dim heads (a 128-wide model), the narrowest vLLM's CPU attention serves. The folder is written
    to a temporary name and renamed into place under a file lock (the model cache's own
    :func:`~dask_kvstate.backends.gguf.cached_folder`), so a crash never leaves half a
    model; a folder already there (same family, same settings) is returned as it is.
    """
    from dask_kvstate.backends.gguf import cached_folder

    family = widened(_family(name)) if wide else _family(name)
    return cached_folder(Path(root), f"{family.name}-{family.tag()}", lambda tmp: _save(family, tmp))


def widened(family: Family) -> Family:
    """``family`` with 32-dim heads in a 128-wide model (``build(..., wide=True)``)."""
    options = {**family.options, "hidden_size": 128}
    if "head_dim" in options:
        options["head_dim"] = 32
    return replace(family, name=f"{family.name}-wide", options=options)


def _family(name: str) -> Family:
    family = FAMILIES.get(name) or UNSUPPORTED.get(name)
    if family is None:
        raise ValueError(f"unknown family {name!r}; known: {sorted(FAMILIES)} and unsupported {sorted(UNSUPPORTED)}")
    return family


def _tokenizer_for(family: Family):
    tok = tokenizer()
    if not family.bos:
        return tok
    from tokenizers import processors

    tok = copy.deepcopy(tok)
    bos = (tok.bos_token, tok.bos_token_id)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
    )
    return tok


def model(name: str | Family):
    """Family ``name``'s tiny model (eval mode) and tokenizer, in memory: the weights its folder holds."""
    import torch
    import transformers

    family = name if isinstance(name, Family) else _family(name)
    tok = _tokenizer_for(family)
    config = family.config(len(tok), tok.bos_token_id, tok.eos_token_id)
    auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        built = auto.from_config(config)
    return built.eval(), tok


def _save(family: Family, folder: Path) -> None:
    built, tok = model(family)
    built.save_pretrained(folder)
    tok.save_pretrained(folder)


def build_all(root: str | os.PathLike) -> dict[str, Path]:
    """Every supported family's folder under ``root``: ``{family: folder}``."""
    return {name: build(name, root) for name in FAMILIES}
