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
