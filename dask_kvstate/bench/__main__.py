from dask_kvstate.bench.registry import main

if __name__ == "__main__":
    main()
