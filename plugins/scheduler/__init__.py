"""What runs inside the Dask scheduler process: the kvstate scheduler extensions.

Each is a ``SchedulerPlugin`` switched by one ``enabled`` config key
(:mod:`dask_kvstate.extensions`) and reporting through ``Scheduler.log_event``:
:mod:`.placement` (KV locality and transfer-versus-recompute), :mod:`.sessions`
(workflow requests) and the policies its control loop (:mod:`.control`) runs,
:mod:`.priority`, :mod:`.stealing`, :mod:`.capacity`, :mod:`.hints`, then
:mod:`.lifecycle` (KV offload / prefetch / invalidate, deciding by
:mod:`.lifecycle_policy`) and :mod:`.observe` with the ``/kvstate`` page of
:mod:`.dashboard`. Workers learn which of them run through one handshake
(:mod:`.handshake`). None of them imports torch.
"""
