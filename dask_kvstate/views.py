"""People-facing views of kvstate numbers: a terminal table and a notebook HTML table.

:class:`Stats` is what ``kvs.stats`` returns. :func:`totals` is the one place cluster
totals are summed, so ``kvs.stats`` and the ``/kvstate`` dashboard page always show the
same numbers. Torch-free: the scheduler
(which renders the dashboard) imports this module.
"""

from __future__ import annotations

import html
import warnings
from collections.abc import Callable, ItemsView, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass
from typing import Any

from dask.utils import format_bytes

from dask_kvstate.state import TIERS

#: Counters summed over workers for the cluster totals (absent counters count 0).
TOTAL_KEYS = (
    "blocks",
    "bytes",
    "hits",
    "misses",
    "transfers",
    "transfer_bytes",
    "recomputes",
    "prefill_tokens",
    "prefill_tokens_avoided",
    "incompatible",
    "evictions",
)

# (header, how to read it from one worker's stats, how to show it)
_COLUMNS: tuple[tuple[str, Callable[[Mapping], Any], Callable[[Any], str]], ...] = (
    ("model", lambda s: s.get("model", ""), str),
    ("blocks", lambda s: s.get("blocks", 0), "{:,}".format),
    ("bytes", lambda s: s.get("bytes", 0), format_bytes),
    *((f"{t}", lambda s, t=t: s.get("tiers", {}).get(t, {}).get("bytes", 0), format_bytes) for t in TIERS),
    ("hits", lambda s: s.get("hits", 0), "{:,}".format),
    ("misses", lambda s: s.get("misses", 0), "{:,}".format),
    ("hit rate", lambda s: hit_rate(s), lambda r: "-" if r is None else f"{r:.0%}"),
    ("transfers", lambda s: s.get("transfers", 0), "{:,}".format),
    ("recomputes", lambda s: s.get("recomputes", 0), "{:,}".format),
    ("tokens avoided", lambda s: s.get("prefill_tokens_avoided", 0), "{:,}".format),
)


def hit_rate(s: Mapping) -> float | None:
    """Block hits over lookups (hits + misses); None before any lookup.

    Examples
    --------
    >>> hit_rate({"hits": 3, "misses": 1}), hit_rate({})
    (0.75, None)
    """
    n = s.get("hits", 0) + s.get("misses", 0)
    return None if n == 0 else s.get("hits", 0) / n


def totals(per_worker: Mapping[str, Mapping]) -> dict:
    """Cluster totals of the per-worker stats (workers without the plugin are skipped).

    Examples
    --------
    >>> t = totals({"a": {"installed": True, "blocks": 2, "hits": 1, "tiers": {"device": {"bytes": 8}}},
    ...             "b": {"installed": True, "blocks": 3, "misses": 1}, "c": {"installed": False}})
    >>> t["workers"], t["blocks"], t["tiers"]["device"]["bytes"], t["hit_rate"]
    (2, 5, 8, 0.5)
    """
    live = [s for s in per_worker.values() if s.get("installed", True)]
    out: dict = {"workers": len(live), **{k: sum(int(s.get(k, 0)) for s in live) for k in TOTAL_KEYS}}
    out["tiers"] = {
        t: {f: sum(int(s.get("tiers", {}).get(t, {}).get(f, 0)) for s in live) for f in ("blocks", "bytes")}
        for t in TIERS
    }
    out["hit_rate"] = hit_rate(out)
    return out


def _rows(per_worker: Mapping[str, Mapping]) -> list[list[str]]:
    rows = []
    for worker, s in sorted(per_worker.items()):
        if not s.get("installed", True):
            rows.append([worker, "(kvstate not installed)"] + [""] * (len(_COLUMNS) - 1))
            continue
        rows.append([worker] + [show(get(s)) for _, get, show in _COLUMNS])
    return rows


def _total_row(per_worker: Mapping[str, Mapping]) -> list[str]:
    t = totals(per_worker)
    flat = {**t, "tiers": t["tiers"], "model": f"{t['workers']} workers"}
    return ["total"] + [show(get(flat)) for _, get, show in _COLUMNS]


