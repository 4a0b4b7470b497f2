"""Configuration: every knob is a key under ``kvstate.`` in ``kvstate.yaml``.

The defaults are registered with :func:`dask.config.update_defaults` on import, the way
``distributed`` registers ``distributed.yaml``, so users override them with the usual
Dask mechanisms (YAML files, ``DASK_KVSTATE__...`` environment variables,
``dask.config.set``). Values are read when an object is constructed, never at import.

``kvstate.yaml`` is the only place a default lives: code reads a key with :func:`get`
(or :func:`get_bytes`, :func:`get_seconds`, :func:`get_bandwidth`) and never supplies a
fallback of its own. ``kvstate-schema.yaml`` describes every key; a key whose schema has
``format: bytes``, ``duration`` or ``bandwidth`` is parsed by :func:`parse`, and its
``minimum`` / ``exclusiveMinimum`` / ``maximum`` bound the parsed value (bytes, seconds,
bytes per second), so :func:`check` and the readers accept the same values.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import dask.config
import dask.utils
import yaml

_HERE = os.path.dirname(__file__)
DEFAULTS_FILE = os.path.join(_HERE, "kvstate.yaml")
SCHEMA_FILE = os.path.join(_HERE, "kvstate-schema.yaml")

with open(DEFAULTS_FILE) as f:
    _defaults = yaml.safe_load(f)

dask.config.update_defaults(_defaults)


def get(key: str) -> Any:
    """Read ``kvstate.<key>`` from the Dask config.

    There is no ``default`` argument: every key has its default in ``kvstate.yaml``, so a
    key that is missing is a typo in the code and raises KeyError.

    Examples
    --------
    >>> get("block-tokens") > 0
    True
    """
    return dask.config.get(f"kvstate.{key}")


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


# -- formatted values: byte sizes, durations, bandwidths --------------------------------
def _duration(value) -> float:
    if isinstance(value, (int, float)):  # parse_timedelta cannot read a negative number
        return float(value)
    return float(dask.utils.parse_timedelta(value, default="seconds"))


# format name -> (parser to base units, what a good value looks like, unit shown in range errors)
_FORMATS = {
    "bytes": (lambda v: int(dask.utils.parse_bytes(v)), "a byte size like '16GiB'", "bytes"),
    "duration": (_duration, "a duration like '200ms'", "s"),
    "bandwidth": (parse_bandwidth, "a rate like '100 Mbit/s'", "B/s"),
}
# what Dask's parsers raise on nonsense (parse_timedelta('') raises IndexError)
_PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError, OverflowError, AttributeError)


@functools.lru_cache(maxsize=1)
def _schema() -> dict:
    with open(SCHEMA_FILE) as f:
        return yaml.safe_load(f)["properties"]["kvstate"]


def _schema_of(key: str) -> dict:
    node = _schema()
    for part in key.split("."):
        node = node["properties"][part]
    return node


def _types(schema: dict) -> list[str]:
    types = schema.get("type", [])
    return [types] if isinstance(types, str) else list(types)


def _check_range(key: str, number: float, schema: dict, shown, unit: str = "") -> None:
    unit = f" {unit}" if unit else ""
    if "minimum" in schema and not number >= schema["minimum"]:
        raise ValueError(f"kvstate.{key} must be >= {schema['minimum']}{unit}, got {shown!r:.80}")
    if "exclusiveMinimum" in schema and not number > schema["exclusiveMinimum"]:
        raise ValueError(f"kvstate.{key} must be > {schema['exclusiveMinimum']}{unit}, got {shown!r:.80}")
    if "maximum" in schema and not number <= schema["maximum"]:
        raise ValueError(f"kvstate.{key} must be <= {schema['maximum']}{unit}, got {shown!r:.80}")
    if "exclusiveMaximum" in schema and not number < schema["exclusiveMaximum"]:
        raise ValueError(f"kvstate.{key} must be < {schema['exclusiveMaximum']}{unit}, got {shown!r:.80}")


def parse(key: str, value, schema: dict | None = None) -> float | None:
    """``value`` of the formatted setting ``key`` in base units (bytes, seconds, bytes/s).

    The key's schema entry names the format and bounds the result. None is returned
    only for a key whose schema allows null. ValueError names the key.

    Examples
    --------
    >>> parse("worker.host-bytes", "1 KiB"), parse("transport.timeout", "250ms")
    (1024, 0.25)
    >>> parse("scheduling.interval", "0s")
    Traceback (most recent call last):
    ...
    ValueError: kvstate.scheduling.interval must be > 0 s, got '0s'
    """
    schema = _schema_of(key) if schema is None else schema
    assert "format" in schema, f"kvstate.{key} has no format in kvstate-schema.yaml"
    parser, like, unit = _FORMATS[schema["format"]]
    nullable = "null" in _types(schema)
    if value is None and nullable:
        return None
    try:
        n = None if isinstance(value, bool) else parser(value)
        if n is not None and not math.isfinite(n):  # an int too large for a float overflows here
            n = None
    except _PARSE_ERRORS:
        n = None
    if n is None:
        raise ValueError(f"kvstate.{key} must be {like}{' or null' if nullable else ''}, got {value!r:.80}")
    _check_range(key, n, schema, value, unit)
    return n


def _number(key: str, value) -> float:
    n = parse(key, get(key) if value is None else value)
    if n is None:
        raise ValueError(f"kvstate.{key} is null, which this reader cannot use")
    return n


def get_bytes(key: str, value=None) -> int:
    """``value`` (None: the setting ``key``) as a byte count, checked; ValueError names ``key``.

    >>> get_bytes("worker.device-bytes", "1KiB")
    1024
    """
    return int(_number(key, value))


def get_seconds(key: str, value=None) -> float:
    """``value`` (None: the setting ``key``) in seconds, checked; ValueError names ``key``.

    For plugin arguments that override a setting, pass the argument as ``value``. The
    bounds are the key's schema entry (``exclusiveMinimum: 0``: must be positive).

    Examples
    --------
    >>> with dask.config.set({"kvstate.transport.connect-timeout": "250ms"}):
    ...     get_seconds("transport.connect-timeout")
    0.25
    >>> get_seconds("scheduling.batch-window", "soon")
    Traceback (most recent call last):
    ...
    ValueError: kvstate.scheduling.batch-window must be a duration like '200ms', got 'soon'
    """
    return float(_number(key, value))


def get_bandwidth(key: str, value=None) -> float | None:
    """``value`` (None: the setting ``key``) in bytes per second; None where the setting is null.

    Examples
    --------
    >>> get_bandwidth("transport.emulated-bandwidth") is None
    True
    >>> get_bandwidth("transport.emulated-bandwidth", "8 Mbit/s")
    1000000.0
    """
    return parse(key, get(key) if value is None else value)


# -- checking a whole kvstate config ----------------------------------------------------
# Dask validates no config, and jsonschema is not a dependency of distributed, so the
# few schema keywords kvstate-schema.yaml uses are checked here by hand, plus the
# custom ``format`` keyword that parses byte sizes, durations and bandwidths.
_JSON_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, (list, tuple)),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
}


def _check_node(value, schema: dict, path: str) -> None:
    types = _types(schema)
    if types and not any(_JSON_TYPES[t](value) for t in types):
        raise ValueError(f"kvstate.{path} must be of type {' or '.join(types)}, got {value!r:.80}")
    if "enum" in schema and value not in schema["enum"]:
        raise ValueError(f"kvstate.{path} must be one of {schema['enum']}, got {value!r:.80}")
    if "format" in schema:
        parse(path, value, schema)  # bounds apply to the parsed value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_range(path, value, schema, value)
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

    Checks what ``kvstate-schema.yaml`` says (types, ranges, choices, no unknown keys,
    byte sizes, durations and bandwidths that parse and lie in range), so a typo in a
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


def differences(own: dict, carried: dict, path: str = "") -> list[tuple[str, Any, Any]]:
    """``(key, own value, carried value)`` for every setting two ``kvstate`` configs give differently.

    Keys compare as the schema spells them (``block_tokens``, as an environment variable
    gives it, is ``block-tokens``), and a formatted setting counts as the same when both
    values parse to the same number (``"1GiB"`` and ``1073741824``).

    Examples
    --------
    >>> differences({"block_tokens": 16, "vllm": {"kv-cache-bytes": "1GiB"}},
    ...             {"block-tokens": 16, "vllm": {"kv-cache-bytes": "2 GiB"}})
    [('vllm.kv-cache-bytes', '1GiB', '2 GiB')]
    >>> differences({"worker": {"host-bytes": "1 KiB"}}, {"worker": {"host-bytes": 1024}})
    []
    """
    own, carried = _spelled(own), _spelled(carried)
    found = []
    for key in sorted(set(own) | set(carried)):
        name = f"{path}{'.' if path else ''}{key}"
        mine, theirs = own.get(key), carried.get(key)
        if isinstance(mine, dict) and isinstance(theirs, dict):
            found += differences(mine, theirs, name)
        elif mine != theirs and not _same_number(name, mine, theirs):
            found.append((name, mine, theirs))
    return found


def overridden(own: dict, carried: dict) -> list[tuple[str, Any, Any]]:
    """The settings this process was given (unlike the defaults) that ``carried`` replaces.

    Why: ``kvs.install`` carries the client's ``kvstate`` config to every worker, and
    the worker runs under it, so a setting made only where the workers start (around
    ``LocalCluster(...)``, a ``DASK_KVSTATE__...`` variable on their hosts) is replaced
    by the client's, usually its default. The worker plugin logs each one.
    """
    given = {key for key, _, _ in differences(_defaults["kvstate"], own)}
    return [d for d in differences(own, carried) if d[0] in given]


def _spelled(cfg: dict) -> dict:
    return {str(k).replace("_", "-"): v for k, v in cfg.items()}


def _same_number(key: str, a, b) -> bool:
    try:
        schema = _schema_of(key)
        return "format" in schema and parse(key, a, schema) == parse(key, b, schema)
    except (KeyError, ValueError, TypeError):  # a user-named key, or a value that does not parse
        return False
