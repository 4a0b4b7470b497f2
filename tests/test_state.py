"""The state descriptor: validation, Arrow round trip, wire size, compatibility, hashes."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pyarrow as pa
import pytest
from dask.sizeof import sizeof

from dask_kvstate.blocks import block_hashes, kv_identity
from dask_kvstate.state import ARROW_SCHEMA, KVStateRef, Lineage, Placement, compatible, example_ref


def realistic_ref(num_tokens: int = 1500, text_chars: int = 6000) -> KVStateRef:
    ident = kv_identity("m-" + "a" * 32, "c-" + "b" * 32)
    words = [f"token{i % 97} " for i in range(text_chars // 8)]
    return KVStateRef(
        state_id="f" * 32,
        model_name="smollm2-135m",
        model="m-" + "a" * 32,
        config="c-" + "b" * 32,
        namespace="default",
        block_tokens=64,
        num_tokens=num_tokens,
        blocks=block_hashes(range(num_tokens), identity=ident, namespace="default", block_tokens=64),
        text="".join(words),
        nbytes=num_tokens * 46080,
        lineage=Lineage("fork", ("e" * 32,)),
        placement=Placement("tcp://10.0.0.12:40123", "device"),
    )


def test_arrow_round_trip():
    ref = realistic_ref()
    batch = ref.to_arrow()
    assert batch.schema == ARROW_SCHEMA and batch.num_rows == 1
    assert KVStateRef.from_arrow(batch) == ref
    assert KVStateRef.from_arrow(pa.Table.from_batches([batch])) == ref


def test_pickle_round_trip_and_size_under_4kib():
    ref = realistic_ref()
    wire = pickle.dumps(ref, protocol=5)
    assert pickle.loads(wire) == ref
    assert len(wire) < 4096, len(wire)


def test_sizeof_reports_the_kv_bytes_behind_the_ref():
    ref = realistic_ref()
    assert sizeof(ref) >= ref.nbytes


def _corrupt(column: str, value) -> pa.RecordBatch:
    batch = realistic_ref().to_arrow()
    cols = {n: batch.column(n) for n in batch.schema.names}
    cols[column] = pa.array([value], type=ARROW_SCHEMA.field(column).type)
    return pa.RecordBatch.from_pydict(cols, schema=ARROW_SCHEMA)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: pa.table({"state_id": ["x"]}), "missing column"),
        (lambda: pa.Table.from_batches([realistic_ref().to_arrow()] * 2), "expected 1 row"),
        (lambda: _corrupt("text_zlib", b"not zlib"), "malformed"),
        (lambda: _corrupt("blocks", [b"\x00" * 16]), "blocks has 1 entries"),
        (lambda: _corrupt("num_tokens", -5), "num_tokens must be a non-negative int"),
        (lambda: _corrupt("lineage_op", "teleport"), "lineage"),
        (lambda: _corrupt("tier", "tape"), "tier must be one of"),
        (lambda: _corrupt("model", ""), "must not be empty"),
        (lambda: realistic_ref().to_arrow().set_column(0, "state_id", pa.array([1])), "malformed"),
        (lambda: "not arrow", "expected a pyarrow"),
    ],
)
def test_malformed_descriptor_raises_valueerror(make, match):
    with pytest.raises(ValueError, match=match):
        KVStateRef.from_arrow(make())


def test_constructor_validates_fields():
    with pytest.raises(ValueError, match="blocks"):
        replace(example_ref(), blocks=(b"short",))
    with pytest.raises(ValueError, match="block_tokens"):
        replace(example_ref(), block_tokens=0)


def test_compatibility_predicate():
    a = realistic_ref()
    assert compatible(a, a.derive("fork"))
    assert not compatible(a, replace(a, model="m-other"))
    assert not compatible(a, replace(a, config="c-other"))
    shorter = replace(a, num_tokens=640, blocks=a.blocks[:10])
    assert compatible(shorter, a)  # a prefix state
    other_ns = block_hashes(range(1500), identity=kv_identity(a.model, a.config), namespace="tenant-b", block_tokens=64)
    assert not compatible(a, replace(a, namespace="tenant-b", blocks=other_ns))


def test_hash_chain_separates_models_namespaces_and_prefixes():
    ident = kv_identity("m1", "c1")
    base = block_hashes(range(40), identity=ident, namespace="ns", block_tokens=16)
    assert block_hashes(range(40), identity=ident, namespace="ns", block_tokens=16) == base
    assert block_hashes(range(40), identity=kv_identity("m2", "c1"), namespace="ns", block_tokens=16)[0] != base[0]
    assert block_hashes(range(40), identity=kv_identity("m1", "c2"), namespace="ns", block_tokens=16)[0] != base[0]
    changed_first = block_hashes([99, *range(1, 40)], identity=ident, namespace="ns", block_tokens=16)
    assert all(x != y for x, y in zip(changed_first, base))  # a change propagates down the chain


def test_namespaces_cannot_collide_through_token_bytes():
    # Without a fixed-size namespace digest, "ns" + token bytes could spell another namespace.
    ident = kv_identity("m", "c")
    a = block_hashes([1, 500, 600], identity=ident, namespace="tenantA", block_tokens=16)
    b = block_hashes([500, 600], identity=ident, namespace="tenantA\x00\x01\x00\x00\x00\x00\x00\x00", block_tokens=16)
    assert a != b
