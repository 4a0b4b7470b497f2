"""kvstate.yaml and kvstate-schema.yaml describe the same keys (distributed's test_schema, both ways),
and the schema's ``format`` keyword is what validates byte sizes, durations and bandwidths."""

from __future__ import annotations

import dask
import dask.utils
import pytest
import yaml

from dask_kvstate import config


def _load(path):
    with open(path) as f:
        return yaml.safe_load(f)


DEFAULTS = _load(config.DEFAULTS_FILE)
SCHEMA = _load(config.SCHEMA_FILE)


def _schema_leaves(node: dict, prefix: str = "") -> dict[str, dict]:
    """dotted key -> schema entry, for every entry that holds a value (a mapping of user names is one value)."""
    if "properties" not in node:
        return {prefix.rstrip("."): node}
    out = {}
    for k, sub in node["properties"].items():
        out.update(_schema_leaves(sub, f"{prefix}{k}."))
    return out


def _default_leaves(node, schema: dict, prefix: str = "") -> dict:
    """dotted key -> default, descending only where the schema has named properties."""
    if not isinstance(node, dict) or "properties" not in schema:
        return {prefix.rstrip("."): node}
    out = {}
    for k, v in node.items():
        out.update(_default_leaves(v, schema["properties"].get(k, {}), f"{prefix}{k}."))
    return out


SCHEMA_LEAVES = _schema_leaves(SCHEMA["properties"]["kvstate"])
DEFAULT_LEAVES = _default_leaves(DEFAULTS["kvstate"], SCHEMA["properties"]["kvstate"])
FORMATTED = {k: s["format"] for k, s in SCHEMA_LEAVES.items() if "format" in s}


def test_defaults_match_schema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(DEFAULTS, SCHEMA)


def test_every_default_key_has_a_schema_entry():
    missing = sorted(set(DEFAULT_LEAVES) - set(SCHEMA_LEAVES))
    assert not missing, f"defaults in kvstate.yaml with no entry in kvstate-schema.yaml: {missing}"


def test_every_schema_entry_has_a_default():
    missing = sorted(set(SCHEMA_LEAVES) - set(DEFAULT_LEAVES))
    assert not missing, f"entries in kvstate-schema.yaml with no default in kvstate.yaml: {missing}"


def test_every_schema_entry_is_typed():
    for key, entry in SCHEMA_LEAVES.items():
        assert "type" in entry or "enum" in entry, f"kvstate.{key} has no type in the schema"


def _parses(fmt: str, value) -> bool:
    parse = {
        "bytes": dask.utils.parse_bytes,
        "duration": lambda v: dask.utils.parse_timedelta(v, default="seconds"),
    }[fmt]
    try:
        parse(value)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return False
    return True


def test_every_byte_size_or_duration_default_has_a_format():
    """A default written as ``256MiB`` or ``5s`` is validated by check only through its format."""
    for key, value in DEFAULT_LEAVES.items():
        if not isinstance(value, str):
            continue
        for fmt in ("bytes", "duration"):
            if _parses(fmt, value):
                assert FORMATTED.get(key) == fmt, (
                    f"kvstate.{key}: {value!r} is a {fmt} but its schema has no format: {fmt}"
                )


def test_formatted_defaults_parse():
    assert {"bytes", "duration", "bandwidth"} <= set(FORMATTED.values())
    for key, fmt in FORMATTED.items():
        value = config.parse(key, DEFAULT_LEAVES[key])
        assert value is None or value >= 0, (key, value)


@pytest.mark.parametrize("key", sorted(FORMATTED))
def test_a_bad_formatted_value_is_rejected_naming_the_key(key):
    fmt = FORMATTED[key]
    like = {"bytes": "a byte size", "duration": "a duration", "bandwidth": "a rate"}[fmt]
    *parents, leaf = key.split(".")
    cfg: dict = {leaf: "lots"}
    for p in reversed(parents):
        cfg = {p: cfg}
    with pytest.raises(ValueError, match=rf"^kvstate\.{key} must be {like} like "):
        config.check(cfg)
    getter = {"bytes": config.get_bytes, "duration": config.get_seconds, "bandwidth": config.get_bandwidth}[fmt]
    with pytest.raises(ValueError, match=rf"^kvstate\.{key} must be {like} like "):
        getter(key, "lots")
    with dask.config.set({f"kvstate.{key}": "lots"}), pytest.raises(ValueError, match=rf"^kvstate\.{key} must be "):
        getter(key)


