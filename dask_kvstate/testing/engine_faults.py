"""Faults injected into a running vLLM engine of this process, for the tests and the soak.

Both act on the real engine of a :class:`~dask_kvstate.backends.vllm.VLLMBackend` (on a
worker: run them with ``client.run``), through the engine's driver thread, so nothing
races the step in progress:

* :func:`fail_steps` makes the engine's next forward passes raise, after vLLM has
  scheduled them (their blocks allocated and entered in its prefix cache, unwritten),
  which is where a kernel or out-of-memory error strikes;
* :func:`stop_driver` makes the driver thread itself raise outside a step, as a bug in
  the loop would.
"""

from __future__ import annotations

from typing import Any

#: The message of every injected failure, so a log or an error can be told apart from a real one.
INJECTED = "kvstate: injected engine fault"


def _executor(engine) -> Any:
    """The model executor of an in-process ``LLMEngine`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return engine.engine_core.engine_core.model_executor


def fail_steps(backend, n: int = 1) -> None:
    """Make the next ``n`` forward passes of ``backend``'s engine raise ``RuntimeError(INJECTED)``."""
    if n < 1:
        raise ValueError(f"fail_steps needs n >= 1, got {n}")

    def arm(engine) -> None:
        executor = _executor(engine)
        real = executor.execute_model
        left = [n]

        def execute_model(*args, **kwargs):
            if left[0] > 0:
                left[0] -= 1
                if left[0] == 0:
                    executor.execute_model = real  # the last injected failure puts the real one back
                raise RuntimeError(INJECTED)
            return real(*args, **kwargs)

        executor.execute_model = execute_model

    backend.loop.call(arm)


def stop_driver(backend) -> None:
    """Make ``backend``'s driver thread raise ``RuntimeError(INJECTED)`` before its next step."""
    loop = backend.loop

    def broken() -> None:
        raise RuntimeError(INJECTED)

    loop.call(lambda engine: setattr(loop, "_take_cores", broken))
