"""Picking the next token: one rule for single and batched decoding on an in-process model.

A module of its own so that the single-row loop (:mod:`~dask_kvstate.backends.hf`) and the
batched one (:mod:`~dask_kvstate.backends.batch`) share it without importing each other.
"""

from __future__ import annotations

import secrets

import torch


def generator(device, temperature: float, seed: int | None) -> torch.Generator | None:
    """The sampler's random generator (seeded with ``seed``, or a fresh seed); None when greedy.

    A fresh seed comes from the OS (``secrets``), not ``torch.seed()``, which would
    reseed torch's global generator under every other user of it in the process.

    >>> generator("cpu", 0.0, 1) is None, generator("cpu", 0.7, 1).initial_seed()
    (True, 1)
    """
    if temperature <= 0:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) if seed is not None else secrets.randbits(63))
    return gen


def pick_token(logits: torch.Tensor, temperature: float, top_p: float, gen) -> int:
    """The next token from one row of ``logits``: greedy at temperature 0, else sampled
    (nucleus ``top_p``) with generator ``gen``; shared by single and batched decoding.

    >>> pick_token(torch.tensor([0.1, 2.0, 0.3]), 0.0, 1.0, None)
    1
    """
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
