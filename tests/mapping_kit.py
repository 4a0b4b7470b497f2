"""A conformance kit for hash -> tensor mappings, in the style of zict/tests/utils_test.py.

Every tier of the block store (and the zict parts they are made of) must behave as a
plain ``MutableMapping`` of block hashes to tensors, whatever it does underneath.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import pytest
import torch


def make_blocks(n: int, floats: int = 8) -> dict[bytes, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {f"block-{i:02d}-hash..".encode()[:16]: torch.randn(floats, generator=g) for i in range(n)}


def check_mapping(z: MutableMapping) -> None:
    """Set, get, overwrite, delete, iterate, KeyError: the MutableMapping contract."""
    blocks = make_blocks(6)
    assert len(z) == 0 and list(z) == []
    for k, v in blocks.items():
        z[k] = v
    assert len(z) == 6 and sorted(z) == sorted(blocks)
    for k, v in blocks.items():
        assert k in z
        assert torch.equal(z[k], v)
    k0 = next(iter(blocks))
    z[k0] = torch.full((8,), 7.0)  # overwrite
    assert torch.equal(z[k0], torch.full((8,), 7.0)) and len(z) == 6
    del z[k0]
    assert k0 not in z and len(z) == 5
    with pytest.raises(KeyError):
        z[k0]
    with pytest.raises(KeyError):
        del z[k0]
    assert z.get(k0) is None
    assert sorted(k for k, _ in z.items()) == sorted(list(blocks)[1:])
    z.update({k0: blocks[k0]})
    assert torch.equal(z[k0], blocks[k0])
    z.clear()
    assert len(z) == 0 and b"never-there-hash" not in z
