"""What a multi-rank or layout test imports: ``from multirank import run_ranks, micro_run, ...``.

The pieces live in modules of one responsibility each (``tests/conftest.py`` puts ``tests/``
on ``sys.path``):

- tests/harness.py: the process harness -- ``run_ranks`` runs a function on N spawned CPU
  processes with gloo, ``RankFailure`` reports the failing rank with its output;
- tests/micro.py: the micro MoE (``MICRO``, ``micro_config``) and the runs whose reports the
  oracle compares (``micro_run``, ``reshard_run``);
- tests/tolerances.py: the oracle's tolerances, stated once per dtype (``TOLERANCES``,
  ``VALUE_TOL``, ``PARAM_TOL``, ``GRAD_TOL``, ``CLAMPED``, ``noise_floor_slack``);
- tests/oracle.py: the comparisons -- ``compare_runs``, ``reference_run``,
  ``anchored_compare``, the layout cells (``Case``, ``check_cases``) and the resumes
  (``compare_resumed``, ``check_reshards``).

Each of them imports only those above it in this list (and tests/threads.py,
tests/layout_facts.py, tests/divergence.py); this module re-exports them, so a test needs
one import whatever moves between them.
"""

from __future__ import annotations

from harness import PG_TIMEOUT_S, RankFailure, run_ranks
from layout_facts import expected_layout
from micro import MICRO, micro_config, micro_run, reshard_run
from oracle import (
    ANCHORED_PARAM_TOL,
    LAYOUT_STATS,
    PER_CALL_STATS,
    Case,
    _cases_worker,  # noqa: F401 - tests/parallel/test_bf16_layouts.py runs the cells itself
    _plant,  # noqa: F401 - and plants their faults (mr._plant)
    anchored_compare,
    anchored_run,
    case_failures,
    check_cases,
    check_reshards,
    compare_resumed,
    compare_runs,
    reference_run,
    scale_grads,
)
from tolerances import (
    BF16_MOMENTS,
    CLAMPED,
    GRAD_TOL,
    PARAM_TOL,
    TOLERANCES,
    VALUE_TOL,
    bf16_reordered,
    noise_floor_slack,
    tolerances,
)

__all__ = [
    "ANCHORED_PARAM_TOL",
    "BF16_MOMENTS",
    "CLAMPED",
    "GRAD_TOL",
    "LAYOUT_STATS",
    "MICRO",
    "PARAM_TOL",
    "PER_CALL_STATS",
    "PG_TIMEOUT_S",
    "TOLERANCES",
    "VALUE_TOL",
    "Case",
    "RankFailure",
    "anchored_compare",
    "anchored_run",
    "case_failures",
    "bf16_reordered",
    "check_cases",
    "check_reshards",
    "compare_resumed",
    "compare_runs",
    "expected_layout",
    "micro_config",
    "micro_run",
    "noise_floor_slack",
    "reference_run",
    "reshard_run",
    "run_ranks",
    "scale_grads",
    "tolerances",
]
