"""Repository-wide test setup.

``tests/`` goes on ``sys.path`` so that every test folder can ``from multirank import
run_ranks`` (``tests/multirank.py``: the multi-rank harness, the micro model and the oracle,
from tests/harness.py, micro.py, tolerances.py and oracle.py). Others may append below.

A test marked ``thread_counts`` runs once under each of ``threads.THREAD_COUNTS`` (one
intra-op thread and the default): its verdict must not depend on the machine's thread count.
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
import random  # noqa: E402
import zlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from threads import THREAD_COUNTS, threads  # noqa: E402 - reads the default thread count now

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser, pluginmanager):  # noqa: ANN001 - pytest's hook signature
    """pyproject.toml's addopts ask pytest-xdist (in ``[test]``) for a worker per CPU. Without
    it (not installed, or ``-p no:xdist``) its options are accepted here and the tests run in
    one process, as the header says, instead of pytest refusing ``-n``."""
    if pluginmanager.hasplugin("xdist"):
        return
    group = parser.getgroup("xdist absent")
    # _addoption: pytest keeps lowercase short options for itself (xdist adds -n the same way)
    group._addoption("-n", "--numprocesses", dest="numprocesses", default=None,
                     help="ignored: pytest-xdist is not installed (pip install -e '.[test]')")
    group.addoption("--maxprocesses", dest="maxprocesses", default=None, help="ignored")
    group.addoption("--dist", dest="dist", default="no", help="ignored")


def pytest_report_header(config):  # noqa: ANN001 - pytest's hook signature
    if not config.pluginmanager.hasplugin("xdist"):
        return ("pytest-xdist is not installed (or -p no:xdist): the tests run in this one "
                "process; pip install -e '.[test]' runs a worker per CPU")  # fmt: skip
    return None


def pytest_generate_tests(metafunc):  # noqa: ANN001 - pytest's hook signature
    """``thread_counts`` tests: parametrized by the ambient thread count (``ambient_threads``)."""
    if metafunc.definition.get_closest_marker("thread_counts") is None:
        return
    metafunc.fixturenames.append("ambient_threads")
    metafunc.parametrize("ambient_threads", THREAD_COUNTS, indirect=True,
                         ids=[f"{n} thread{'s' * (n > 1)}" for n in THREAD_COUNTS])  # fmt: skip


@pytest.fixture
def ambient_threads(request):  # noqa: ANN001, ANN201 - pytest's fixture signature
    """The test runs with torch's intra-op thread count (and ``OMP_NUM_THREADS`` for what it
    starts) set to the parameter, restored after."""
    with threads(request.param):
        yield request.param


def pytest_collection_modifyitems(config, items):  # noqa: ANN001 - pytest's hook signature
    """``exhaustive`` tests (the full equivalence matrix, about an hour on two cores) run
    only when asked for: ``-m slow`` or ``-m exhaustive`` (``tests/selection.py``). The
    default run, the README's test command and CI, has the matrix's covering design instead
    (tests/parallel/test_matrix.py)."""
    from selection import asks_for_exhaustive

    _longest_files_first(items)
    if asks_for_exhaustive(config):
        return
    keep = [i for i in items if i.get_closest_marker("exhaustive") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


LONGEST_FILES = (
    "tests/parallel/test_matrix.py",
    "tests/tools/test_gpu_suite.py",
    "tests/test_readme_chain.py",
    "tests/train/test_resilience.py",
)
"""The test files that take longest on two cores (about 17, 4, 3 and 3 minutes of a
32-minute run), run first. xdist hands whole files to its workers (``--dist loadfile``) in
collection order: a long file collected last ran alone at the end while the other worker
idled. Longest first, the last files to finish are short ones."""


def _longest_files_first(items) -> None:  # noqa: ANN001 - pytest's items
    def rank(item) -> int:  # noqa: ANN001
        path = item.nodeid.split("::")[0]
        return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):  # noqa: ANN001 - pytest's hook signature
    """Every test starts from the same random state, whichever tests ran before it in this
    process: xdist hands files to workers in an order that varies from run to run, and a
    test (or a module fixture, set up here too) drawing from the global generators would
    otherwise get different numbers on each run, and a different verdict where a tolerance is
    close. torch's, numpy's and ``random``'s generators are seeded from the test's id."""
    seed = zlib.crc32(item.nodeid.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
