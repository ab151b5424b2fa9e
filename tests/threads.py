"""Thread settings of the tests that compare two computations exactly.

The same fp32 computation differs in its last bits with torch's intra-op thread count: its CPU
GEMMs and reductions block their sums by threads, and how depends on the machine (a replay on
one thread of a run on two gave first-step gradients 5.2e-7 apart on a 2-core Intel Xeon and 0
apart on an AMD EPYC). A test that asserts two computations equal therefore runs both under
the same settings, ``one_thread()``: every rank of a multi-rank test, the single-process
references, the runs they are compared with and the oracle's step-by-step replays compute on
``ORACLE_THREADS`` intra-op threads, whatever the machine's core count or the caller's
setting.

``THREAD_COUNTS`` are the settings a test marked ``thread_counts`` runs under (tests/conftest.py
parametrizes it): one thread and more than one, so that CI sees on every run that its verdict
does not depend on the thread count.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

ORACLE_THREADS = 1
"""Intra-op threads of every computation an exact comparison reads (one fixed summation
order on any machine; tiny ops gain nothing from a second thread on a busy machine)."""

DEFAULT_THREADS = torch.get_num_threads()
"""torch's default in this process, read at import (before any test changed it)."""

THREAD_COUNTS = (1, max(2, DEFAULT_THREADS))
"""The ambient thread counts a ``thread_counts`` test runs under: one, and the default (at
least two, so that a one-core machine still checks a multi-threaded setting)."""


@contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` (and ``OMP_NUM_THREADS`` for the processes
    started inside), restored after."""
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


def one_thread() -> AbstractContextManager[None]:
    """``threads(ORACLE_THREADS)``: the setting of both sides of every exact comparison."""
    return threads(ORACLE_THREADS)
