"""`mmserve bench`: workloads, offline throughput, online serving load, parameter sweeps."""
