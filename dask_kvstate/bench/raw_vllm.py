"""The baseline a vLLM user runs alone: one ``vllm.LLM`` engine in its own process, no Dask.

Every speedup the bench claims for kvstate over vLLM is a ratio against this engine,
measured in the same run: the engine with every core of the host
(``VLLM_CPU_OMP_THREADS_BIND``), vLLM's own prefix caching on, its own defaults
otherwise (its engine core in a process of its own, its block size), and requests
handed to it the way a user hands them:

- :meth:`RawEngine.generate`: requests known at once go in one ``LLM.generate`` call
  (vLLM batches them, and its prefix cache serves what they share);
- :meth:`RawEngine.one_by_one`: requests that arrive over time go in one at a time,
  each timed to its first token from the engine's own step loop (what a client of
  a streaming server sees);
- :meth:`RawEngine.sessions`: multi-call sessions, each call submitted the moment the
  session's previous answer is out (and its first at the session's arrival), while
  the other sessions' calls run: what a server fed by many agents sees, first come,
  first served.

The engine runs in a child process started with ``spawn``
(:mod:`~dask_kvstate.bench.raw_vllm_process`), so it owns its cores and memory the way a
separate server would, and nothing of the parent's threads, torch settings or Dask event
loop reaches it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict


class RawVariant(TypedDict, total=False):
    """What a raw variant sets beyond vLLM's defaults (:class:`RawEngine` keywords)."""

    enforce_eager: bool
    core_in_process: bool


#: The raw engine's variants by name, as :class:`RawEngine` keywords: vLLM's default start
#: (compiled) and eager, and the engine core in the engine's own process
#: (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as a kvstate worker runs its engine; not vLLM's
#: default, but a setting a user can make). Rows against the raw engine take the fastest
#: variant run for each figure.
RAW: dict[str, RawVariant] = {
    "raw-vllm": {},
    "raw-vllm-eager": {"enforce_eager": True},
    "raw-vllm-core-in-process": {"core_in_process": True},
}
#: The variants the experiments run unless told which: vLLM as a user starts it, and with its
#: engine core in process, often the fastest on few cores (the strongest baseline to beat).
DEFAULT_RAW = ("raw-vllm", "raw-vllm-eager", "raw-vllm-core-in-process")


def raw_variant(row: str) -> str | None:
    """The raw engine variant a row of an experiment's table runs, or None for a kvstate row.
    A raw row may carry what it runs with in brackets (``sessions_vs_raw``'s more memory).

    >>> raw_variant("raw-vllm-eager"), raw_variant("raw-vllm (3GiB KV)"), raw_variant("kvstate")
    ('raw-vllm-eager', 'raw-vllm', None)
    """
    variant = row.split(" (", 1)[0]
    return variant if variant in RAW else None


def cpu_model() -> str:
    """The CPU's model name and the vector instructions torch runs on it, which every figure
    is given with: machines differ between runs, and one name ("AMD EPYC") has come with
    AVX-512 one time and with AVX2 only another, several times slower.
    """
    import torch

    name = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    isa = torch.backends.cpu.get_cpu_capability()
    if torch.cpu._is_amx_tile_supported():
        isa += " + AMX"
    return f"{name}, {isa}"


@dataclass(frozen=True)
class RawResult:
    """One request served by the raw engine."""

    token_ids: list[int]
    ttft_s: float  # submission to first token (one_by_one), or to the call's end (generate)
    latency_s: float  # submission to the last token
    cached_tokens: int  # prompt tokens vLLM's own prefix cache served
    prompt_tokens: int = 0  # the prompt's tokens; less cached_tokens, those the engine computed


@dataclass(frozen=True)
class RawSettings:
    """How the raw engine is started: what a user of ``vllm.LLM`` would set, nothing more."""

    folder: str  # the model's safetensors folder
    cores: str  # "0-1" style: the engine's OpenMP threads bind here
    kv_cache_bytes: int | None = None  # vLLM's kv_cache_memory_bytes; None: its own default
    dtype: str = "float32"
    block_tokens: int | None = None  # None: vLLM's default block size
    max_model_len: int | None = None
    enforce_eager: bool = False  # vLLM's default compiles the model
    core_in_process: bool = False  # vLLM's default runs its engine core in a process of its own
    max_num_seqs: int | None = None  # requests the engine runs at once; None: vLLM's default


class RawEngineError(RuntimeError):
    """The raw engine's process failed; the message carries its traceback."""


