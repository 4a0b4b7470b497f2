"""Every name kvstate puts on the wire, defined once, with who sends and who receives it.

Five kinds of names travel between the client, the scheduler and the workers:

* **plugin names**: keys of ``Worker.plugins`` / ``Scheduler.plugins``, used to find a
  plugin from a task, a ``client.run`` function or another extension;
* **RPC handlers**: ``Server.handlers`` entries, a request that waits for an answer on a
  comm of its own (``await rpc.<name>(...)``);
* **stream ops**: ``Server.stream_handlers`` entries, one-way messages on the batched
  stream every worker keeps open to the scheduler (``{"op": <name>, ...}``). Dask closes
  a worker's stream when an op has no handler, so a sender only sends an op after the
  handshake said the receiving extension is there;
* **annotation keys**: entries of a task's ``annotations``, set by the client
  (``dask.annotate``) or by a scheduler extension, read on the scheduler and workers;
* **event topics**: Dask's event log (``log_event``; read with ``client.get_events`` or
  ``client.subscribe_topic``).

One handshake, :data:`HELLO`, tells a worker plugin which kvstate extensions the
scheduler runs: the plugin sends its own name, every extension present answers under
its plugin name (see ``plugins/scheduler/handshake.py`` and ``plugins/worker/handshake.py``).
Its counterpart :data:`GOODBYE` takes a worker plugin that is going away (removed, or its
worker closing) off the extensions' lists before its handlers go.

To follow a message, look its constant up here, then ``git grep`` the constant: one hit
sends it, one handles it.
"""

from __future__ import annotations

# -- worker plugins (Worker.plugins) ------------------------------------------------------
#: The block store and the runtimes (``plugins/worker/plugin.py``); tasks find it by this name.
WORKER_PLUGIN = "kvstate"
#: The scheduling extensions' worker half: re-sorts the ready heap, applies capacity moves.
SCHEDULING_WORKER_PLUGIN = "kvstate-scheduling"
#: The lifecycle extension's worker half: tracks a session's blocks, offloads and prefetches them.
LIFECYCLE_WORKER_PLUGIN = "kvstate-lifecycle-worker"
#: Runs ready tasks of a ``batchable`` component as one call; registered by the hints extension.
BATCHING_WORKER_PLUGIN = "kvstate-batching"

#: Runs the worker's own periodic checks less often (``plugins/housekeeping.py``); a nanny's
#: and the scheduler's plugins of the same job have the names below.
HOUSEKEEPING_WORKER = "kvstate-housekeeping"
HOUSEKEEPING_NANNY = "kvstate-housekeeping-nanny"
HOUSEKEEPING_SCHEDULER = "kvstate-housekeeping-scheduler"

# -- scheduler extensions (Scheduler.plugins) ----------------------------------------------
PLACEMENT_EXTENSION = "kvstate-placement"
OBSERVE_EXTENSION = "kvstate-observe"
SESSIONS_EXTENSION = "kvstate-sessions"
PRIORITY_EXTENSION = "kvstate-priority"
STEALING_EXTENSION = "kvstate-stealing"
CAPACITY_EXTENSION = "kvstate-capacity"
HINTS_EXTENSION = "kvstate-hints"
LIFECYCLE_EXTENSION = "kvstate-lifecycle"
#: The scheduling extensions, in the order their stats are reported.
SCHEDULING_EXTENSIONS = (
    SESSIONS_EXTENSION,
    PRIORITY_EXTENSION,
    STEALING_EXTENSION,
    CAPACITY_EXTENSION,
    HINTS_EXTENSION,
)

# -- RPC handlers on the scheduler ------------------------------------------------------------
#: Worker plugin setup -> every kvstate extension: ``{extension name: its answer}``.
HELLO = "kvstate_hello"
#: Worker plugin teardown -> every kvstate extension: this worker stops running that plugin
#: (its handlers go once the answer comes, after the calls already sent to it are answered).
GOODBYE = "kvstate_goodbye"
#: Worker runtime (a long prefill) -> placement: how many threads on its host are idle.
IDLE_THREADS = "kvstate_idle_threads"
#: Worker runtime (a consumer whose named holder is slow to reach) -> placement: the running
#: workers that hold every one of a list of blocks, so the pull can come from the fastest.
HOLDERS = "kvstate_holders"

