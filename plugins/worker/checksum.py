"""End-to-end checksums of a block pull: a frame damaged on the way is a recompute, never wrong KV.

A block's hash names its tokens, not its bytes: nothing else tells a puller that the
bytes under a correct hash are wrong (a bit flipped on a link or in a NIC, a reply
buffer written over before it left). With ``kvstate.transport.checksum`` the holder
adds the CRC-32 of every frame it sends (:func:`sign`, the reply's ``crc``: one
integer per frame, in the message, a few bytes); the puller checks every frame of a
signed reply before reading it (:func:`verify`), and a mismatch is a failed pull,
which the caller recomputes. CRC-32 because it is what the disk format uses, catches
every burst of up to 32 flipped bits and runs at memory-copy speed in zlib (64 MiB in
about 9 ms on one core here); it is a corruption check, not a signature.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence


class ChecksumError(ValueError):
    """A received frame does not match the CRC-32 its holder sent with it."""


def _raw(frame):
    """The buffer of a frame: the object inside a holder's ``to_serialize``, else the frame."""
    from distributed.protocol.serialize import Serialize

    return frame.data if isinstance(frame, Serialize) else frame


def crc(frame) -> int:
    """CRC-32 of one frame's bytes (any C-contiguous buffer).

    >>> import numpy as np
    >>> crc(b"kv") == crc(np.frombuffer(b"kv", dtype=np.uint8)) == crc(bytearray(b"kv"))
    True
    """
    return zlib.crc32(_raw(frame))


def nbytes(frames: Sequence) -> int:
    """Bytes of ``frames`` together."""
    return sum(memoryview(_raw(f)).nbytes for f in frames)


def sign(reply: dict) -> dict:
    """``reply`` with the CRC-32 of each of its frames as ``crc``."""
    return {**reply, "crc": [crc(f) for f in reply.get("frames", ())]}


def verify(reply: dict) -> None:
    """Raise :class:`ChecksumError` unless every frame of a signed ``reply`` matches its CRC-32.

    An unsigned reply (no ``crc``: the holder runs with checksums off) passes unchecked.

    Examples
    --------
    >>> reply = sign({"frames": [b"block bytes"]})
    >>> verify(reply)
    >>> try:
    ...     verify({**reply, "frames": [b"block bytez"]})
    ... except ChecksumError as e:
    ...     print(e)
    frame 0 of 1 (11 bytes) fails its CRC-32 check: corrupted on the way
    """
    sums = reply.get("crc")
    if sums is None:
        return
    frames = reply.get("frames") or ()
    if not isinstance(sums, (list, tuple)) or len(sums) != len(frames):
        raise ChecksumError(f"peer sent {len(frames)} frames with checksums {sums!r:.200}")
    for i, (frame, want) in enumerate(zip(frames, sums)):
        if crc(frame) != want:
            raise ChecksumError(
                f"frame {i} of {len(frames)} ({nbytes([frame])} bytes) fails its CRC-32 check: corrupted on the way"
            )
