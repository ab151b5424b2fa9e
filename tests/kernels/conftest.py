"""Kernel tests: on a machine without CUDA, Triton kernels run under the CPU interpreter.

TRITON_INTERPRET must be set before any @triton.jit definition runs, i.e. before the
moetrain.kernels Triton modules are imported, hence at conftest import time.

On a GPU, MOETRAIN_TEST_AUTOTUNE=first (set by tools/gpu_suite.py) keeps only the first
autotune config of the grouped GEMM kernels per dtype class (a tensor-core tile for bf16, an
FMA tile for fp32): the tests' many small shapes would otherwise each tune every config,
minutes of compiling that prove nothing more about correctness.
The benchmarks check the tuned configs against torch._grouped_mm on the anchor shapes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif os.environ.get("MOETRAIN_TEST_AUTOTUNE", "full") == "first":
    from moetrain.kernels.grouped_gemm import triton_backend

    for _launcher in (triton_backend._fwd_launch, triton_backend._wgrad_launch):
        _launcher.configs = triton_backend.first_configs(_launcher.configs)  # no tuning