# -- RPC handlers on workers --------------------------------------------------------------------
#: Worker runtime (a consumer) -> the holder's worker plugin: blocks by hash.
GET_BLOCKS = "kvstate_get_blocks"
#: ``kvs.evict`` task -> the holder's worker plugin: drop a state's blocks there too.
EVICT = "kvstate_evict"
#: Capacity extension -> scheduling worker plugin: move role resource units.
SET_RESOURCES = "kvstate_set_resources"
#: Lifecycle extension -> lifecycle worker plugin: an ended session's blocks go.
INVALIDATE = "kvstate_lifecycle_invalidate"

# -- stream ops, worker -> scheduler ----------------------------------------------------------
#: Worker plugin -> placement: a task's result holds these refs (where each state lives), and,
#: when small enough, the result itself as rows (``plugins/worker/ref_copies.py``) for :data:`REF_COPY`.
REF = "kvstate-ref"
#: Worker plugin -> placement: block hashes added to / removed from this worker's store.
BLOCKS = "kvstate-blocks"
#: Worker plugin -> placement: measured prefill coefficients, link bandwidths, latency.
METRICS = "kvstate-metrics"
#: Worker runtime -> placement: how long a pull or recompute took against the estimates.
OUTCOME = "kvstate-outcome"
#: Worker reporter -> observe: this worker's ``kvs.stats`` entry, when it changed.
STATS = "kvstate-stats"
#: Worker reporter -> observe: summaries of the states a task just computed (lineage).
STATES = "kvstate-states"
#: Lifecycle worker plugin -> lifecycle: a session's bytes per tier, measured move rates.
LIFECYCLE_REPORT = "kvstate-lifecycle-report"
#: Lifecycle worker plugin -> lifecycle: an offload or prefetch finished (its timings).
LIFECYCLE_DONE = "kvstate-lifecycle-done"

# -- stream ops, scheduler -> worker ----------------------------------------------------------
#: Priority extension -> scheduling worker plugin: new priorities of ready tasks.
REPRIORITIZE = "kvstate-reprioritize"
#: Lifecycle extension -> lifecycle worker plugin: move a session's blocks down a tier.
OFFLOAD = "kvstate-offload"
#: Lifecycle extension -> lifecycle worker plugin: bring a session's blocks back up.
PREFETCH = "kvstate-prefetch"
#: Placement (``plugins/scheduler/ref_relay.py``) -> the worker plugin (``plugins/worker/ref_copies.py``):
#: the value of a ref key that a task just sent to that worker needs, ahead of the task, so
#: the worker never dials the key's holder for it.
REF_COPY = "kvstate-ref-copy"

# -- annotation keys ------------------------------------------------------------------------
#: Client (``kvs.session``) -> sessions, lifecycle, stealing: the session a task belongs to.
SESSION_ANNOTATION = "kvstate-session"
#: Client (``kvs.component``) -> sessions, hints, batching: the agent role of a task.
COMPONENT_ANNOTATION = "kvstate-component"
#: Placement -> the worker runtime and stealing: where and how a consumer gets its KV
#: (``{"worker", "action", "t_transfer", "t_recompute", "capped"}``).
PLACEMENT_ANNOTATION = "kvstate-placement"

# -- event topics (log_event) ------------------------------------------------------------------
#: Placement decisions and each one's measured outcome (placement extension).
PLACEMENT_TOPIC = "kvstate-placement"
#: The placement extension failed on a task; the task keeps Dask's own placement.
ERROR_TOPIC = "kvstate-error"
#: A state not reused because model, config or positions differ (worker runtime).
COMPATIBILITY_TOPIC = "kvstate-compatibility"
#: The block store: explicit evictions (worker runtime), spills, unspills and drops per
#: report interval (observe, from the workers' stats).
STORE_TOPIC = "kvstate-store"
#: Lifecycle decisions: offload, prefetch, invalidate (lifecycle extension).
LIFECYCLE_TOPIC = "kvstate-lifecycle"
#: Session start, close and end (the client's ``kvs.session`` and the sessions extension).
SESSION_TOPIC = "kvstate-session"
#: Priority revisions (priority extension).
PRIORITY_TOPIC = "kvstate-priority"
#: Late-binding moves of queued work (stealing extension).
STEALING_TOPIC = "kvstate-stealing"
#: Capacity moves between agent roles (capacity extension).
CAPACITY_TOPIC = "kvstate-capacity"
