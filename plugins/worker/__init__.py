"""What runs inside each Dask worker process.

The ``kvstate`` worker plugin (:mod:`.plugin`) reads its settings once
(:mod:`.settings`) and owns one block store (:mod:`.block_store` with its
:mod:`.ledger`, over the zict tiers of :mod:`.tiers`, spilling in the format of
:mod:`.disk_format`) and one runtime per model (:mod:`.runtime`, the operators). A
runtime resolves refs into KV tensors (:mod:`.resolve`): hits, pulls from peers
(:mod:`.transport`, served by :mod:`.serve`) or recomputes, as :mod:`.placement` rules.
The other worker plugins are the halves of scheduler extensions: :mod:`.scheduling`,
:mod:`.lifecycle`, :mod:`.batching`; :mod:`.reporter` pushes stats for the dashboard.
"""
