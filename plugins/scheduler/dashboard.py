"""The ``/kvstate`` page on the scheduler's Dask dashboard (Bokeh).

Built the way ``distributed/dashboard/scheduler.py`` builds its pages: a document
function ``(scheduler, extra, doc)`` wrapped by ``distributed.dashboard.core.BokehApplication``,
Dask's template and theme, and ``add_periodic_callback`` for live refresh. Dask builds
its one Bokeh server at scheduler start, and offers no hook to add a page later, so
:func:`register_page` does what ``distributed.dashboard.scheduler.connect`` does with
a second, one-page Bokeh application: ``http_application.add_application`` (Dask's
``RoutingApplication`` tries each application in turn) then ``initialize``/``start``.

Everything shown comes from the observe extension's memory (pushed by workers) and
the scheduler's event log; nothing here waits on a worker.
"""

from __future__ import annotations

import html
import logging
from datetime import datetime
from typing import Any

from dask.utils import format_bytes

from dask_kvstate import config
from dask_kvstate.protocol import OBSERVE_EXTENSION, PLACEMENT_TOPIC
from dask_kvstate.views import TIERS, html_table

logger = logging.getLogger("dask_kvstate")

ROUTE = "/kvstate"
_TABLE_CSS = """
table { border-collapse: collapse; font-size: 12px; }
th, td { padding: 2px 8px; text-align: right; border-bottom: 1px solid #ddd; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
"""
TIER_COLORS = ("#1f77b4", "#ff7f0e", "#7f7f7f")
ACTION_COLORS = {"pull": "#1f77b4", "recompute": "#d62728"}
#: Totals shown in the header; each is a ``<span data-kvstate=NAME>`` so tests and users can find it.
SHOWN_TOTALS = (
    ("workers", "workers"),
    ("blocks", "KV blocks"),
    ("bytes", "KV bytes"),
    ("hits", "block hits"),
    ("misses", "misses"),
    ("transfers", "blocks pulled"),
    ("transfer_bytes", "bytes pulled"),
    ("recomputes", "blocks recomputed"),
    ("prefill_tokens_avoided", "prefill tokens avoided"),
    ("prefill_tokens", "tokens prefilled"),
)


def _bokeh_app_of(scheduler):
    """Dask's own dashboard application on this scheduler, or None (no dashboard)."""
    app = getattr(scheduler, "http_application", None)
    for sub in getattr(app, "applications", ()):
        if type(sub).__name__.endswith("BokehTornado") and ROUTE not in getattr(sub, "app_paths", ()):
            return sub
    return None


def register_page(scheduler, observer=None):
    """Serve ``/kvstate`` from ``scheduler``'s dashboard; returns the Bokeh application, or None.

    None (and a log line) when the scheduler runs no dashboard or Bokeh is missing:
    the extension still collects, ``kvs.stats`` and the event log still work.
    """
    dask_app = _bokeh_app_of(scheduler)
    if dask_app is None:
        logger.info("kvstate: no Dask dashboard on this scheduler; %s not served", ROUTE)
        return None
    try:
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
        from tornado.ioloop import IOLoop
    except ImportError as e:  # bokeh too old/new for distributed: it said so already
        logger.info("kvstate: dashboard page unavailable (%s)", e)
        return None
    variables = template_variables(scheduler)
    # Dask's page list is shared by every page's navigation bar: add ours to it.
    if "kvstate" not in variables["pages"]:
        variables["pages"].append("kvstate")
    app = BokehApplication({ROUTE: kvstate_doc}, scheduler, prefix=dask_app.prefix, template_variables=variables)
    scheduler.http_application.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    logger.info("kvstate: dashboard page at %s%s", dask_app.prefix.rstrip("/"), ROUTE)
    return app


def unregister_page(scheduler, app) -> None:
    apps = getattr(scheduler.http_application, "applications", [])
    if app in apps:
        apps.remove(app)
    app.stop()


def kvstate_doc(scheduler, extra, doc):
    """The Bokeh document of ``/kvstate``."""
    from distributed.dashboard.components import add_periodic_callback
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    page = KVStatePage(scheduler, scheduler.plugins.get(OBSERVE_EXTENSION))
    page.update()
    add_periodic_callback(doc, page, page.interval_ms)
    doc.title = "Dask: KV state"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def totals_html(totals: dict | None, refresh_s: float) -> str:
    """The header: totals as labelled numbers, or the empty state."""
    if not totals or not totals.get("workers"):
        return (
            "<h3>KV state</h3><p data-kvstate='empty'>No KV state yet: install the plugins with "
            "<code>kvs.install(client, model)</code> and run a workflow. This page refreshes every "
            f"{refresh_s:g} s.</p>"
        )
    cells = []
    for key, label in SHOWN_TOTALS:
        v = int(totals.get(key, 0))
        shown = format_bytes(v) if key.endswith("bytes") else f"{v:,}"
        cells.append(
            f"<span style='margin-right:1.5em'>{label}: <b data-kvstate='{key}' title='{v}'>{shown}</b></span>"
        )
    rate = totals.get("hit_rate")
    cells.append(f"<span>hit rate: <b data-kvstate='hit_rate'>{'-' if rate is None else f'{rate:.1%}'}</b></span>")
    return "<h3>KV state</h3><div style='font-size:14px'>" + " ".join(cells) + "</div>"


