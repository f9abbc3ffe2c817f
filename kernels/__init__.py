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

if __name__ == "kernels":
    # This folder installs as ``mmserve.kernels``. Imported as plain ``kernels`` it was found
    # only because a checkout's root is on ``sys.path`` (``python -m ...`` run there), and that
    # name belongs to Hugging Face's ``kernels`` package, which transformers imports: load that
    # one in this module's place. Where it is not installed this module stays, empty (older
    # transformers import what they find by that name to read its version, and must not fail).
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
