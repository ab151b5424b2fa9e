"""Token rows to expert-sorted rows and back: ``permute`` and ``unpermute``
(``moetrain.kernels``' contract, docs/kernels.md), under one stem:

    reference.py        permute_reference, unpermute_reference: per-token loops
    torch_backend.py    index_select / index_add autograd Functions
    triton_backend.py   the invert, gather, combine and row-dot kernels, their Functions

tests/kernels/test_kernels_permutation.py tests it; tools/bench_permutation.py measures it.
The stem is not ``permute``: a submodule of that name would replace the package's ``permute``
function with the module on import. Nothing here imports triton: only triton_backend.py does,
and the façade imports it lazily.
"""
