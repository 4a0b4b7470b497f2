"""Every default in kvstate.yaml is described by kvstate-schema.yaml (distributed's test_schema)."""

from __future__ import annotations

import yaml

from dask_kvstate import config


def test_defaults_match_schema():
    jsonschema = __import__("pytest").importorskip("jsonschema")
    with open(config.SCHEMA_FILE) as f:
        schema = yaml.safe_load(f)
    with open(config._DEFAULTS_FILE) as f:
        defaults = yaml.safe_load(f)
    jsonschema.validate(defaults, schema)


def test_every_default_key_has_a_schema_entry():
    with open(config.SCHEMA_FILE) as f:
        schema = yaml.safe_load(f)
    with open(config._DEFAULTS_FILE) as f:
        defaults = yaml.safe_load(f)

    def walk(d, s, path):
        for k, v in d.items():
            assert k in s["properties"], f"{path}{k} has no schema entry"
            if isinstance(v, dict):
                walk(v, s["properties"][k], f"{path}{k}.")

    walk(defaults, schema, "")
