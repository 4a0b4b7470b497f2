"""Linear layers on CPU through oneDNN, with each weight reordered once into oneDNN's layout.

Why: ``F.linear`` on CPU hands BLAS the weight as it lies on every call. A decode step
is a GEMM of a few rows against every weight of the model, bound by reading those
weights; oneDNN with the weight packed once into its blocked layout reads it faster,
and a long prefill's GEMMs run faster too. It is what vLLM's CPU backend does to its
linear layers and what inductor's freezing pass does to a frozen graph
(``torch.ops.mkldnn._reorder_linear_weight`` then ``_linear_pointwise``); transformers
has no switch for it and ``torch.compile`` would compile the whole model (a minute's
start on two cores) to get it, so it is done here by hand, layer by layer.

The packed copy sits beside the weight, not in its place: the state dict, the weight
fingerprint, a tied embedding and ``model.to`` keep seeing an ordinary ``nn.Linear``
weight, at the cost of a second copy of the linear weights in memory
(``kvstate.hf.packed-linear: false`` turns it off). Results differ from ``F.linear``'s
only in the rounding of float32 sums (the order differs), like any other GEMM kernel;
bfloat16 goes through oneDNN either way and is bitwise the same. A forward that needs
gradients, or whose input is not on the CPU in the weight's dtype, runs the stock
``nn.Linear.forward``; a weight replaced, cast, moved or written in place since it was
packed is packed again at its next forward (or, where oneDNN cannot pack it, runs stock).

Gated MLPs (``down(act(gate(x)) * up(x))`` with SiLU or GELU: Llama, Qwen, Mistral,
SmolLM, Gemma) then run as two oneDNN calls with the activation and the product fused
into the GEMMs' epilogues (:func:`fuse_gated_mlps`), so a long prefill does not write and
read back the two intermediate tensors. An MLP is fused only where its activation is one
oneDNN fuses and a check on a random input shows the fused form computes what the
module's own forward does; any other MLP keeps its own. Two task threads that find a
weight changed at once both pack it again: the same copy, attached twice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F

__all__ = ["PackedLinear", "fuse_gated_mlps", "pack", "unpack"]


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` (by class swap, see :func:`pack`) whose forward runs oneDNN on a packed weight."""

    _kvstate_packed: torch.Tensor | None  # None: oneDNN cannot pack the weight as it is now
    _kvstate_of: tuple[Any, ...]  # what the packed copy was made from (see _source)

    def packed_weight(self) -> torch.Tensor | None:
        """The packed copy of the weight, made again if the weight changed since: replaced, moved
        or cast (``model.to``, a new tensor), or written in place (``load_state_dict``, a fine-tune
        step). None where it cannot be packed (on another device, in a dtype oneDNN refuses here)."""
        w = self.weight
        if _source(w) != self._kvstate_of:
            try:
                p = _reordered(w) if w.device.type == "cpu" else None
            except RuntimeError:
                p = None
            _attach(self, p)
        return self._kvstate_packed

    def packed_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed weight if oneDNN may compute this layer on ``x``: no gradients wanted, ``x``
        on the CPU in the weight's dtype; else None (the stock forward then)."""
        if torch.is_grad_enabled() or x.dtype != self.weight.dtype or x.device.type != "cpu":
            return None
        return self.packed_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_for(x)
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")


