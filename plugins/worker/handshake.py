"""The worker side of the one handshake with the kvstate scheduler extensions.

See :mod:`dask_kvstate.plugins.scheduler.handshake`: a worker plugin announces itself
once at setup and learns which extensions run, each one's answer under its name.
"""

from __future__ import annotations

import logging

from dask_kvstate.protocol import HELLO

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
