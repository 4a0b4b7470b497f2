"""Progress bars for the slow, visible steps: model conversion/loading and long example runs.

tqdm (already a transformers dependency) on stderr, shown only when ``kvstate.progress``
is true *and* stderr is a terminal, so logs, CI output and doctests stay clean.
Transformers' loading bars follow the same rule; its per-tensor GGUF dequantization
bar does not (it uses tqdm directly, with no switch).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator

from dask_kvstate import config


def enabled(stream=None) -> bool:
    """Whether bars show: ``kvstate.progress`` is true and ``stream`` (stderr) is a TTY.

    Examples
    --------
    >>> import dask, io
    >>> enabled(io.StringIO())  # not a terminal
    False
    >>> with dask.config.set({"kvstate.progress": False}):
    ...     enabled(sys.stderr)
    False
    """
    stream = sys.stderr if stream is None else stream
    if not config.get("progress"):
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False


def bar(
    iterable: Iterable | None = None, *, total: int | None = None, desc: str | None = None, unit: str = "it", **kwargs
):
    """A ``tqdm`` bar that is a silent pass-through when :func:`enabled` is false.

    Examples
    --------
    >>> with bar(total=2, desc="steps") as b:  # a doctest's stderr is no TTY: nothing printed
    ...     b.update(2)
    >>> list(bar(range(3)))
    [0, 1, 2]
    """
    from tqdm import tqdm

    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=not enabled(),
        dynamic_ncols=True,
        **kwargs,
    )


def as_completed(futures: list, desc: str) -> Iterator:
    """Yield ``futures`` as they finish, with a bar counting them (for long example runs)."""
    from distributed import as_completed as _as_completed

    with bar(total=len(futures), desc=desc, unit="task") as b:
        for f in _as_completed(futures):
            b.update()
            yield f


def write(line: str) -> None:
    """Print ``line`` to stdout above any bar (a plain print would tear the bar)."""
    from tqdm import tqdm

    tqdm.write(line)


@contextlib.contextmanager
def quiet_transformers_unless_enabled():
    """Transformers' own loading bars follow :func:`enabled` too (it has a switch for them)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not enabled():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not hf_logging.is_progress_bar_enabled():
            hf_logging.enable_progress_bar()
