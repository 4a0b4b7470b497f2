"""Property-based fuzzing of everything that parses outside input: state descriptors
(Arrow), spill block files, and config values. Only clear ValueError/TypeError, never
another exception, a hang or a silent acceptance. Each test counts its cases.
"""

from __future__ import annotations

import json
import math
import struct

import dask
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_kvstate import config
from dask_kvstate.plugins.worker import disk_format
from dask_kvstate.plugins.worker.plugin import KVStateWorkerPlugin
from dask_kvstate.state import ARROW_SCHEMA, KVStateRef

from .test_state import realistic_ref


def fast(n: int) -> settings:
    """``n`` cases, reproducible (derandomized), no deadline (a loaded CI machine is slow), no database."""
    return settings(
        max_examples=n, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )


# -- KVStateRef.from_arrow -------------------------------------------------------------
BASE = realistic_ref(num_tokens=100, text_chars=400)
BASE_ROW = BASE.to_arrow().to_pylist()[0]


def _value_for(arrow_type) -> st.SearchStrategy:
    """Any value of ``arrow_type`` (including null and edge cases), not only valid ones."""
    if arrow_type == pa.string():
        return st.none() | st.text(max_size=40) | st.sampled_from(["", "materialize", "fork", "device", "disk", "x"])
    if arrow_type == pa.int32():
        return st.none() | st.integers(-(2**31), 2**31 - 1)
    if arrow_type == pa.int64():
        return st.none() | st.integers(-(2**63), 2**63 - 1) | st.integers(-3, 300)
    if arrow_type == pa.binary():
        return st.none() | st.binary(max_size=64)
    if pa.types.is_list(arrow_type):
        return st.none() | st.lists(
            st.none() | _value_for(arrow_type.value_type).filter(lambda v: v is not None), max_size=12
        )
    if pa.types.is_fixed_size_binary(arrow_type):
        return st.binary(min_size=arrow_type.byte_width, max_size=arrow_type.byte_width)
    raise AssertionError(arrow_type)


# Each column replaced or kept, independently (fixed_dictionaries' optional keys: much
# cheaper to generate than a flatmap over a chosen set of columns).
row_edits = st.fixed_dictionaries({}, optional={f.name: _value_for(f.type) for f in ARROW_SCHEMA})

foreign_tables = st.dictionaries(
    st.sampled_from([*ARROW_SCHEMA.names, "extra", "x"]),
    st.lists(
        st.one_of(st.integers(-5, 5), st.text(max_size=5), st.binary(max_size=5), st.none()), min_size=0, max_size=2
    ).map(lambda xs: [x for x in xs if isinstance(x, type(xs[0]))] if xs else xs),
    max_size=len(ARROW_SCHEMA.names) + 2,
)


def _check_descriptor(batch) -> None:
    try:
        ref = KVStateRef.from_arrow(batch)
    except ValueError:
        return
    # Accepted: then it is a valid descriptor that round-trips exactly.
    assert isinstance(ref, KVStateRef)
    assert KVStateRef.from_arrow(ref.to_arrow()) == ref
    assert len(ref.blocks) == math.ceil(ref.num_tokens / ref.block_tokens)


def test_fuzz_from_arrow():
    cases = 0

    @fast(3000)
    @given(row_edits)
    def edited(edits):
        nonlocal cases
        cases += 1
        batch = pa.RecordBatch.from_pylist([{**BASE_ROW, **edits}], schema=ARROW_SCHEMA)
        _check_descriptor(batch)

    @fast(1000)
    @given(foreign_tables, st.booleans())
    def foreign(columns, as_table):
        nonlocal cases
        cases += 1
        try:
            table = pa.table(columns) if as_table else pa.RecordBatch.from_pydict(columns)
        except (pa.ArrowException, ValueError, TypeError):
            return  # not even an Arrow table
        _check_descriptor(table)

    edited()
    foreign()
    print(f"from_arrow: {cases} cases")
    assert cases >= 4000, cases


# -- spill block files (KVB1 header + CRC-32) ------------------------------------------
def _file(tensor) -> bytes:
    return b"".join(bytes(f) for f in disk_format.encode(tensor))


