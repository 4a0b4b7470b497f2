"""The state plan for people: text, and graphviz with state edges dashed."""

from __future__ import annotations

import html

from dask_kvstate.graph_opt.plan import CHARS_PER_TOKEN, Plan


def _short(key) -> str:
    s = str(key)
    return s if len(s) <= 32 else s[:29] + "..."


def _table(header, rows) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class StatePlan:
    """What ``kvs.explain`` returns: ``str(plan)`` is the text, ``plan.to_dot()`` the graph."""

    def __init__(self, plan: Plan, keys: list):
        self.plan = plan
        self.keys = keys
        self.names = {k: f"S{i + 1}" for i, k in enumerate(plan.states)}

    @property
    def tokens_avoided_estimate(self) -> int:
        return self.plan.tokens_avoided_estimate()

    def _ref(self, key) -> str:
        return self.names.get(key, f"<{_short(key)}>")

    def __str__(self) -> str:
        p = self.plan
        unknown = any(st.has_key_segment for st in p.states.values())
        lines = [
            f"stateflow plan: {len(p.calls)} LLM calls, {len(p.states)} states inserted, "
            f"{len(p.resumes)} calls resume from a state",
            f"estimated prefill tokens avoided: ~{p.tokens_avoided_estimate():,} "
            f"(~{CHARS_PER_TOKEN} chars/token{'; plus shared upstream documents' if unknown else ''})",
        ]
        if p.states:
            lines.append("states:")
        for key, st in p.states.items():
            segs = ", ".join(s.label() for s in st.segments)
            src = f"materialize({segs})" if st.op == "materialize" else f"extend({self._ref(st.parent)}, {segs})"
            model = f" [model {st.model}]" if st.model else ""
            users = len(st.consumers) + len(st.children)
            lines.append(f"  {self.names[key]} = {src}{model}  -> used by {users}  ({_short(key)})")
        lines.append("calls:")
        for call in p.calls:
            if call.key in p.resumes:
                skey, rest = p.resumes[call.key]
                tail = " + " + ", ".join(s.label() for s in rest) if rest else ""
                lines.append(f"  {_short(call.key)}: resume from {self.names[skey]}{tail}")
            else:
                lines.append(f"  {_short(call.key)}: unchanged (nothing shared)")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        """The plan as tables for notebooks: states (what each prefills, who uses it) and calls.

        Plain HTML, no graphviz needed (``to_dot()`` is there for a picture).
        """
        esc = html.escape
        p = self.plan
        head = str(self).splitlines()[:2]
        parts = [f"<div><strong>{esc(head[0])}</strong><br>{esc(head[1])}"]
        if p.states:
            rows = []
            for key, st in p.states.items():
                segs = ", ".join(s.label() for s in st.segments)
                src = "materialize" if st.op == "materialize" else f"extend {self._ref(st.parent)}"
                rows.append(
                    (self.names[key], src, segs, st.model or "", len(st.consumers) + len(st.children), _short(key))
                )
            parts.append(_table(("state", "op", "segments", "model", "used by", "key"), rows))
        calls = []
        for call in p.calls:
            if call.key in p.resumes:
                skey, rest = p.resumes[call.key]
                calls.append((_short(call.key), f"resume from {self.names[skey]}", ", ".join(s.label() for s in rest)))
            else:
                calls.append((_short(call.key), "unchanged (nothing shared)", ""))
        parts.append(_table(("call", "plan", "then prefill"), calls))
        return "".join(parts) + "</div>"

    def to_dot(self) -> str:
        """Graphviz source: boxes are states, ellipses LLM calls; dashed edges carry KV state."""
        out = ["digraph stateflow {", "  rankdir=LR;", '  node [fontname="Helvetica"];']
        q = lambda k: '"' + str(k).replace('"', '\\"') + '"'
        for key, st in self.plan.states.items():
            out.append(f'  {q(key)} [shape=box, label="{self.names[key]}: {st.op}"];')
            if st.parent is not None:
                out.append(f"  {q(st.parent)} -> {q(key)} [style=dashed];")
            for s in st.segments:
                if s.kind == "key":
                    out.append(f"  {q(s.value)} -> {q(key)};")
        for call in self.plan.calls:
            out.append(f'  {q(call.key)} [shape=ellipse, label="{_short(call.key)}"];')
            if call.key in self.plan.resumes:
                skey, rest = self.plan.resumes[call.key]
                out.append(f"  {q(skey)} -> {q(call.key)} [style=dashed];")
                segs = rest
            else:
                segs = call.segments
            for s in segs:
                if s.kind == "key":
                    out.append(f"  {q(s.value)} -> {q(call.key)};")
        out.append("}")
        return "\n".join(out)
