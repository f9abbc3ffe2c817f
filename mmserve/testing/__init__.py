"""Helpers for building tiny offline checkpoints used by tests and benchmarks."""
