"""The KV state descriptor: what a Dask task returns in place of KV tensors.

AAFLOW+ writes a state as S = (M, Θ, B, Π, Λ, Γ). :class:`KVStateRef` carries exactly
that, as metadata only: model fingerprint M (``model``), config fingerprint Θ
(``config``: architecture, layers, kv heads, head dim, rope, dtype, tokenizer), block
table B (``blocks``, the hash chain), positions Π (``num_tokens`` and ``text``, whose
tokenization is the state's token ids), lineage Λ and placement Γ. The tensors stay
in the block store of the worker named in ``placement``; a consumer elsewhere pulls
them or recomputes them from ``text``.

Why the text and not the token ids: a state is defined as "the prefill of
tokenize(text)". Extending a state re-tokenizes the joined text and keeps the longest
common token prefix, so a prefix that ends mid-word is handled exactly and output is
token-identical to text replay by construction. The text also lets a worker running a
different model recompute instead of failing. It travels zlib-compressed.

Refs are immutable: fork, extend, transfer and merge make new refs, sharing blocks.
"""

from __future__ import annotations

import uuid
import zlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import pyarrow as pa
from dask.sizeof import sizeof

from dask_kvstate.blocks import HASH_BYTES, BlockKV, num_blocks

if TYPE_CHECKING:  # for annotations only: this module never imports torch
    import torch

#: Operators that can produce a state (lineage ``op``).
LINEAGE_OPS = ("materialize", "fork", "extend", "transfer", "merge")
#: Where a state's blocks live on their holder.
TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class Lineage:
    """How a state came to be: the operator and the ids of its parent states."""

    op: str
    parents: tuple[str, ...] = ()


@dataclass(frozen=True)
class Placement:
    """Which worker holds the state's blocks, and in which tier."""

    worker: str | None
    tier: str = "device"


def new_state_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class KVStateRef:
    """Metadata of one immutable KV state; a few hundred bytes, never tensors.

    Construct through the operators (``kvs.materialize`` and friends); building one by
    hand is for tests and tools. Invalid fields raise ``ValueError`` naming the field.
    """

    state_id: str
    model_name: str
    model: str
    config: str
    namespace: str
    block_tokens: int
    num_tokens: int
    blocks: tuple[bytes, ...]
    text: str
    nbytes: int
    lineage: Lineage
    placement: Placement = field(default_factory=lambda: Placement(None))

    def __post_init__(self) -> None:
        _validate(self)

    # -- derived -----------------------------------------------------------------
    def derive(self, op: str, **changes) -> KVStateRef:
        """A new state (new id) with ``self`` as parent; ``changes`` replace fields."""
        return replace(
            self,
            state_id=new_state_id(),
            lineage=Lineage(op, (self.state_id,)),
            **changes,
        )

    def __repr__(self) -> str:
        where = self.placement.worker or "nowhere"
        return (
            f"<KVStateRef {self.state_id[:8]} {self.lineage.op} {self.num_tokens} tokens, "
            f"{len(self.blocks)} blocks, {self.nbytes / 2**20:.1f} MiB on {where}>"
        )

    # -- wire format -------------------------------------------------------------
    def __reduce__(self):
        # Pickled refs travel with every task that consumes a state: compress the text
        # (the only field that grows with context length besides 16 bytes per block).
        return (_unpack, (_pack(self),))

    def to_row(self) -> tuple:
        """This descriptor as one row of plain values (str, int, bytes, lists; the text
        zlib-compressed): what its pickle carries, and what a msgpack message can hold.

        Examples
        --------
        >>> ref = example_ref()
        >>> KVStateRef.from_row(ref.to_row()) == ref
        True
        """
        return _pack(self)

    @classmethod
    def from_row(cls, row) -> KVStateRef:
        """Rebuild a descriptor from :meth:`to_row` output (lists may come back as tuples).

        Raises ``ValueError`` for anything malformed, like :meth:`from_arrow`.

        Examples
        --------
        >>> KVStateRef.from_row(["too short"])
        Traceback (most recent call last):
        ...
        ValueError: malformed KV state descriptor: not enough values to unpack (expected 14, got 1)
        """
        if not isinstance(row, (list, tuple)):
            raise ValueError(f"malformed KV state descriptor: expected a row (list or tuple), got {type(row).__name__}")
        return _unpack(tuple(row))

    def to_arrow(self) -> pa.RecordBatch:
        """This descriptor as a one-row Arrow record batch.

        Examples
        --------
        >>> ref = example_ref()
        >>> KVStateRef.from_arrow(ref.to_arrow()) == ref
        True
        """
        row = _pack(self)
        return pa.RecordBatch.from_pylist([dict(zip(ARROW_SCHEMA.names, row))], schema=ARROW_SCHEMA)

    @classmethod
    def from_arrow(cls, batch: pa.RecordBatch | pa.Table) -> KVStateRef:
        """Rebuild a descriptor from :meth:`to_arrow` output.

        Raises ``ValueError`` for anything malformed (wrong row count, missing or
        mistyped column, corrupted text, inconsistent block table); never crashes.

        Examples
        --------
        >>> import pyarrow as pa
        >>> KVStateRef.from_arrow(pa.table({"state_id": ["x"]}))
        Traceback (most recent call last):
        ...
        ValueError: malformed KV state descriptor: missing column(s) model_name, ...
        """
        if not isinstance(batch, (pa.RecordBatch, pa.Table)):
            raise ValueError(
                f"malformed KV state descriptor: expected a pyarrow RecordBatch or Table, got {type(batch).__name__}"
            )
        missing = [n for n in ARROW_SCHEMA.names if n not in batch.schema.names]
        if missing:
            shown = ", ".join(missing[:1]) + (", ..." if len(missing) > 1 else "")
            raise ValueError(f"malformed KV state descriptor: missing column(s) {shown}")
        if batch.num_rows != 1:
            raise ValueError(f"malformed KV state descriptor: expected 1 row, got {batch.num_rows}")
        batch = batch.select(ARROW_SCHEMA.names)
        for f in ARROW_SCHEMA:
            got = batch.schema.field(f.name).type
            if got != f.type:
                raise ValueError(f"malformed KV state descriptor: column {f.name} is {got}, expected {f.type}")
        row = [batch.column(i)[0].as_py() for i in range(batch.num_columns)]
        return _unpack(tuple(row))


