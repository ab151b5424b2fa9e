"""Repository-wide test setup.

``tests/`` goes on ``sys.path`` so that every test folder can ``from multirank import
run_ranks`` (the multi-rank harness, ``tests/multirank.py``). Others may append below.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

# Without CUDA, Triton kernels can only run under the CPU interpreter, and TRITON_INTERPRET
# must be set before any @triton.jit definition is imported: set it before any test module.
import os  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
