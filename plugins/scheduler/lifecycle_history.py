"""How long the tasks ahead of a suspended session will take: the lifecycle's clock.

Nalar 4.5. The ``kvstate-lifecycle`` extension (:mod:`.lifecycle`) predicts when a
session's KV is wanted again from two things this module keeps apart from the
extension's messaging: each component's task durations as this scheduler saw them
(processing -> memory wall time, per ``kvstate-component`` annotation or key prefix),
and a walk through the unfinished tasks a waiting step still depends on. Dask's
``TaskPrefix.duration_average`` is per key prefix and measures compute time, not what a
waiting session sees; Dask has no "longest remaining path", so the walk is written here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from time import time

from dask_kvstate.session import component_of

#: Steps (a task entered, an input read) one control pass takes, at most, through the
#: unfinished graph ahead of waiting sessions (:meth:`TaskHistory.before_start`): a few
#: milliseconds of the loop at worst (docs/design/lifecycle.md).
WALK_LIMIT = 1_000


@dataclass
class Walk:
    """One control pass's walk through the unfinished tasks ahead of waiting sessions:
    ``before`` maps a key to the seconds (and their variance) until its inputs are in
    memory (None: unknown), shared by the pass's sessions; ``steps`` counts against
    :data:`WALK_LIMIT`."""

    before: dict = field(default_factory=dict)
    entered: set = field(default_factory=set)
    steps: int = 0


class TaskHistory:
    """Per component, how long its tasks took on this scheduler, and what that predicts."""

    def __init__(self) -> None:
        self.started: dict = {}  # key -> time it went processing
        self.durations: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0])  # component -> [n, sum s, sum s^2]

    def transition(self, key, start: str, finish: str, ts) -> None:
        """Record a scheduler transition of ``key`` (``ts`` its task state, None if gone)."""
        if finish == "processing":
            self.started[key] = time()
        elif start == "processing":
            t0 = self.started.pop(key, None)
            if finish == "memory" and t0 is not None and ts is not None:
                d, x = self.durations[component_of(ts)], time() - t0
                d[0] += 1
                d[1] += x
                d[2] += x * x

    def mean_duration(self, component: str) -> float | None:
        n, total, _ = self.durations.get(component, (0, 0.0, 0.0))
        return total / n if n else None

    def spread(self, component: str) -> float:
        """Standard deviation of the component's durations: how early a prefetch must start
        to be in time for a run that ends one deviation before its mean. The sample's
        (divided by ``n - 1``): from the few runs a workflow has seen when its sessions
        first come back, the population's would understate it (its variance by half at two runs)."""
        n, total, sq = self.durations.get(component, (0, 0.0, 0.0))
        return (max(sq - total * total / n, 0.0) / (n - 1)) ** 0.5 if n > 1 else 0.0

    def means(self) -> dict[str, float | None]:
        return {c: self.mean_duration(c) for c in self.durations}

    def until_done(self, ts, now: float, walk: Walk) -> tuple[float | None, float, float]:
        """``(mean, elapsed, variance)`` of awaited dependency ``ts``: ``mean - elapsed`` is
        how long it has left, for :func:`~.lifecycle_policy.predict_idle`.

        A dependency that has not started yet (itself waiting on others) first waits for
        its own inputs: its "mean" is its component's mean plus that wait, the longest
        chain of mean durations through the unfinished tasks above it, and the variance
        theirs summed. Without this, a session whose next step is several steps away (a
        round-robin over sessions, a second tool call) would look due as soon as it is
        suspended and be fetched back long before it runs.
        """
        component = component_of(ts)
        mean, var = self.mean_duration(component), self.spread(component) ** 2
        if mean is None or ts.state == "processing":
            return mean, now - self.started.get(ts.key, now), var
        before = self.before_start(ts, now, walk)
        return (None, 0.0, var) if before is None else (mean + before[0], 0.0, var + before[1])

    def before_start(self, root, now: float, walk: Walk) -> tuple[float, float] | None:
        """Predicted seconds (and their variance) until every input of ``root`` is in
        memory; None when a component on the way was never seen, an input erred, or the
        pass has taken :data:`WALK_LIMIT` steps already (a graph that large ahead of a
        session is not due soon, and the control loop must stay short). Iterative (an
        explicit stack: a recursion would hit Python's limit on a long chain) and
        memoized in ``walk`` for one control pass, so sessions behind the same tasks
        walk them once."""
        before, stack = walk.before, [root]
        while stack:
            ts = stack[-1]
            if ts.key in before:
                stack.pop()
                continue
            inputs = [d for d in ts.dependencies if d.state != "memory"]
            if ts.key not in walk.entered:  # counted once, not again when its inputs are done
                walk.entered.add(ts.key)
                walk.steps += 1 + len(inputs)
            if walk.steps > WALK_LIMIT:
                for t in stack:
                    before[t.key] = None
                break
            todo = [d for d in inputs if d.state not in ("processing", "erred") and d.key not in before]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            longest: tuple[float, float] = (0.0, 0.0)
            for d in inputs:
                mean = self.mean_duration(component_of(d))
                above = (0.0, 0.0) if d.state == "processing" else before.get(d.key)
                if d.state == "erred" or mean is None or above is None:
                    before[ts.key] = None
                    break
                left = max(mean - (now - self.started.get(d.key, now)), 0.0) if d.state == "processing" else mean
                if above[0] + left >= longest[0]:
                    longest = (above[0] + left, above[1] + self.spread(component_of(d)) ** 2)
            else:
                before[ts.key] = longest
        return before[root.key]