@dataclass(frozen=True)
class KVState:
    """A state resolved on a worker: its descriptor with its token ids and KV tensor.

    What ``StateRuntime.resolve`` hands to an operator. ``kv`` is one tensor
    ``[layers, 2, kv_heads, tokens, head_dim]`` assembled from the blocks (local hits,
    pulled, or recomputed), or None when the ref cannot be used on this worker
    (another model, config or tokenizer): then the operator prefills ``token_ids``.
    Resolved with ``joined=False``, ``kv`` is the blocks unjoined (a
    :class:`~dask_kvstate.blocks.BlockKV`). Never leaves the worker; tasks return
    :class:`KVStateRef`.
    """

    ref: KVStateRef
    token_ids: list[int]
    kv: torch.Tensor | BlockKV | None

    @property
    def usable(self) -> bool:
        return self.kv is not None


def refs_in(value) -> list[KVStateRef]:
    """The refs a task result holds: a ref, or a list/tuple of refs (fork).

    Examples
    --------
    >>> ref = example_ref()
    >>> refs_in(ref) == [ref], refs_in([ref, ref]) == [ref, ref], refs_in([ref, 1]), refs_in("text")
    (True, True, [], [])
    """
    if isinstance(value, KVStateRef):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, KVStateRef) for v in value):
        return list(value)
    return []


ARROW_SCHEMA = pa.schema(
    [
        ("state_id", pa.string()),
        ("model_name", pa.string()),
        ("model", pa.string()),
        ("config", pa.string()),
        ("namespace", pa.string()),
        ("block_tokens", pa.int32()),
        ("num_tokens", pa.int64()),
        ("blocks", pa.list_(pa.binary(HASH_BYTES))),
        ("text_zlib", pa.binary()),
        ("nbytes", pa.int64()),
        ("lineage_op", pa.string()),
        ("lineage_parents", pa.list_(pa.string())),
        ("worker", pa.string()),
        ("tier", pa.string()),
    ]
)


def _pack(ref: KVStateRef) -> tuple:
    return (
        ref.state_id,
        ref.model_name,
        ref.model,
        ref.config,
        ref.namespace,
        ref.block_tokens,
        ref.num_tokens,
        list(ref.blocks),
        zlib.compress(ref.text.encode("utf-8"), 6),
        ref.nbytes,
        ref.lineage.op,
        list(ref.lineage.parents),
        ref.placement.worker,
        ref.placement.tier,
    )


def _unpack(row: tuple) -> KVStateRef:
    try:
        (
            state_id,
            model_name,
            model,
            config,
            namespace,
            block_tokens,
            num_tokens,
            blocks,
            text_zlib,
            nbytes,
            op,
            parents,
            worker,
            tier,
        ) = row
        text = zlib.decompress(text_zlib).decode("utf-8")
    except (ValueError, TypeError, zlib.error, UnicodeDecodeError) as e:
        raise ValueError(f"malformed KV state descriptor: {e}") from None
    return KVStateRef(
        state_id=state_id,
        model_name=model_name,
        model=model,
        config=config,
        namespace=namespace,
        block_tokens=block_tokens,
        num_tokens=num_tokens,
        blocks=tuple(blocks or ()),
        text=text,
        nbytes=nbytes,
        lineage=Lineage(op, tuple(parents or ())),
        placement=Placement(worker, tier),
    )


