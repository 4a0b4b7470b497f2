"""Exceptions users may want to catch."""

from __future__ import annotations


class MergeError(ValueError):
    """A merge outside the restricted, prefix-compatible concatenation ``kvs.merge`` allows."""
