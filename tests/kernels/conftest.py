"""Kernel tests: on a machine without CUDA, Triton kernels run under the CPU interpreter.

TRITON_INTERPRET must be set before any @triton.jit definition runs, i.e. before the
moetrain.kernels Triton modules are imported, hence at conftest import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
