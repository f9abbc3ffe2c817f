"""Attention and KV-cache kernels: torch references (CPU) and, later, Triton kernels (GPU)."""