@pytest.mark.parametrize(
    "key", sorted(k for k, s in SCHEMA_LEAVES.items() if "format" in s and ("minimum" in s or "exclusiveMinimum" in s))
)
def test_an_out_of_range_formatted_value_is_rejected_naming_the_key(key):
    bad = {"bytes": "-1KiB", "duration": -1, "bandwidth": "0 MB/s"}[FORMATTED[key]]
    *parents, leaf = key.split(".")
    cfg: dict = {leaf: bad}
    for p in reversed(parents):
        cfg = {p: cfg}
    with pytest.raises(ValueError, match=rf"^kvstate\.{key} must be >=? 0 "):
        config.check(cfg)


def test_positive_durations_reject_zero_and_allow_what_the_schema_allows():
    with pytest.raises(ValueError, match=r"kvstate.scheduling.interval must be > 0 s, got '0s'"):
        config.get_seconds("scheduling.interval", "0s")
    assert config.get_seconds("scheduling.batch-window", "0s") == 0.0  # minimum: 0
    assert config.get_seconds("scheduling.stealing.beta", -0.001) == -0.001  # no bound


def test_env_style_underscores_reach_the_format_check():
    # DASK_KVSTATE__TRANSPORT__PACKING_BYTES=lots arrives as packing_bytes
    with pytest.raises(ValueError, match=r"kvstate.transport.packing-bytes must be a byte size"):
        config.check({"transport": {"packing_bytes": "lots"}})
    config.check({"transport": {"packing_bytes": "64MiB", "emulated_bandwidth": None}})


def test_unknown_keys_are_rejected():
    with pytest.raises(ValueError, match=r"unknown config key kvstate.transport.packing"):
        config.check({"transport": {"packing": 1}})


def test_get_has_no_fallback():
    with pytest.raises(KeyError):
        config.get("no-such-key")


def test_settings_given_only_to_the_workers_and_replaced_by_the_clients_are_named():
    own = {"block-tokens": 64, "vllm": {"kv-cache-bytes": "1GiB", "max-model-len": None}}
    carried = {"block-tokens": 16, "vllm": {"kv-cache-bytes": "2 GiB", "max-model-len": None}}
    # the worker's block-tokens is the default: the client's 16 is a choice, not a setting lost
    assert config.overridden(own, carried) == [("vllm.kv-cache-bytes", "1GiB", "2 GiB")]
    assert config.overridden(own, {**carried, "vllm": {"kv-cache-bytes": 2**30}}) == []


#: warnings of the ``dask_kvstate`` logger in the process that ran ``_collect_warnings``
_LOGGED: list[str] = []


def _collect_warnings():
    import logging

    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: _LOGGED.append(record.getMessage())
    logging.getLogger("dask_kvstate").addHandler(handler)


def _warnings() -> list[str]:
    return list(_LOGGED)


def test_a_worker_names_a_setting_of_its_own_that_the_clients_config_replaces():
    # Set around the cluster's start only: the worker processes have it, the client's
    # config at kvs.install does not, and the worker runs under the client's.
    from distributed import Client, LocalCluster

    import dask_kvstate as kvs

    with dask.config.set({"kvstate.vllm.kv-cache-bytes": "1GiB"}):
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0")
    with cluster, Client(cluster) as client:
        client.run(_collect_warnings)
        kvs.install(client, "tiny-llama", torch_threads=1)
        (logged,) = client.run(_warnings).values()
    assert [m for m in logged if "kv-cache-bytes" in m] == [
        "kvstate.vllm.kv-cache-bytes: '1GiB' in this worker's config, '2 GiB' in the client's, which "
        "kvs.install carried here and the worker runs under; set it in the client's config before kvs.install"
    ]
