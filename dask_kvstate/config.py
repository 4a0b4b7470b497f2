"""Configuration: every knob is a key under ``kvstate.`` in ``kvstate.yaml``.

The defaults are registered with :func:`dask.config.update_defaults` on import, the way
``distributed`` registers ``distributed.yaml``, so users override them with the usual
Dask mechanisms (YAML files, ``DASK_KVSTATE__...`` environment variables,
``dask.config.set``). Values are read when an object is constructed, never at import.
"""

from __future__ import annotations

import functools
import math
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


def seconds(key: str, value=None, *, minimum: float = 0.0, strict: bool = False) -> float:
    """``value`` (default: the setting ``key``) as seconds, checked; ValueError names ``key``.

    For plugins' arguments that override a setting: ``None`` reads the setting. Must be
    ``>= minimum`` (``> minimum`` with ``strict``).

    Examples
    --------
    >>> seconds("scheduling.interval", "250ms")
    0.25
    """
    raw = get(key) if value is None else value
    try:
        v = float(dask.utils.parse_timedelta(raw, default="seconds"))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"kvstate.{key} must be a duration like '200ms', got {raw!r}") from e
    if v < minimum or (strict and v == minimum):
        raise ValueError(f"kvstate.{key} must be {'>' if strict else '>='} {minimum:g} s, got {raw!r}")
    return v


# -- checking a whole kvstate config ----------------------------------------------------
# Dask validates no config, and jsonschema is not a dependency of distributed, so the
# few schema keywords kvstate-schema.yaml uses are checked here by hand; values the
# schema types only loosely (byte sizes, durations, bandwidths as strings) are parsed.
_JSON_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, (list, tuple)),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
}
_BYTES = ("worker.device-bytes", "worker.host-bytes", "worker.disk-bytes", "worker.malloc-retain")
_SECONDS = ("worker.recency-half-life", "transport.connect-timeout", "transport.timeout")


@functools.lru_cache(maxsize=1)
def _schema() -> dict:
    with open(SCHEMA_FILE) as f:
        return yaml.safe_load(f)["properties"]["kvstate"]


def _check_node(value, schema: dict, path: str) -> None:
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_JSON_TYPES[t](value) for t in types):
            raise ValueError(f"kvstate.{path} must be of type {' or '.join(types)}, got {value!r:.80}")
    if "enum" in schema and value not in schema["enum"]:
        raise ValueError(f"kvstate.{path} must be one of {schema['enum']}, got {value!r:.80}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and not value >= schema["minimum"]:
            raise ValueError(f"kvstate.{path} must be >= {schema['minimum']}, got {value!r}")
        if "exclusiveMinimum" in schema and not value > schema["exclusiveMinimum"]:
            raise ValueError(f"kvstate.{path} must be > {schema['exclusiveMinimum']}, got {value!r}")
        if "maximum" in schema and not value <= schema["maximum"]:
            raise ValueError(f"kvstate.{path} must be <= {schema['maximum']}, got {value!r}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key, sub in value.items():
            name = str(key).replace("_", "-")  # DASK_KVSTATE__BLOCK_TOKENS arrives as block_tokens
            if name not in props and isinstance(schema.get("additionalProperties"), dict):
                # a mapping of user names (components, roles): each value follows one schema
                _check_node(sub, schema["additionalProperties"], f"{path}{'.' if path else ''}{key}")
                continue
            if name not in props:
                raise ValueError(
                    f"unknown config key kvstate.{path}{'.' if path else ''}{key}; known: {', '.join(props)}"
                )
            _check_node(sub, props[name], f"{path}{'.' if path else ''}{name}")
    elif isinstance(value, (list, tuple)) and "items" in schema:
        for i, item in enumerate(value):
            _check_node(item, schema["items"], f"{path}[{i}]")


def check(cfg: dict) -> None:
    """Raise ValueError naming the first bad key of a ``kvstate`` config; None if it is good.

    Checks what ``kvstate-schema.yaml`` says (types, ranges, choices, no unknown keys)
    and that byte sizes, durations and bandwidths parse and are positive, so a typo in a
    YAML file or a ``DASK_KVSTATE__...`` variable fails at ``kvs.install`` (or the
    preload), not in a task on a worker.

    Examples
    --------
    >>> check(dask.config.get("kvstate"))
    >>> check({"block-tokens": 0})
    Traceback (most recent call last):
    ...
    ValueError: kvstate.block-tokens must be >= 1, got 0
    >>> check({"worker": {"disk-bytes": "lots"}})
    Traceback (most recent call last):
    ...
    ValueError: kvstate.worker.disk-bytes must be a byte size like '16GiB', got 'lots'
    """
    if not isinstance(cfg, dict):
        raise TypeError(f"a kvstate config is a dict, got {type(cfg).__name__}")
    _check_node(cfg, _schema(), "")

    def leaf(path: str):
        node = cfg
        for part in path.split("."):
            if not isinstance(node, dict):
                return None
            node = next((v for k, v in node.items() if str(k).replace("_", "-") == part), None)
        return node

    for path in _BYTES:
        v = leaf(path)
        if v is None:
            continue
        try:
            n = dask.utils.parse_bytes(v)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError):
            n = None
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"kvstate.{path} must be a byte size like '16GiB', got {v!r:.80}")
    for path in _SECONDS:
        v = leaf(path)
        if v is None:
            continue
        try:
            s = dask.utils.parse_timedelta(v, default="seconds")
        except (ValueError, TypeError, KeyError, IndexError, OverflowError):  # parse_timedelta('') raises IndexError
            s = None
        if not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise ValueError(f"kvstate.{path} must be a positive duration like '5s', got {v!r:.80}")
    v = leaf("transport.emulated-bandwidth")
    if v is not None:
        try:
            bw = parse_bandwidth(v)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError):
            bw = None
        if bw is None or not math.isfinite(bw) or bw <= 0:
            raise ValueError(
                f"kvstate.transport.emulated-bandwidth must be a rate like '100 Mbit/s' or null, got {v!r:.80}"
            )
