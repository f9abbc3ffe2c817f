"""Attention and KV-cache kernels: torch references and a compiled decode kernel (CPU), Triton
kernels (GPU).

``paged_attention`` is the torch reference; the CPU runner uses it with the compiled decode
attention of ``cpu_ops`` (``cpu_decode_attention.cpp``) when that builds. ``triton_kv_cache`` and
``triton_attention`` are the GPU kernels with the same contract; they are imported only where
they are used, so that importing mmserve never imports Triton, and so that tests can switch on
Triton's CPU interpreter (``TRITON_INTERPRET=1``) before the kernels are defined.
"""