def lineage_html(chains: list[list[dict]]) -> str:
    """The largest live states, each followed by where it came from."""
    if not chains:
        return "<h4>Largest states</h4><p>No states yet.</p>"
    items = []
    for chain in chains:
        head = chain[0]
        steps = " &larr; ".join(
            f"{html.escape(str(s['op']))} <code>{html.escape(str(s['state'])[:8])}</code> ({s['tokens']:,} tok)"
            for s in chain
        )
        status = "live" if head.get("live") else "released"
        items.append(
            f"<li><b>{format_bytes(head['nbytes'])}</b> ({status}) on {html.escape(str(head['holder']))} "
            f"[{html.escape(str(head['model']))}]: {steps}</li>"
        )
    return "<h4>Largest states (lineage, newest first)</h4><ol>" + "".join(items) + "</ol>"


def sessions_html(plugin) -> str:
    """The sessions panel: live sessions with their progress.

    Reads ``progress()``, ``{session: {"done": int, "total": int, ...}}``, of the
    session tracker (``plugins/scheduler/sessions.py``).
    """
    try:
        rows = plugin.progress() or {}
    except Exception as e:
        return f"<h4>Sessions</h4><p>unavailable: {html.escape(repr(e))}</p>"
    if not rows:
        return "<h4>Sessions</h4><p>No live sessions.</p>"
    out = []
    for name, s in rows.items():
        done, total = s["done"], max(s["total"], 1)
        bar = f"<progress value='{done}' max='{total}'></progress> {done}/{total}"
        out.append(f"<tr><td>{html.escape(str(name))}</td><td>{bar}</td></tr>")
    return "<h4>Sessions</h4><table>" + "".join(out) + "</table>"


def _update(source, data: dict) -> None:
    """Dask's helper (distributed.dashboard.utils.update): skips unchanged data, so an idle
    page sends nothing to the browser, and updates the columns in place."""
    from distributed.dashboard.utils import update

    update(source, data)


