"""The stateful graph compiler (installed as ``dask_kvstate.graph_opt``)."""
