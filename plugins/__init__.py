"""Worker and scheduler plugins (installed as ``dask_kvstate.plugins``)."""
