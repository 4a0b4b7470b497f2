"""Command-line flags generated from an experiment's ``Options`` dataclass.

An experiment declares each setting once, as a field of its ``Options`` (type, default,
``field(metadata={"help": ...})``), so the command line, the code that builds options
in Python (tests, asv) and the defaults never drift apart. A field ``new_tokens: int = 8``
becomes ``--new-tokens N`` with that default; ``bool`` becomes a switch; ``list[int]``
or ``list[str]`` takes one or more values; ``X | None`` is an ``X`` that may be left
unset. Metadata keys ``choices``, ``metavar``, ``nargs`` and ``const`` go to argparse as
they are; ``positional`` makes the field the command's positional list. An ``Options``
that extends a class declared elsewhere (the chaos soak's, in :mod:`dask_kvstate.testing`)
adds metadata for the inherited fields in a ``FIELD_METADATA`` class variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

PASSED = ("choices", "metavar", "nargs", "const")  # metadata handed to add_argument unchanged


def flag(name: str) -> str:
    """The flag of a field.

    >>> flag("new_tokens")
    '--new-tokens'
    """
    return "--" + name.replace("_", "-")


def metadata(cls: type, f: dataclasses.Field) -> dict:
    """A field's metadata, with what ``cls.FIELD_METADATA`` adds for it."""
    return {**f.metadata, **getattr(cls, "FIELD_METADATA", {}).get(f.name, {})}


def default(f: dataclasses.Field) -> Any:
    """A field's default value (a fresh one for a ``default_factory``)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"option {f.name!r} has no default: a command line must run without flags")


def unwrap(hint: Any) -> tuple[Any, Any]:
    """A field's type without ``None``, and the item type when it is a list (else None).

    >>> unwrap(int | None), unwrap(list[str]), unwrap(list[int] | None)
    ((<class 'int'>, None), (<class 'list'>, <class 'str'>), (<class 'list'>, <class 'int'>))
    """
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"an option has one type (or None), not {hint}")
        hint = rest[0]
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return list, item
    return hint, None


def _help(text: str | None, value: Any, kind: Any) -> str | None:
    """The help line: the field's text and its default (argparse reads ``%`` as a format)."""
    parts = [text] if text else []
    if kind is not bool and value not in (None, [], ""):
        shown = " ".join(str(v) for v in value) if isinstance(value, list) else str(value)
        parts.append(f"(default: {shown})")
    return " ".join(parts).replace("%", "%%") or None


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argument of ``parser`` per init field of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        meta = metadata(cls, f)
        kind, item = unwrap(hints[f.name])
        value = default(f)
        kwargs: dict[str, Any] = {k: meta[k] for k in PASSED if k in meta}
        kwargs["help"] = _help(meta.get("help"), value, kind)
        if kind is bool:
            # A switch that is on by default is turned off by --no-<name>.
            kwargs["action"] = argparse.BooleanOptionalAction if value else "store_true"
        elif kind is list:
            kwargs.setdefault("nargs", "*" if meta.get("positional") else "+")
            kwargs["type"] = item
        else:
            kwargs["type"] = kind
        if meta.get("positional"):
            parser.add_argument(f.name, default=value, **kwargs)
        else:
            parser.add_argument(flag(f.name), dest=f.name, default=value, **kwargs)


def from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    """The ``cls`` instance a parsed command line stands for (its ``__post_init__`` checks run)."""
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if f.init})


def to_argv(opts: Any) -> list[str]:
    """The flags that give ``opts`` back, positional values first, defaults left out.

    >>> @dataclasses.dataclass
    ... class Example:
    ...     names: list[str] = dataclasses.field(default_factory=list, metadata={"positional": True})
    ...     quick: bool = False
    ...     lengths: list[int] | None = None
    ...     seed: int = 0
    >>> to_argv(Example(["ttft"], quick=True, lengths=[128, 256]))
    ['ttft', '--quick', '--lengths', '128', '256']
    """
    positional: list[str] = []
    flags: list[str] = []
    for f in dataclasses.fields(opts):
        value = getattr(opts, f.name)
        if not f.init or value == default(f):
            continue
        if metadata(type(opts), f).get("positional"):
            positional += [str(v) for v in value]
        elif isinstance(value, bool):
            flags.append(flag(f.name) if value else "--no-" + flag(f.name)[2:])
        elif isinstance(value, list):
            flags += [flag(f.name), *(str(v) for v in value)]
        else:
            flags += [flag(f.name), str(value)]
    return positional + flags
