"""One vLLM engine inside the Dask worker's process, and the thread that drives it.

vLLM's CPU build, started plainly, runs its engine core and its model executor as two
more processes; a Dask worker under a nanny is a daemon process and may not have
children, and KV crossing those process boundaries would go through pickle or shared
memory. So the engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
the single-process ``uni`` executor, and our connector's halves
(:mod:`.vllm_connector`) share this process with the block store.

vLLM batches whatever requests it holds at each step (continuous batching). Dask runs
tasks on several threads, so one driver thread owns the engine: task threads submit
requests and wait for their result, and concurrent tasks of a worker share the engine's
steps the way clients of a vLLM server do.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as WaitTimeout  # the builtin TimeoutError only from 3.11
from dataclasses import dataclass, field
from typing import Any

from dask_kvstate.backends import vllm_connector
from dask_kvstate.backends.vllm_cores import CoreShare, count_cores
from dask_kvstate.backends.vllm_start import EngineOptions, engine_cores, start_engine
from dask_kvstate.errors import EngineFailed

logger = logging.getLogger("dask_kvstate")

#: Seconds between a waiting task's looks at whether the driver thread still runs: the
#: bound on how long a task waits on an engine whose driver died.
WAIT_POLL = 1.0

#: How often a request caught in a failed engine step is submitted again (a fault of the
#: step, not of the request, passes on the retry; a request that breaks every step fails).
STEP_RETRIES = 1


@dataclass
class Job:
    """One request: prompt ids, vLLM sampling params, the connector order (if any) and the
    request's ``cache_salt`` (its tenant: vLLM folds it into the hash of the request's
    first block, so blocks of one salt are never a prefix-cache hit for another)."""

    ids: list[int]
    params: object  # vllm.SamplingParams
    order: vllm_connector.Order | None
    salt: str | None = None
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    failed_steps: int = 0  # engine steps this job was in that raised


@dataclass
class Call:
    """A function of the engine to run on the driver thread."""

    fn: object
    future: Future

    def run(self, engine) -> None:
        try:
            self.future.set_result(self.fn(engine))  # type: ignore[operator]
        except BaseException as e:
            self.future.set_exception(e)


@dataclass
class Finished:
    """What the engine returned for one job."""

    token_ids: list[int]
    submitted: float
    first_token_at: float
    finished_at: float
    engine_hit_tokens: int  # prompt tokens vLLM's own prefix cache held (reported by vLLM)


class EngineLoop:
    """Starts one engine on its own thread and drives it there; :meth:`run` is called from any task thread.

    The engine is built on the thread that steps it: vLLM binds that thread's OpenMP team
    to the engine's cores when it starts, and its CPU attention aborts the process when a
    step runs on a thread with another team size.
    """

    def __init__(self, options: EngineOptions, exchange: vllm_connector.Exchange):
        self.exchange = exchange
        # A list is the jobs of one run(): the driver takes them in one go, so they share a step.
        self._queue: queue.SimpleQueue[Job | Call | list[Job] | None] = queue.SimpleQueue()
        self._jobs: dict[str, Job] = {}
        self._closed = False
        self.name = options.folder.name
        self.dead: EngineFailed | None = None  # why the driver stopped, once it has
        #: Called once, from the driver thread, with the error when the driver dies (the
        #: worker plugin makes the worker leave the cluster, so its nanny starts a fresh one).
        self.on_death: list = []
        started: Future = Future()
        self._thread = threading.Thread(target=self._main, args=(options, started), name="kvstate-vllm-engine")
        self._thread.daemon = True
        self._thread.start()
        self.engine = started.result()  # the engine's start error, raised in the caller
        # Only the engine's own thread runs torch multi-threaded in this process. torch gives
        # each thread's OpenMP team, at its first parallel op, the count last set anywhere in
        # the process (start_engine set the engine's); another thread's team beside the
        # engine's makes libgomp count more threads than cores, and it then stops spinning
        # between parallel regions, for the engine too: its decode step took 26.3-28.6 ms in
        # a Dask worker against 13.4-19.6 ms alone. The driver keeps the count it has set.
        self._set_num_threads(1)

    def _main(self, options: EngineOptions, started: Future) -> None:
        import torch

        # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op once it
        # binds its threads; close() puts it back (and the driver its full thread count on
        # the way out), so the rest of the process keeps both.
        self._set_num_threads = torch.set_num_threads
        try:
            engine = start_engine(options)
        except BaseException as e:
            started.set_exception(e)
            return
        self.engine = engine
        cores = engine_cores(options)
        self._full_threads = self._threads = count_cores(cores)
        try:
            self._cores = CoreShare(cores) if options.share_cores else None
        except Exception as e:  # no shared memory or no slot: step on every core, as vLLM alone does
            logger.warning(
                "kvstate: cannot share cores %s with other engines (%s); this engine uses them all", cores, e
            )
            self._cores = None
        started.set_result(engine)
        try:
            self._loop()
        except BaseException as e:  # anything that escapes a step's own handling ends the engine
            self._die(e)
        finally:
            if self._threads != self._full_threads:
                self._set_num_threads(self._full_threads)
            if self._cores is not None:
                self._cores.close()

    def submit(self, job: Job | Call) -> Future:
        self._put(job)
        return job.future

    def _put(self, item: Job | Call | list[Job]) -> None:
        if self.dead is not None:
            raise EngineFailed(str(self.dead))
        if self._closed:
            raise RuntimeError("the vLLM engine of this worker is closed")
        self._queue.put(item)

    def wait(self, future: Future):
        """``future``'s result, or :class:`EngineFailed` within :data:`WAIT_POLL` seconds of
        the driver thread's death (a job it never took would otherwise wait forever)."""
        while True:
            try:
                return future.result(timeout=WAIT_POLL)
            except WaitTimeout:
                if not self._thread.is_alive() and not future.done():
                    raise EngineFailed(str(self.dead or f"the vLLM engine {self.name!r} stopped")) from None

    def run(self, jobs: list[Job]) -> list[Finished]:
        """Submit ``jobs`` together and wait for them: the driver takes them as one item, so
        the engine's next step has them all (one by one, it could wake between two)."""
        self._put(list(jobs))
        return [self.wait(job.future) for job in jobs]

    def call(self, fn):
        """``fn(engine)`` on the driver thread, between steps (the engine is not thread-safe); its result."""
        future: Future = Future()
        self.submit(Call(fn, future))
        return self.wait(future)

    def close(self) -> None:
        """Stop the driver, then the engine, and free the process's connector for a next engine."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=30)
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        self.engine.engine_core.shutdown()
        ensure_kv_transfer_shutdown()
        import torch

        torch.set_num_threads = self._set_num_threads

    # -- the driver thread ---------------------------------------------------------
    def _add(self, job: Job) -> None:
        extra = None
        if job.order is not None:
            self.exchange.put(job.request_id, job.order)
            extra = {"kv_transfer_params": {vllm_connector.PARAM: job.request_id}}
        job.params.extra_args = extra  # type: ignore[attr-defined]
        self._jobs[job.request_id] = job
        prompt: dict[str, Any] = {"prompt_token_ids": job.ids}
        if job.salt is not None:
            prompt["cache_salt"] = job.salt
        try:
            self.engine.add_request(job.request_id, prompt, job.params)
        except BaseException as e:  # a prompt the engine refuses (too long, ...): that job fails alone
            self._finish(job, error=e)

    def _finish(self, job: Job, output=None, error: BaseException | None = None) -> None:
        self._jobs.pop(job.request_id, None)
        if job.order is not None:
            self.exchange.pop(job.request_id)
        if error is not None:
            job.future.set_exception(error)
            return
        now = time.perf_counter()
        hits = getattr(output, "num_cached_tokens", None) or 0
        job.future.set_result(
            Finished(
                token_ids=list(output.outputs[0].token_ids),
                submitted=job.submitted,
                first_token_at=job.first_token_at or now,
                finished_at=now,
                engine_hit_tokens=int(hits),
            )
        )

    def _take(self) -> list[Job | Call | None]:
        """Every submitted job, waiting for one while the engine has nothing to do."""
        taken: list[Job | Call | None] = []
        if not self.engine.has_unfinished_requests():
            if self._cores is not None:
                self._cores.idle()  # nothing to step: the host's other engines may take our cores
            _unpack(self._queue.get(), taken)
        while True:
            try:
                _unpack(self._queue.get_nowait(), taken)
            except queue.Empty:
                return taken

    def _loop(self) -> None:
        while True:
            for job in self._take():
                if job is None:
                    self._fail_all(RuntimeError("the vLLM engine of this worker was closed"))
                    return
                if isinstance(job, Call):
                    job.run(self.engine)
                else:
                    self._add(job)
            if not self.engine.has_unfinished_requests():
                continue
            self._take_cores()
            t_step = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:
                logger.exception("kvstate: the vLLM engine %r failed a step", self.name)
                self._recover_from_failed_step(e)
                continue
            now = time.perf_counter()
            # Steps and the seconds inside them (``engine_stats``): how busy the engine was,
            # and in how many steps, beside what a caller waited.
            self.exchange.counters["steps"] += 1
            self.exchange.counters["step_s"] += now - t_step
            for out in outputs:
                job = self._jobs.get(out.request_id)
                if job is None:
                    continue
                if job.first_token_at is None and out.outputs and out.outputs[0].token_ids:
                    job.first_token_at = now
                if out.finished:
                    self._finish(job, out)

    def _take_cores(self) -> None:
        """Run the next step on this engine's share of its cores (:mod:`.vllm_cores`)."""
        if self._cores is None:
            return
        threads = self._cores.threads()
        if threads != self._threads:
            self._set_driver_threads(threads)
            self._threads = threads
        if threads < self._full_threads:
            self.exchange.counters["steps_on_shared_cores"] += 1

    def _set_driver_threads(self, threads: int) -> None:
        """This (the driver) thread's OpenMP and MKL thread count, and no other thread's.

        torch's setter (the saved one: vLLM replaced the public one with a no-op) sets the
        calling thread's count and also the count every thread of the process starts its
        OpenMP team with; left at ``threads``, the next task thread to run a parallel op
        would start a second team beside the engine's, and libgomp would stop spinning
        for both (the reason for the count of 1 set in ``__init__``). torch has no
        per-thread setter, so a short-lived thread puts the process's count back to 1:
        each thread's own count is its own, so this one's stays ``threads``.
        """
        self._set_num_threads(threads)
        if threads != 1:
            reset = threading.Thread(target=self._set_num_threads, args=(1,), name="kvstate-thread-count")
            reset.start()
            reset.join()

    def _recover_from_failed_step(self, error: Exception) -> None:
        """After a step that raised: abort its requests, drop the engine's prefix cache, retry them.

        vLLM registers a block's hash in its prefix cache when it schedules the block,
        before the forward that writes it; after a failed forward those blocks are in the
        cache unwritten, and a later request with the same prefix (of any tenant with the
        same salt) would read them. Resetting the prefix cache with every request aborted
        forgets them all. A reset that does not take leaves the engine untrustworthy: that
        ends the driver (:meth:`_die`).
        """
        jobs = list(self._jobs.values())
        for job in jobs:
            with contextlib.suppress(Exception):  # the job is dropped from our side below either way
                self.engine.abort_request([job.request_id])
            self._jobs.pop(job.request_id, None)
            if job.order is not None:
                self.exchange.pop(job.request_id)
        if not self.engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError(f"the vLLM engine {self.name!r} could not drop its prefix cache after a failed step")
        self.exchange.counters["failed_steps"] += 1
        for job in jobs:
            job.failed_steps += 1
            if job.failed_steps > STEP_RETRIES:
                self._finish(job, error=EngineFailed(f"the vLLM engine {self.name!r} failed a step: {error!r}"))
                continue
            self.exchange.counters["retried_requests"] += 1
            if job.order is not None:
                job.order.reset()
            job.request_id, job.first_token_at = uuid.uuid4().hex, None
            self._add(job)

    def _die(self, error: BaseException) -> None:
        """The driver is ending on ``error``: fail every job and call it has or will be handed."""
        logger.error("kvstate: the vLLM engine %r stopped: %r", self.name, error, exc_info=error)
        self.dead = EngineFailed(f"the vLLM engine {self.name!r} stopped: {error!r}")
        self._fail_all(self.dead)
        left: list[Job | Call | None] = []
        while True:
            try:
                _unpack(self._queue.get_nowait(), left)
            except queue.Empty:
                break
        for item in left:
            if item is not None:
                item.future.set_exception(EngineFailed(str(self.dead)))
        for hook in self.on_death:
            try:
                hook(self.dead)
            except Exception:
                logger.exception("kvstate: a hook on the vLLM engine's death failed")

    def _fail_all(self, error: BaseException) -> None:
        for job in list(self._jobs.values()):
            with contextlib.suppress(Exception):  # the engine may be gone; the job still fails below
                self.engine.abort_request([job.request_id])
            self._finish(job, error=error)


def _unpack(item: Job | Call | list[Job] | None, into: list[Job | Call | None]) -> None:
    """Append a queue item to ``into``: a run's jobs one by one, anything else as it is."""
    if isinstance(item, list):
        into.extend(item)
    else:
        into.append(item)
