"""What the multi-rank harness's fork server imports once, before it forks any rank.

Imported by name in the server (``set_forkserver_preload``, tests/harness.py): torch, its
compiler stack (``torch._dynamo``, which torch's own ``manual_seed``, optimizers and
activation checkpointing import on first use) and its distributed packages -- about 4.5 s of
the 6 s of CPU a spawned rank spends importing. Each rank is then a fork of this process.

A fork is only well defined when the forked process has one thread (POSIX leaves the child
of a multi-threaded process undefined beyond async-signal-safe calls until it execs: a lock
or an allocator's arena held by a thread that does not exist in the child). So nothing here
may start a thread:

- numpy's OpenBLAS starts a worker thread when torch imports numpy; one BLAS thread
  (``OPENBLAS_NUM_THREADS=1`` while torch is imported here) starts none.
  Ranks compute with torch, whose intra-op pool the harness sets; numpy's BLAS in a rank is
  single-threaded.
- ``datasets`` starts pyarrow's jemalloc background thread on import. Nothing here imports
  it, and moetrain imports it only where it reads a split (a run over the default corpus's
  token cache never does): a rank that needs it imports it after the fork. An earlier fork
  server that preloaded it lost a rank to SIGABRT in 2 of 7 full runs.

``THREADS`` records how many threads the server had once the imports were done; ranks forked
from it check it is one before they run anything (``_entry`` in tests/harness.py).
"""

from __future__ import annotations

import os

_blas = os.environ.get("OPENBLAS_NUM_THREADS")
os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read once, when numpy loads OpenBLAS

import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401
import torch.distributed.checkpoint  # noqa: E402, F401
import torch.distributed.fsdp  # noqa: E402, F401
import torch.distributed.pipelining  # noqa: E402, F401
import torch.distributed.tensor  # noqa: E402, F401
import torch.utils.checkpoint  # noqa: E402, F401

del torch
if _blas is None:  # the server's environment as it was (each rank gets the caller's anyway)
    os.environ.pop("OPENBLAS_NUM_THREADS")
else:
    os.environ["OPENBLAS_NUM_THREADS"] = _blas


def thread_count() -> int:
    """This process's threads (Linux: /proc/self/task; elsewhere Python's own threads, the
    most the standard library can see)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


THREADS = thread_count()
