"""Attention and KV-cache kernels: torch references and compiled C++ kernels (CPU), Triton
kernels (GPU).

``paged_attention`` is the torch reference; the CPU runner uses it with the compiled kernels of
``cpu_ops`` (decode attention, and bfloat16 flash attention for prompt chunks) when they build.
``triton_kv_cache`` and ``triton_attention`` are the GPU kernels with the same contract, and
``triton_fused`` the GPU's fused norms, rotary embedding and activations (``fused`` picks a
tensor's: the CPU module's, Triton's, or torch's ops). The Triton kernels are imported only
where they are used, so that importing mmserve never imports Triton, and so that tests can
switch on Triton's CPU interpreter (``TRITON_INTERPRET=1``) before the kernels are defined.
"""
