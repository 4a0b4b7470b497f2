"""The scheduler side of the one handshake between kvstate worker plugins and extensions.

A worker plugin must know which extensions run before it sends them stream ops (Dask
closes a worker's stream on an op nobody handles), and some extensions must know which
workers run which worker plugin before they send ops the other way. So every kvstate
worker plugin calls :data:`~dask_kvstate.protocol.HELLO` once at setup with its own name,
and every extension that defines ``kvstate_hello(worker, plugin)`` answers under its own
plugin name; an extension that is not running is simply absent from the answer.
"""

from __future__ import annotations

import inspect

from dask_kvstate.protocol import HELLO


def serve_hello(scheduler) -> None:
    """Answer :data:`HELLO` on ``scheduler``; every extension calls this in ``start`` (idempotent)."""
    if HELLO in scheduler.handlers:
        return

    async def kvstate_hello(worker: str | None = None, plugin: str | None = None) -> dict:
        answers = {}
        for name, extension in list(scheduler.plugins.items()):
            answer = getattr(extension, "kvstate_hello", None)
            if answer is None:
                continue
            result = answer(worker, plugin)
            answers[name] = await result if inspect.isawaitable(result) else result
        return answers

    scheduler.handlers[HELLO] = kvstate_hello


class AnnouncedWorkers:
    """Mixin for an extension with a worker half: which workers run that half.

    ``worker_half`` names the worker plugin. A worker enters ``announced`` when its copy
    of that plugin says hello and leaves it when the worker goes: the extension sends
    the plugin's stream ops only to these workers.
    """

    worker_half: str
    announced: set[str]

    def kvstate_hello(self, worker: str | None, plugin: str | None) -> bool:
        if worker is not None and plugin == self.worker_half:
            self.announced.add(worker)
        return True

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        self.announced.discard(worker)
