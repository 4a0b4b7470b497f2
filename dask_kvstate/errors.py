"""Exceptions users may want to catch."""

from __future__ import annotations


class MergeError(ValueError):
    """A merge outside the restricted, prefix-compatible concatenation ``kvs.merge`` allows."""


class EngineFailed(RuntimeError):
    """An inference engine of a worker failed the request: a step raised twice, or its driver stopped.

    The message names the engine. The worker leaves the cluster when its engine's driver
    stops (a nanny starts a fresh worker), so tasks submitted again run elsewhere.
    """
