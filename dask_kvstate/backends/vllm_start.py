"""How a vLLM engine of this backend is configured and started in the worker's own process.

The options come from ``kvstate.vllm.*`` and the worker's block size; :func:`start_engine`
builds an in-process ``LLMEngine`` (see :mod:`.vllm_engine` for why in-process) with our
connector (:mod:`.vllm_connector`) attached.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dask_kvstate.backends import vllm_connector
from dask_kvstate.backends.vllm_cores import cores_of_this_process, count_cores

logger = logging.getLogger("dask_kvstate")


@dataclass
class EngineOptions:
    """How to start the engine (``kvstate.vllm.*`` and the worker's block size)."""

    folder: Path
    dtype: str
    block_tokens: int
    max_model_len: int | None  # None: the model's own maximum
    kv_cache_bytes: int
    cpu_cores: str | None  # "0-1" style; None: every core this process may run on
    compile: bool  # torch.compile the model (slower start, faster steps) or run eager
    share_cores: bool = True  # split the cores with this host's other engines given the same ones (.vllm_cores)
    prefill_attention: str = "auto"  # long prefills through torch's SDPA or vLLM's kernel (.vllm_prefill)
    exchange: str = field(default_factory=lambda: uuid.uuid4().hex)


def engine_cores(options: EngineOptions) -> str:
    """The cores the engine runs on: ``options.cpu_cores``, else every core this process may use.

    Unbound, the engine takes every core this process may run on (a nanny starts workers
    with OMP_NUM_THREADS=1, which would leave one core to an engine given several).
    """
    return options.cpu_cores or cores_of_this_process()


def use_inductor_cache() -> None:
    """Let a compiled engine load what an earlier start compiled, unless the user chose otherwise.

    vLLM 0.32's CPU build with torch 2.13 saves its AOT-compiled model but cannot load it
    back ("'function' object has no attribute 'finalize_loading'"), so every start
    compiles again (54 s for SmolLM2 on 2 cores); with AOT compilation off it uses
    torch's inductor cache, and a start after the first on a machine takes 19 s (eager:
    ~15 s). Set before vLLM reads it, when the engine is built.
    """
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def start_engine(options: EngineOptions):
    """An in-process ``LLMEngine`` serving ``options.folder`` with our connector attached."""
    # Read by vLLM when the engine is built, not at import: set them first.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # The KV memory goes to the engine in bytes (``kv_cache_memory_bytes``), exactly; vLLM's
    # CPU platform would let a VLLM_CPU_KVCACHE_SPACE in the environment (whole GiB) override it.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    import torch

    # vLLM's CPU attention plans its work for the bound cores and runs it on torch's
    # threads: the two counts must agree when the engine starts, or its kernels abort the process.
    cores = engine_cores(options)
    if count_cores(cores) != torch.get_num_threads():
        torch.set_num_threads(count_cores(cores))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    if options.compile:
        use_inductor_cache()
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from dask_kvstate.backends import vllm_prefill

    fused_prefill = vllm_prefill.use(options.prefill_attention)

    transfer = KVTransferConfig(
        kv_connector=vllm_connector.KVStateConnector.__name__,
        kv_connector_module_path=vllm_connector.__name__,
        kv_role="kv_both",
        kv_connector_extra_config={vllm_connector.EXCHANGE_KEY: options.exchange},
    )
    settings: dict[str, Any] = {
        "model": str(options.folder),
        "dtype": options.dtype,
        "block_size": options.block_tokens,
        "enable_prefix_caching": True,  # the engine's own cache stays on; stats count its hits apart
        "distributed_executor_backend": "uni",
        "enforce_eager": not options.compile,
        "kv_transfer_config": transfer,
        "seed": 0,
        "kv_cache_memory_bytes": options.kv_cache_bytes,
    }
    if options.max_model_len is not None:  # else the model's own maximum
        settings["max_model_len"] = options.max_model_len
    args = EngineArgs(**settings)
    logger.info(
        "kvstate: starting a vLLM engine for %s (block size %d, cores %s, long prefills on %s's attention); "
        "this takes up to a minute or two",
        options.folder.name,
        options.block_tokens,
        os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "torch" if fused_prefill else "vLLM",
    )
    t0 = time.perf_counter()
    try:
        if options.compile:
            _check_cpp_compiler()
        engine = _built(args, options)
    except (ValueError, TypeError):  # the settings themselves: an eager start would refuse them too
        raise
    except Exception as e:
        if not options.compile:
            raise
        # torch.compile needs a working C++ toolchain and inductor support for the model; where
        # either fails, the engine still serves, eager, as vLLM's enforce_eager does.
        logger.warning(
            "kvstate: compiling the vLLM engine for %s failed (%s: %.300s); starting it eager instead "
            "(kvstate.vllm.compile: false skips the attempt)",
            options.folder.name,
            type(e).__name__,
            e,
        )
        engine = _built(EngineArgs(**{**settings, "enforce_eager": True}), options)
    plan_mixed_windows_unsplit(engine)
    logger.info("kvstate: vLLM engine ready in %.1f s", time.perf_counter() - t0)
    return engine


def plan_mixed_windows_unsplit(engine) -> bool:
    """Have vLLM's CPU attention plan without KV splits where the engine's layers mix windows;
    whether they do.

    Why: our connector needs vLLM's hybrid KV cache manager off, so every layer of a model
    such as Gemma 3 (sliding-window layers beside full ones) shares one KV cache group, and
    vLLM 0.32 plans that group's attention with no window (its
    ``CPUAttentionMetadataBuilder._group_sliding_window`` gives -1 where layers disagree). A
    decode step past the window is then split across the threads by position, and in a
    windowed layer a split lying wholly before the window computes nothing: the kernel
    merges that split's partial output, left as its scratch memory held it, scaled by zero,
    which is NaN where that memory held NaN from an earlier computation of the process.
    Every token after the first then came out as token 0, depending on what ran in the
    process before (``tests/test_vllm_kit.py`` leaves NaN there on purpose). Unsplit, each
    thread's work covers whole sequences and the kernel's own window mask applies: the same
    tokens, at the cost of attention parallelism for a decode of fewer sequences than threads.

    vLLM reads the switch at every step (``envs.VLLM_CPU_ATTN_SPLIT_KV``); set as a module
    attribute it is found before vLLM's environment lookup and its cache, for every CPU engine
    of this process from now on (a worker runs one).
    """
    from vllm import envs
    from vllm.model_executor.layers.attention import Attention

    layers = engine.vllm_config.compilation_config.static_forward_context.values()
    windows = {layer.impl.sliding_window for layer in layers if isinstance(layer, Attention)}
    if len(windows) < 2:
        return False
    envs.VLLM_CPU_ATTN_SPLIT_KV = False
    return True


def _check_cpp_compiler() -> None:
    """Raise inductor's own ``InvalidCxxCompiler`` now where it has no working C++ compiler.

    Inductor looks for one only when it builds its first kernel, after tracing and lowering
    the whole model: on a 2-core machine a start that was always going to fall back to eager
    spent 72 s finding out. Its lookup is torch's private API: where it moved, the compile
    attempt finds out as before."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:
        return
    get_cpp_compiler()


def _built(args, options: EngineOptions):
    """``LLMEngine.from_engine_args(args)``; a block size vLLM refuses is named as kvstate's setting."""
    from vllm.v1.engine.llm_engine import LLMEngine

    try:
        return LLMEngine.from_engine_args(args)
    except ValueError as e:
        if "block size" in str(e):
            raise ValueError(
                f"kvstate.block-tokens = {options.block_tokens} is not a block size this vLLM engine supports "
                f"({e}); vLLM's CPU attention needs a multiple of 32, e.g. 64"
            ) from e
        raise