def _with_header(header: dict, payload: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return b"KVB1" + struct.pack("<I", len(raw)) + raw + payload


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
header_edits = st.dictionaries(
    st.sampled_from(["dtype", "shape", "nbytes", "crc32", "extra"]),
    json_values
    | st.sampled_from(["float32", "bfloat16", "Tensor", "__class__", "int8", "complex64"])
    | st.lists(st.integers(-4, 70), max_size=5),
    min_size=1,
    max_size=3,
)


def _check_block(buf) -> None:
    try:
        t = disk_format.decode(buf)
    except disk_format.CorruptBlockError as e:
        assert isinstance(e, ValueError)
        return
    # Accepted: a tensor made of exactly the checked payload at the end of the file.
    assert isinstance(t, torch.Tensor)
    n = t.nelement() * t.element_size()
    assert n == 0 or bytes(t.reshape(-1).view(torch.uint8).numpy()) == bytes(buf)[-n:]


def test_fuzz_block_files():
    cases = 0
    good = _file(torch.randn(2, 2, 1, 4, 3))

    @fast(1500)
    @given(st.binary(max_size=300) | st.binary(max_size=40).map(lambda b: b"KVB1" + b))
    def random_bytes(buf):
        nonlocal cases
        cases += 1
        _check_block(bytearray(buf))

    @fast(1500)
    @given(st.integers(0, len(good) - 1), st.integers(1, 255), st.integers(0, len(good)))
    def damaged(pos, xor, cut):
        nonlocal cases
        cases += 1
        buf = bytearray(good)
        buf[pos] ^= xor
        _check_block(buf)  # a flipped byte
        _check_block(bytearray(good[:cut]))  # a truncated file

    @fast(1500)
    @given(header_edits, st.binary(max_size=96))
    def headers(edits, payload):
        nonlocal cases
        cases += 1
        import zlib

        header = {
            "dtype": "float32",
            "shape": [len(payload) // 4],
            "nbytes": len(payload),
            "crc32": zlib.crc32(payload),
        }
        _check_block(bytearray(_with_header({**header, **edits}, payload)))

    random_bytes()
    damaged()
    headers()
    print(f"block files: {cases} cases")
    assert cases >= 4500, cases


# -- config values ---------------------------------------------------------------------
def _leaves(schema: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in schema.get("properties", {}).items():
        out += _leaves(v, f"{prefix}{k}.") if v.get("type") == "object" else [f"{prefix}{k}"]
    return out


SCHEMA = config._schema()
LEAVES = _leaves(SCHEMA)
config_values = (
    st.none()
    | st.booleans()
    | st.integers(-5, 2**40)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "4GiB",
            "1 KiB",
            "-1GiB",
            "5s",
            "250ms",
            "-2s",
            "100 Mbit/s",
            "0 MB/s",
            "auto",
            "pull",
            "recompute",
            "nope",
            "inf",
            "nan",
            "1e400",
        ]
    )
    | st.lists(st.integers(-2, 300) | st.text(max_size=3), max_size=3)
)


def _canonical(d):
    return {k.replace("_", "-"): _canonical(v) for k, v in d.items()} if isinstance(d, dict) else d


def test_fuzz_config_values():
    jsonschema = pytest.importorskip("jsonschema")
    full_schema = {"type": "object", "properties": {"kvstate": SCHEMA}}
    cases = {"accepted": 0, "rejected": 0}

    @fast(2000)
    @given(
        st.dictionaries(
            st.sampled_from([*LEAVES, "block_tokens", "worker.typo", "no-such-key"]),
            config_values,
            min_size=1,
            max_size=3,
        )
    )
    def prop(flat):
        with dask.config.set({f"kvstate.{k}": v for k, v in flat.items()}):  # as YAML files or env vars would
            merged = dask.config.get("kvstate")
            try:
                KVStateWorkerPlugin("tiny-llama")
            except (ValueError, TypeError) as e:
                assert "kvstate." in str(e), e  # names the key
                cases["rejected"] += 1
                return
        # Accepted: the schema agrees (no silent acceptance of a bad value).
        jsonschema.validate({"kvstate": _canonical(merged)}, full_schema)
        cases["accepted"] += 1

    prop()
    print(f"config values: {cases}")
    assert sum(cases.values()) >= 2000 and cases["accepted"] > 0 and cases["rejected"] > 0, cases
