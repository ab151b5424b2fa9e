"""The grouped GEMM: ``grouped_mm`` and ``gather_grouped_mm`` (``moetrain.kernels``' contract,
docs/kernels.md), under one stem:

    reference.py        grouped_mm_reference, gather_grouped_mm_reference: the per-expert and
                        per-row loops the tests hold both backends to
    torch_backend.py    torch._grouped_mm where it applies, a per-expert loop elsewhere
    triton_backend.py   the Triton kernels (forward with an optional row gather, dgrad through
                        transposed strides, K-grouped wgrad), their launchers and Function
    mixed.py            forward, dgrad and wgrad on different backends (``moe.kernels: auto``)

tests/kernels/test_kernels_grouped_gemm.py tests it; tools/bench_grouped_gemm.py measures it.
Nothing here imports triton: only triton_backend.py does, and the façade imports it lazily.
"""