def _validate(ref: KVStateRef) -> None:
    def bad(name: str, why: str) -> ValueError:
        return ValueError(f"malformed KV state descriptor: {name} {why}")

    for name in ("state_id", "model_name", "model", "config", "namespace", "text"):
        if not isinstance(getattr(ref, name), str):
            raise bad(name, f"must be a str, got {type(getattr(ref, name)).__name__}")
    if not ref.state_id or not ref.model or not ref.config:
        raise bad("state_id/model/config", "must not be empty")
    for name in ("block_tokens", "num_tokens", "nbytes"):
        v = getattr(ref, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise bad(name, f"must be a non-negative int, got {v!r}")
    if ref.block_tokens < 1:
        raise bad("block_tokens", f"must be >= 1, got {ref.block_tokens}")
    if not isinstance(ref.blocks, tuple) or any(not isinstance(h, bytes) or len(h) != HASH_BYTES for h in ref.blocks):
        raise bad("blocks", f"must be a tuple of {HASH_BYTES}-byte hashes")
    if len(ref.blocks) != num_blocks(ref.num_tokens, ref.block_tokens):
        raise bad(
            "blocks",
            f"has {len(ref.blocks)} entries but {ref.num_tokens} tokens in blocks of "
            f"{ref.block_tokens} need {num_blocks(ref.num_tokens, ref.block_tokens)}",
        )
    if not isinstance(ref.lineage, Lineage) or ref.lineage.op not in LINEAGE_OPS:
        raise bad("lineage", f"op must be one of {LINEAGE_OPS}, got {getattr(ref.lineage, 'op', ref.lineage)!r}")
    if not all(isinstance(p, str) for p in ref.lineage.parents):
        raise bad("lineage", "parents must be state ids (str)")
    if not isinstance(ref.placement, Placement) or ref.placement.tier not in TIERS:
        raise bad("placement", f"tier must be one of {TIERS}")
    if ref.placement.worker is not None and not isinstance(ref.placement.worker, str):
        raise bad("placement", "worker must be an address (str) or None")


def incompatibility(state: KVStateRef, *, model: str, config: str, namespace: str | None = None) -> str | None:
    """Why ``state`` cannot be reused under (model, config, namespace); None if it can.

    The first two factors of AAFLOW+ eq. 13; the positional factor is checked on the
    worker, token by token, when the state is resumed or extended.

    Examples
    --------
    >>> ref = example_ref()
    >>> incompatibility(ref, model=ref.model, config=ref.config) is None
    True
    >>> print(incompatibility(ref, model="other", config=ref.config))
    model fingerprint differs (state m-0123456789ab, worker other)
    """
    if state.model != model:
        return f"model fingerprint differs (state {state.model[:14]}, worker {model[:14]})"
    if state.config != config:
        return f"config fingerprint differs (state {state.config[:14]}, worker {config[:14]})"
    if namespace is not None and state.namespace != namespace:
        return f"namespace differs (state {state.namespace!r}, wanted {namespace!r})"
    return None


def compatible(a: KVStateRef, b: KVStateRef) -> bool:
    """AAFLOW+ eq. 13: same model, same config, and positionally compatible.

    Positions are compatible when the block tables agree on every full block of the
    shorter state (same tokens at the same positions under the same namespace).

    Examples
    --------
    >>> a = example_ref()
    >>> compatible(a, a.derive("fork"))
    True
    >>> compatible(a, replace(a, config="c-other"))
    False
    """
    if incompatibility(a, model=b.model, config=b.config, namespace=b.namespace):
        return False
    if a.block_tokens != b.block_tokens:
        return False
    full = min(a.num_tokens, b.num_tokens) // a.block_tokens
    return a.blocks[:full] == b.blocks[:full]


def example_ref(text: str = "hello world", num_tokens: int = 2) -> KVStateRef:
    """A small hand-made descriptor for docs and tests (its hashes are not real)."""
    from dask_kvstate.blocks import block_hashes, kv_identity

    blocks = block_hashes(range(num_tokens), identity=kv_identity("m", "c"), namespace="default", block_tokens=64)
    return KVStateRef(
        state_id="s-example",
        model_name="tiny-llama",
        model="m-0123456789abcdef",
        config="c-0123456789abcdef",
        namespace="default",
        block_tokens=64,
        num_tokens=num_tokens,
        blocks=blocks,
        text=text,
        nbytes=0,
        lineage=Lineage("materialize"),
        placement=Placement("tcp://127.0.0.1:1"),
    )


@sizeof.register(KVStateRef)
def _sizeof_ref(ref: KVStateRef) -> int:
    # Report the KV bytes behind the ref: Dask's placement then prefers the worker that
    # holds them, and its stealing prices moving a consumer at the cost of the blocks.
    return ref.nbytes + len(ref.text)