class KVStatePage:
    """All panels of the page; ``update`` refreshes them from the observe extension."""

    def __init__(self, scheduler, observer):
        from bokeh.layouts import column, row
        from bokeh.models import ColumnDataSource, Div, FactorRange, HoverTool, NumeralTickFormatter  # type: ignore[attr-defined]
        from bokeh.plotting import figure

        self.scheduler = scheduler
        self.observer = observer
        refresh = observer.refresh_s if observer is not None else config.get_seconds("dashboard.refresh-interval")
        self.refresh_s = refresh
        self.interval_ms = int(refresh * 1000)
        self.header = Div(text="", name="kvstate-totals", sizing_mode="stretch_width")

        self.tier_source = ColumnDataSource({"worker": [], **{t: [] for t in TIERS}})
        self.tiers = figure(
            title="KV bytes per worker and tier",
            y_range=FactorRange(),
            height=220,
            sizing_mode="stretch_width",
            tools="",
            toolbar_location=None,
        )
        self.tiers.hbar_stack(
            list(TIERS),
            y="worker",
            height=0.8,
            color=list(TIER_COLORS),
            source=self.tier_source,
            legend_label=list(TIERS),
        )
        self.tiers.xaxis.formatter = NumeralTickFormatter(format="0.0 b")
        self.tiers.legend.orientation = "horizontal"
        self.tiers.add_layout(self.tiers.legend[0], "above")  # beside the bars, never over them

        # The per-worker table as HTML, the same one kvs.stats renders in Jupyter. Not a
        # Bokeh DataTable: in Bokeh 3.9 its cells stop redrawing after the first update
        # (bokeh/bokeh#13859 and relatives), so the page would show stale numbers.
        self.table = Div(text="", name="kvstate-workers", sizing_mode="stretch_width", stylesheets=[_TABLE_CSS])

        self.history_source = ColumnDataSource(
            {k: [] for k in ("time", "transfers", "recomputes", "transfer_bytes", "prefill_tokens", "tokens_avoided")}
        )
        self.flow = self._cumulative(
            "Blocks pulled vs recomputed (cumulative)",
            [("transfers", ACTION_COLORS["pull"], "pulled"), ("recomputes", ACTION_COLORS["recompute"], "recomputed")],
        )
        self.flow.add_tools(
            HoverTool(
                tooltips=[
                    ("pulled", "@transfers blocks, @transfer_bytes{0.0 b}"),
                    ("recomputed", "@recomputes blocks"),
                ],
                mode="vline",
            )
        )
        self.tokens = self._cumulative(
            "Prefill tokens: computed vs avoided (cumulative)",
            [("prefill_tokens", "#7f7f7f", "prefilled"), ("tokens_avoided", "#2ca02c", "avoided (reused KV)")],
        )

        self.rule_source = ColumnDataSource(
            {
                k: []
                for k in (
                    "time",
                    "seconds",
                    "estimate",
                    "action",
                    "color",
                    "bytes",
                    "t_transfer",
                    "t_recompute",
                    "worker",
                )
            }
        )
        self.rule = figure(
            title="Pull or recompute: measured seconds (o) vs the rule's estimate (x)",
            x_axis_type="datetime",
            height=220,
            sizing_mode="stretch_width",
            tools="",
        )
        self.rule.scatter("time", "seconds", source=self.rule_source, color="color", size=8, legend_field="action")
        self.rule.scatter("time", "estimate", source=self.rule_source, color="color", size=10, marker="x")
        self.rule.add_tools(
            HoverTool(
                tooltips=[
                    ("action", "@action"),
                    ("worker", "@worker"),
                    ("bytes", "@bytes"),
                    ("measured s", "@seconds"),
                    ("est. transfer s", "@t_transfer"),
                    ("est. recompute s", "@t_recompute"),
                ]
            )
        )
        self.lineage = Div(text="", name="kvstate-lineage", sizing_mode="stretch_width")
        self.sessions = Div(text="", name="kvstate-sessions", visible=False, sizing_mode="stretch_width")
        self.root = column(
            self.header,
            row(self.tiers, self.table, sizing_mode="stretch_width"),
            row(self.flow, self.tokens, sizing_mode="stretch_width"),
            self.rule,
            self.sessions,
            self.lineage,
            sizing_mode="stretch_width",
        )

    def _cumulative(self, title: str, lines: list[tuple[str, str, str]]):
        """A time plot of ``history_source`` columns, one line per ``(column, color, legend)``."""
        from bokeh.plotting import figure

        fig = figure(title=title, x_axis_type="datetime", height=220, sizing_mode="stretch_width", tools="")
        for column, color, label in lines:
            fig.line("time", column, source=self.history_source, color=color, legend_label=label, line_width=2)
        fig.legend.location = "top_left"
        return fig

    def update(self) -> None:
        obs = self.observer
        stats = dict(obs.stats) if obs is not None else {}
        self.header.text = totals_html(obs.totals() if obs is not None else None, self.refresh_s)
        workers = sorted(w for w, s in stats.items() if s.get("installed", True))
        tier = lambda s, t, f: s.get("tiers", {}).get(t, {}).get(f, 0)
        y_range: Any = self.tiers.y_range  # a FactorRange (built so above)
        if list(y_range.factors) != workers:
            y_range.factors = workers
        _update(
            self.tier_source, {"worker": workers, **{t: [tier(stats[w], t, "bytes") for w in workers] for t in TIERS}}
        )
        self.table.text = html_table({w: stats[w] for w in workers}, title="per worker") if workers else ""
        history = list(obs.history) if obs is not None else []
        _update(
            self.history_source,
            {
                "time": [datetime.fromtimestamp(t) for t, _ in history],
                **{
                    k: [h.get(k, 0) for _, h in history]
                    for k in ("transfers", "recomputes", "transfer_bytes", "prefill_tokens")
                },
                "tokens_avoided": [h.get("prefill_tokens_avoided", 0) for _, h in history],
            },
        )
        self._update_rule()
        plugin = obs.sessions_plugin() if obs is not None else None
        self.sessions.visible = plugin is not None
        self.sessions.text = sessions_html(plugin) if plugin is not None else ""
        self.lineage.text = lineage_html(obs.largest() if obs is not None else [])

    def _update_rule(self) -> None:
        """Outcomes of placement decisions, from the scheduler's event log (last 500)."""
        events = [
            (t, m)
            for t, m in self.scheduler.get_events(PLACEMENT_TOPIC)[-500:]
            if isinstance(m, dict) and m.get("kind") == "outcome"
        ]
        est = lambda m: m.get("t_transfer") if m.get("action") == "pull" else m.get("t_recompute")
        _update(
            self.rule_source,
            {
                "time": [datetime.fromtimestamp(t) for t, _ in events],
                "seconds": [m.get("seconds") for _, m in events],
                "estimate": [est(m) for _, m in events],
                "action": [str(m.get("action")) for _, m in events],
                "color": [ACTION_COLORS.get(str(m.get("action")), "#7f7f7f") for _, m in events],
                "bytes": [m.get("missing_bytes", 0) for _, m in events],
                "t_transfer": [m.get("t_transfer") for _, m in events],
                "t_recompute": [m.get("t_recompute") for _, m in events],
                "worker": [str(m.get("worker")) for _, m in events],
            },
        )
