"""Request state, cache bookkeeping and scheduling: ids, counts and hashes, never tensors."""
