"""What tests, benchmarks and examples share: workflow shapes and workloads built from the public API."""
