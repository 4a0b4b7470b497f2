"""Configuration: every knob is a key under ``kvstate.`` in ``kvstate.yaml``.

The defaults are registered with :func:`dask.config.update_defaults` on import, the way
``distributed`` registers ``distributed.yaml``, so users override them with the usual
Dask mechanisms (YAML files, ``DASK_KVSTATE__...`` environment variables,
``dask.config.set``). Values are read when an object is constructed, never at import.
"""
from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

_HERE = os.path.dirname(__file__)
_DEFAULTS_FILE = os.path.join(_HERE, "kvstate.yaml")
SCHEMA_FILE = os.path.join(_HERE, "kvstate-schema.yaml")

with open(_DEFAULTS_FILE) as f:
    _defaults = yaml.safe_load(f)

dask.config.update_defaults(_defaults)


def get(key: str, default: Any = dask.config.no_default) -> Any:
    """Read ``kvstate.<key>`` from the Dask config.

    Examples
    --------
    >>> get("block-tokens") > 0
    True
    """
    return dask.config.get(f"kvstate.{key}", default=default)


def get_bytes(key: str) -> int:
    """Read a byte size such as ``4GiB`` and return it as an int.

    Examples
    --------
    >>> with dask.config.set({"kvstate.worker.device-bytes": "1KiB"}):
    ...     get_bytes("worker.device-bytes")
    1024
    """
    return int(dask.utils.parse_bytes(get(key)))


def parse_bandwidth(value) -> float | None:
    """Bytes per second from ``"10 Mbit/s"``, ``"1.25 MB/s"``, ``"1GB"`` or a number; None stays None.

    Examples
    --------
    >>> parse_bandwidth("10 Mbit/s"), parse_bandwidth("1.25 MB/s"), parse_bandwidth(None)
    (1250000.0, 1250000.0, None)
    """
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip().removesuffix("/s").replace("ps", "")
    bits = text.lower().endswith("bit")
    if bits:
        text = text[: -len("bit")] + "B"
    n = float(dask.utils.parse_bytes(text))
    return n / 8 if bits else n


def get_seconds(key: str) -> float:
    """Read a duration such as ``5s`` and return it in seconds.

    Examples
    --------
    >>> with dask.config.set({"kvstate.transport.connect-timeout": "250ms"}):
    ...     get_seconds("transport.connect-timeout")
    0.25
    """
    return float(dask.utils.parse_timedelta(get(key), default="seconds"))
