"""What runs inside each Dask worker process.

The ``kvstate`` worker plugin (:mod:`.plugin`) owns one block store (:mod:`.block_store`
over the zict tiers of :mod:`.tiers`, spilling in the format of :mod:`.disk_format`)
and one runtime per model (:mod:`.runtime`), which resolves refs into KV tensors:
hits, pulls from peers (:mod:`.transport`) or recomputes. The other worker plugins are
the halves of scheduler extensions: :mod:`.scheduling`, :mod:`.lifecycle`,
:mod:`.batching`; :mod:`.reporter` pushes stats for the dashboard.
"""
