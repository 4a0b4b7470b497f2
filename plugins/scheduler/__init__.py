"""What runs inside the Dask scheduler process: the kvstate scheduler extensions.

Each is a ``SchedulerPlugin`` switched by one ``enabled`` config key and reporting through
``Scheduler.log_event``: :mod:`.placement` (KV locality and transfer-versus-recompute),
:mod:`.sessions` (workflow requests) and the policies its control loop (:mod:`.control`)
runs, :mod:`.priority`, :mod:`.stealing`, :mod:`.capacity`, :mod:`.hints`, then
:mod:`.lifecycle` (KV offload / prefetch / invalidate) and :mod:`.observe` with the
``/kvstate`` page of :mod:`.dashboard`. None of them imports torch.
"""