def text_table(per_worker: Mapping[str, Mapping]) -> str:
    """A fixed-width table: one row per worker, then the totals."""
    if not per_worker:
        return "kvstate: no workers"
    header = ["worker"] + [h for h, _, _ in _COLUMNS]
    rows = [header, *_rows(per_worker), _total_row(per_worker)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    lines = [fmt(r).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    return "\n".join(lines)


def html_table(per_worker: Mapping[str, Mapping], title: str = "kvstate") -> str:
    """The same table as HTML, with the totals as a footer row."""
    esc = html.escape
    if not per_worker:
        return f"<div><strong>{esc(title)}</strong>: no workers</div>"
    head = "".join(f"<th>{esc(h)}</th>" for h in ["worker"] + [h for h, _, _ in _COLUMNS])
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in _rows(per_worker))
    foot = "<tr>" + "".join(f"<th>{esc(c)}</th>" for c in _total_row(per_worker)) + "</tr>"
    return (
        f"<div><strong>{esc(title)}</strong><table><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody><tfoot>{foot}</tfoot></table></div>"
    )


class ClusterStats(dict):
    """``kvs.stats(client).workers``: ``{worker: {...}}``, a plain dict, that also renders.

    A dict subclass, so code that indexes it (``stats[worker]["hits"]``) and compares it
    keeps working; ``print`` gives a table per worker plus totals, Jupyter an HTML table.

    Examples
    --------
    >>> s = ClusterStats({"tcp://a:1": {"installed": True, "model": "tiny-llama", "blocks": 2, "bytes": 2048,
    ...                                 "hits": 3, "misses": 1}})
    >>> s["tcp://a:1"]["blocks"], s.totals["hit_rate"]
    (2, 0.75)
    >>> str(s).splitlines()[0].split()[:4]
    ['worker', 'model', 'blocks', 'bytes']
    """

    @property
    def totals(self) -> dict:
        return totals(self)

    def __str__(self) -> str:
        return text_table(self)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return html_table(self, title="kvstate: KV blocks per worker")


def _show(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def summary(section: Mapping) -> str:
    """One extension's scalar stats in a line (nested ones stay in the data); empty when it is off.

    Examples
    --------
    >>> summary({"installed": True, "decisions": 3, "rates": {"x": 1.0}, "alpha": 0.2}), summary({"installed": False})
    ('decisions 3, alpha 0.2', '')
    """
    if not section.get("installed", False):
        return ""
    return ", ".join(
        f"{k} {_show(v)}" for k, v in section.items() if k != "installed" and isinstance(v, (int, float, str))
    )


@dataclass
class Stats:
    """What ``kvs.stats`` returns: per-worker counters and what each scheduler extension did.

    ``workers`` is ``{worker: {...}}`` (:class:`ClusterStats`); ``placement`` and
    ``lifecycle`` are one extension's stats each, ``scheduling`` one per extension
    (``sessions``, ``priority``, ``stealing``, ``capacity``, ``hints``). An extension that
    is off reads ``{"installed": False}``. ``print`` gives the worker table and a line per
    extension, Jupyter the same as HTML.

    Examples
    --------
    >>> s = Stats(workers=ClusterStats({"tcp://a:1": {"installed": True, "blocks": 2}}),
    ...           placement={"installed": True, "decisions": 4}, scheduling={"sessions": {"installed": False}},
    ...           lifecycle={"installed": False})
    >>> s.workers["tcp://a:1"]["blocks"], s.placement["decisions"]
    (2, 4)
    >>> print(str(s).split("\\n\\n")[1])
    extension  on   stats
    ---------------------------
    placement  on   decisions 4
    sessions   off
    lifecycle  off
    """

    workers: ClusterStats
    placement: dict
    scheduling: dict
    lifecycle: dict

    def extensions(self) -> dict[str, dict]:
        """``{extension: its stats}``, scheduling's flattened in among placement and lifecycle."""
        return {"placement": self.placement, **self.scheduling, "lifecycle": self.lifecycle}

    def _extension_rows(self) -> list[tuple[str, str, str]]:
        return [(name, "on" if s.get("installed") else "off", summary(s)) for name, s in self.extensions().items()]

    def __str__(self) -> str:
        rows = [("extension", "on", "stats"), *self._extension_rows()]
        width = max(len(name) for name, _, _ in rows)
        lines = [f"{name.ljust(width)}  {on.ljust(3)}  {text}".rstrip() for name, on, text in rows]
        lines.insert(1, "-" * max(len(line) for line in lines))
        return text_table(self.workers) + "\n\n" + "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        esc = html.escape
        head = "".join(f"<th>{h}</th>" for h in ("extension", "on", "stats"))
        body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in self._extension_rows())
        return (
            html_table(self.workers, title="kvstate: KV blocks per worker")
            + "<div><strong>kvstate: scheduler extensions</strong>"
            + f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
        )

    # Deprecated, kept one release: kvs.stats(client) read as the mapping of workers; each use warns.
    def _workers_mapping(self) -> ClusterStats:
        warnings.warn(
            "kvs.stats(client) as a mapping of workers is deprecated; use kvs.stats(client).workers",
            FutureWarning,
            stacklevel=3,
        )
        return self.workers

    def __getitem__(self, worker: str) -> dict:
        return self._workers_mapping()[worker]

    def __iter__(self) -> Iterator[str]:
        return iter(self._workers_mapping())

    def keys(self) -> KeysView[str]:
        return self._workers_mapping().keys()

    def values(self) -> ValuesView[dict]:
        return self._workers_mapping().values()

    def items(self) -> ItemsView[str, dict]:
        return self._workers_mapping().items()

    def get(self, worker: str, default=None):
        return self._workers_mapping().get(worker, default)
