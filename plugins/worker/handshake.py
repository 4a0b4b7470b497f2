"""The worker side of the one handshake with the kvstate scheduler extensions.

See :mod:`dask_kvstate.plugins.scheduler.handshake`: a worker plugin announces itself
once at setup and learns which extensions run, each one's answer under its name, and
says goodbye before its handlers go.
"""

from __future__ import annotations

import asyncio
import logging

from dask_kvstate.protocol import GOODBYE, HELLO

logger = logging.getLogger("dask_kvstate")


async def hello(worker, plugin: str) -> dict:
    """``{extension name: answer}`` of the kvstate extensions on ``worker``'s scheduler.

    Empty when the scheduler runs none of them (or cannot be asked); never raises, so a
    worker plugin on a cluster without the extensions just stays quiet.
    """
    try:
        answers = await getattr(worker.scheduler, HELLO)(worker=worker.address, plugin=plugin)
    except Exception as e:  # no kvstate extension on this scheduler
        logger.debug("kvstate: no kvstate extension answered %s's hello (%s)", plugin, e)
        return {}
    return answers if isinstance(answers, dict) else {}


async def goodbye(worker, plugin: str, timeout: float) -> bool:
    """Tell ``worker``'s scheduler that ``plugin`` stops here; True once every extension answered.

    The answer means no extension sends the plugin anything any more and what was sent
    has been answered, so its handlers may go. Waits at most ``timeout`` seconds (a
    scheduler that is gone or stuck must not hold up a closing worker); never raises.
    """
    try:
        call = getattr(worker.scheduler, GOODBYE)(worker=worker.address, plugin=plugin)
        await asyncio.wait_for(call, timeout)
    except Exception as e:  # a scheduler gone, stuck, or running no kvstate extension
        logger.info("kvstate: the scheduler did not answer %s's goodbye (%s: %s)", plugin, type(e).__name__, e)
        return False
    return True