def _reordered(w: torch.Tensor) -> torch.Tensor:
    """``w`` in oneDNN's blocked layout; raises RuntimeError for a dtype this CPU's oneDNN cannot pack."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(w.detach())


def _source(w: torch.Tensor) -> tuple[Any, ...]:
    try:
        version = w._version  # bumped by every in-place write
    except RuntimeError:  # an inference tensor keeps no version; it cannot be written outside inference mode
        version = None
    return (id(w), w.data_ptr(), w.dtype, tuple(w.shape), version)


def _attach(m: torch.nn.Linear, packed: torch.Tensor | None) -> None:
    # Plain attributes, not buffers: state_dict, .to() and the fingerprint never see them.
    object.__setattr__(m, "_kvstate_packed", packed)
    object.__setattr__(m, "_kvstate_of", _source(m.weight))


def _packable(module: torch.nn.Module) -> TypeGuard[torch.nn.Linear]:
    # Exactly nn.Linear: a subclass (a quantized or adapter layer) has a forward of its own.
    return type(module) is torch.nn.Linear and module.weight.device.type == "cpu"


def pack(model: torch.nn.Module) -> tuple[int, str | None]:
    """Pack the weight of every plain ``nn.Linear`` of ``model`` on the CPU for oneDNN.

    Returns ``(layers packed, why none were)``: the reason is None when some were, else
    what stopped it (no oneDNN in this torch, no CPU layer, a dtype oneDNN cannot pack
    on this CPU, such as float16 without AVX512-FP16), so a caller can report it rather
    than run slower silently. A layer oneDNN refuses stays as it is; packed layers too.
    """
    if not torch.backends.mkldnn.is_available():
        return 0, "this torch build has no oneDNN (mkldnn)"
    layers = [m for m in model.modules() if _packable(m)]
    if not layers:
        done = any(type(m) is PackedLinear for m in model.modules())
        return 0, "its linear layers are packed already" if done else "no nn.Linear layer on the CPU"
    packed, refused = 0, None
    for m in layers:
        try:
            p = _reordered(m.weight)
        except (RuntimeError, AttributeError) as e:  # a dtype this CPU's oneDNN cannot pack; no such op
            refused = refused or f"oneDNN cannot pack {m.weight.dtype} weights here: {e}"
            continue
        _attach(m, p)
        m.__class__ = PackedLinear
        packed += 1
    return packed, None if packed else refused


def unpack(model: torch.nn.Module) -> int:
    """Turn every :class:`PackedLinear` of ``model`` back into a plain ``nn.Linear``; returns how many."""
    for m in model.modules():
        if getattr(m, "_kvstate_fused", None):
            del m.forward, m._kvstate_fused  # the instance's fused forward: its class's shows through again
    packed = [m for m in model.modules() if type(m) is PackedLinear]
    for m in packed:
        del m._kvstate_packed, m._kvstate_of
        m.__class__ = torch.nn.Linear  # type: ignore[assignment]  # the swap pack made, undone
    return len(packed)


#: oneDNN epilogues for an MLP's activation, as (attr, algorithm) of ``_linear_pointwise``,
#: with the torch function each computes: SiLU (Llama, Qwen, Mistral, SmolLM), GELU with
#: the tanh approximation (Gemma), exact GELU.
_ACTIVATIONS: dict[tuple[str, str], Callable[[torch.Tensor], torch.Tensor]] = {
    ("swish", ""): F.silu,
    ("gelu", "tanh"): functools.partial(F.gelu, approximate="tanh"),
    ("gelu", "none"): F.gelu,
}


def _epilogue_of(act: Any) -> tuple[str, str] | None:
    """The epilogue computing what ``act`` does, told apart where the activations differ (|x| up
    to 8); None for none of them, or no ``act`` at all."""
    if not callable(act):
        return None
    z = torch.linspace(-8, 8, 4001)
    with torch.inference_mode():
        got = act(z)
        for epilogue, fn in _ACTIVATIONS.items():
            if torch.allclose(got, fn(z), rtol=1e-6, atol=1e-6):
                return epilogue
    return None


def _fused_gated_forward(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    # Any: the MLP is whatever class the model defines, its projections found by name.
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    pg, pu = gate.packed_for(x), up.packed_for(x)
    if pg is None or pu is None:
        return type(mlp).forward(mlp, x)
    attr, algorithm = mlp._kvstate_fused
    # The activation fused into the gate GEMM, the product into the up GEMM.
    h = torch.ops.mkldnn._linear_pointwise(x, pg, gate.bias, attr, [], algorithm)
    h = torch.ops.mkldnn._linear_pointwise.binary(x, h, pu, up.bias, "mul")
    return down(h)


def fuse_gated_mlps(model: torch.nn.Module) -> int:
    """Run every gated MLP of ``model`` whose three projections are packed as two fused oneDNN calls.

    A module qualifies by shape (packed ``gate_proj``, ``up_proj``, ``down_proj`` and an
    ``act_fn``), then by behaviour: its ``act_fn`` must compute one of the activations
    oneDNN fuses (checked on a grid where they differ), and its own forward and the fused
    one must agree on a random input, so a module that names its layers alike but
    computes something else (the product's order swapped, an extra scale) keeps its own
    forward. Returns how many were fused; :func:`unpack` undoes it.
    """
    fused = 0
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        layers = [getattr(m, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if not all(type(layer) is PackedLinear for layer in layers) or getattr(m, "_kvstate_fused", None):
            continue
        gate: Any = layers[0]
        epilogue = _epilogue_of(getattr(m, "act_fn", None))
        if epilogue is None:
            continue
        tol = 1e-4 if gate.weight.dtype == torch.float32 else 2e-2
        object.__setattr__(m, "_kvstate_fused", epilogue)
        with torch.inference_mode():
            # Scaled so the activation's inputs spread over where it bends, not only near 0.
            x = torch.randn(2, 3, gate.in_features, generator=gen).to(gate.weight.dtype)
            x = x * (2.0 / gate(x).float().std().clamp_min(1e-6)).to(x.dtype)
            own, ours = type(m).forward(m, x).float(), _fused_gated_forward(m, x).float()
        if ours.shape == own.shape and torch.allclose(own, ours, rtol=tol, atol=tol * float(own.abs().max())):
            object.__setattr__(m, "forward", _fused_gated_forward.__get__(m))
            fused += 1
        else:
            object.__delattr__(m, "_kvstate_fused")
    return fused
