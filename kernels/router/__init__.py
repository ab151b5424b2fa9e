"""The top-k router: ``route`` and ``combine_weights`` (``moetrain.kernels``' contract,
docs/kernels.md), under one stem:

    reference.py        route_reference: the token-by-token loop the tests hold both backends to
    torch_backend.py    the unfused router (group-limited routing too), combine_weights
    triton_backend.py   the fused router: one forward and one backward kernel, RouteFunction

tests/kernels/test_kernels_router.py tests it; tools/bench_router.py measures it.
Nothing here imports triton: only triton_backend.py does, and the façade imports it lazily.
"""
