"""The scheduler side of the one handshake between kvstate worker plugins and extensions.

A worker plugin must know which extensions run before it sends them stream ops (Dask
closes a worker's stream on an op nobody handles), and some extensions must know which
workers run which worker plugin before they send ops the other way. So every kvstate
worker plugin calls :data:`~dask_kvstate.protocol.HELLO` once at setup with its own name,
and every extension that defines ``kvstate_hello(worker, plugin)`` answers under its own
plugin name; an extension that is not running is simply absent from the answer.

A worker plugin that goes away (removed, replaced, or its worker closing: Dask tears
every plugin down while the worker still counts as running on the scheduler) calls
:data:`~dask_kvstate.protocol.GOODBYE` before dropping its handlers, and every extension
that defines ``kvstate_goodbye(worker, plugin)`` stops sending to it; the answer comes
once the calls already sent there have been answered, so none reaches a worker that has
no handler for it.
"""

from __future__ import annotations

import inspect

from dask_kvstate.protocol import GOODBYE, HELLO


async def _ask_every_extension(scheduler, method: str, worker: str | None, plugin: str | None) -> dict:
    answers = {}
    for name, extension in list(scheduler.plugins.items()):
        answer = getattr(extension, method, None)
        if answer is None:
            continue
        result = answer(worker, plugin)
        answers[name] = await result if inspect.isawaitable(result) else result
    return answers


def serve_hello(scheduler) -> None:
    """Answer :data:`HELLO` and :data:`GOODBYE` on ``scheduler`` (each extension calls it in ``start``; idempotent)."""
    if HELLO not in scheduler.handlers:

        async def kvstate_hello(worker: str | None = None, plugin: str | None = None) -> dict:
            return await _ask_every_extension(scheduler, "kvstate_hello", worker, plugin)

        scheduler.handlers[HELLO] = kvstate_hello
    if GOODBYE not in scheduler.handlers:

        async def kvstate_goodbye(worker: str | None = None, plugin: str | None = None) -> dict:
            return await _ask_every_extension(scheduler, "kvstate_goodbye", worker, plugin)

        scheduler.handlers[GOODBYE] = kvstate_goodbye


class AnnouncedWorkers:
    """Mixin for an extension with a worker half: which workers run that half.

    ``worker_half`` names the worker plugin. A worker enters ``announced`` when its copy
    of that plugin says hello and leaves it when that copy says goodbye or the worker
    goes: the extension sends the plugin's stream ops and RPCs only to these workers.
    """

    worker_half: str
    announced: set[str]

    def kvstate_hello(self, worker: str | None, plugin: str | None) -> bool:
        if worker is not None and plugin == self.worker_half:
            self.announced.add(worker)
        return True

    async def kvstate_goodbye(self, worker: str | None, plugin: str | None) -> bool:
        if worker is not None and plugin == self.worker_half:
            self.announced.discard(worker)
        return True

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        self.announced.discard(worker)