class RawEngine:
    """A ``vllm.LLM`` in a child process, driven over a pipe.

    Parameters
    ----------
    model
        A model name :mod:`dask_kvstate.backends.models` knows, or a local folder.
    cores
        The cores the engine binds (``"0-1"``); default: every core this process may use.
    kv_cache_bytes
        The engine's KV memory in bytes (``kv_cache_memory_bytes``); default: vLLM's.
    max_num_seqs
        Requests the engine runs at once (vLLM's ``max_num_seqs``); default: vLLM's.
    core_in_process
        Run vLLM's engine core in the engine's process rather than in one more of its own.
    start_timeout
        Seconds to wait for the engine to start (51-83 s seen on a 2-core CPU machine).

    Raises
    ------
    RawEngineError
        If the engine does not start; the child's traceback is in the message.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        cores: str | None = None,
        kv_cache_bytes: int | None = None,
        dtype: str = "float32",
        block_tokens: int | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        core_in_process: bool = False,
        max_num_seqs: int | None = None,
        start_timeout: float = 600.0,
    ):
        from dask_kvstate import backends
        from dask_kvstate.backends import models

        self.settings = RawSettings(
            folder=str(models.folder(model)),
            cores=cores or backends.cores_of_this_process(),
            kv_cache_bytes=kv_cache_bytes,
            dtype=dtype,
            block_tokens=block_tokens,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            core_in_process=core_in_process,
            max_num_seqs=max_num_seqs,
        )
        from dask_kvstate.bench.raw_vllm_process import serve

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=serve, args=(child, asdict(self.settings)), name="raw-vllm")
        with _without_dask_worker_environ():
            self._process.start()
        child.close()
        t0 = time.perf_counter()
        self.start_s = self._reply(start_timeout)["start_s"]
        self.wall_start_s = time.perf_counter() - t0

    def generate(self, prompts: list[str], max_new_tokens: int) -> tuple[list[RawResult], float]:
        """Every prompt in one ``LLM.generate`` call (greedy): the results in order and the call's wall seconds."""
        reply = self._ask("generate", prompts=prompts, max_new_tokens=max_new_tokens)
        return [RawResult(**r) for r in reply["results"]], reply["wall_s"]

    def one_by_one(self, prompts: list[str], max_new_tokens: int) -> list[RawResult]:
        """Each prompt submitted after the last one finished (greedy), each timed to its first token."""
        reply = self._ask("one_by_one", prompts=prompts, max_new_tokens=max_new_tokens)
        return [RawResult(**r) for r in reply["results"]]

    def sessions(self, sessions: list[dict], max_new_tokens: int, closing: str) -> tuple[list[dict], dict]:
        """Run multi-call sessions on the engine as their requests arrive (greedy).

        ``sessions``: one ``{"arrival": s, "context": str, "prompts": [str, ...]}`` each.
        Call ``i`` of a session is its context followed by ``prompts[i]``; once it is
        answered the context grows by the prompt, the answer's text and ``closing``, and
        call ``i + 1`` goes in at once. Back: one dict per session (``arrival_s``,
        ``end_s`` from the first arrival's clock, and ``calls``: per call ``token_ids``,
        ``latency_s``, ``cached_tokens`` served by the prefix cache, ``computed_tokens``),
        and the engine's steps over the run (``steps``, ``step_s``: seconds inside them).
        """
        reply = self._ask("sessions", sessions=sessions, max_new_tokens=max_new_tokens, closing=closing)
        return reply["sessions"], reply["engine"]

    def reset_prefix_cache(self) -> None:
        """Empty the engine's prefix cache, so the next request starts cold."""
        self._ask("reset")

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("close", {}))
                self._process.join(timeout=60)
            except (BrokenPipeError, EOFError, OSError):
                pass
        if self._process.is_alive() and self._process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)  # vLLM's own processes with it
            self._process.join(timeout=10)
        self._conn.close()

    def __enter__(self) -> RawEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ask(self, op: str, timeout: float | None = None, **kwargs) -> dict:
        self._conn.send((op, kwargs))
        return self._reply(timeout)

    def _reply(self, timeout: float | None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(1.0):
            if not self._process.is_alive():
                raise RawEngineError(f"the raw vLLM engine's process exited with code {self._process.exitcode}")
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise RawEngineError(f"the raw vLLM engine did not answer within {timeout:.0f} s")
        reply = self._conn.recv()
        if "error" in reply:
            raise RawEngineError(f"the raw vLLM engine failed:\n{reply['error']}")
        return reply


@contextlib.contextmanager
def _without_dask_worker_environ():
    """This process's environment without what Dask's nannies wrote into it, while inside.

    A ``LocalCluster``'s nannies live in the process that made it, and each sets
    ``distributed.nanny.pre-spawn-environ`` (``OMP_NUM_THREADS=1``, ``MKL_NUM_THREADS=1``,
    ``MALLOC_TRIM_THRESHOLD_=65536``, ...) in that process's ``os.environ`` before starting
    a worker, and leaves it there. A raw engine started afterwards would inherit them and
    run its model on one thread: measured here, 16 agents took the raw engine 69.5 s after
    a cluster had been made against 36.3 s before. A user's own vLLM has none of them,
    so they are left out of the engine's process (a variable of the same value the user
    set is left out too).
    """
    import dask
    import distributed  # noqa: F401  (loads distributed's config, where the defaults are)

    dask_env = {k: str(v) for k, v in (dask.config.get("distributed.nanny.pre-spawn-environ", None) or {}).items()}
    removed = {k: os.environ.pop(k) for k, v in dask_env.items() if os.environ.get(k) == v}
    try:
        yield removed
    finally:
        os.environ.update(removed)
