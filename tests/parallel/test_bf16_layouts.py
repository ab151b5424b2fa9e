"""bf16 under every layout reproduces one bf16 process, as fp32 does.

One compute-dtype policy (``moetrain.model.precision``) for one process and every layout:
the same tensors rounded to bf16 at the same places. A layout whose bf16 roundings are one
process's (data parallelism, ZeRO 0-3 through FSDP2's mixed precision, HSDP, pipelines at
the same micro-batches) then agrees with it as an fp32 layout does: the "bf16" row of
``TOLERANCES`` is the fp32 row. A layout that rounds other partial results (tp, ep, cp, a
pipeline's other micro-batch size: ``bf16_reordered`` of tests/multirank.py) agrees up to
that rounding: "bf16 reordered". Both rows state what was measured.

Routing is dense here (every token to all 4 experts, no capacity): with top-k < E a 1-ulp
difference of a "bf16 reordered" layout can flip a near-tied expert choice, which changes
that token's expert gradients wholesale and says nothing about precision (top-k routing
is proven under every layout in fp32 by the matrix; under the "bf16" layouts the forward
is one process's bit for bit, so routing is too).
"""

from __future__ import annotations

import pytest
from matrix_design import BASE, LAYOUTS
from multirank import (
    Case,
    _cases_worker,
    case_failures,
    check_cases,
    expected_layout,
    reference_run,
    run_ranks,
)

STEPS = 2
BF16 = (*BASE, "train.dtype=bf16", "moe.top_k=4", "moe.capacity_factor=null")

CI_LAYOUTS = (
    "dp2 zero1",
    "dp2 zero3",
    "tp2 SP",
    "pp2 1f1b",
    "ep2 all_to_all",
    "cp2",
)
"""One layout of each axis in CI; every layout under ``-m exhaustive`` (or ``-m slow``)."""

OLD_BF16_ROW = {"value": {"atol": 5e-3, "rtol": 5e-3}, "grad": {"first": 0.05, "later": 0.1},
                "param": {"atol": 1.5e-2, "rtol": 0.0}, "hist": {"moved": 0.02}}  # fmt: skip
"""The single bf16 row of ``TOLERANCES`` before the compute-dtype policy (FSDP2 rounded the
embeddings and norm weights, one process did not; every layout shared that row)."""


def _cases(names) -> list[Case]:
    return [Case(f"bf16 {layout.name}", layout.overrides, BF16) for layout in LAYOUTS
            if layout.name in names]  # fmt: skip


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("fp8", ["none", "tensorwise", "rowwise"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_bf16_under_every_layout_matches_one_bf16_process(world: int, fp8: str) -> None:
    """Every layout of the equivalence matrix (tests/parallel/matrix_design.py) in bf16, and
    with each FP8 recipe: the measurement behind the bf16 rows of ``TOLERANCES``."""
    names = [layout.name for layout in LAYOUTS if layout.world == world]
    cases = [Case(c.name, c.layout, (*c.options, f"train.fp8={fp8}")) for c in _cases(names)]
    check_cases(world, cases, STEPS, timeout=2900)


FAULT = Case("bf16 dp2 zero3, root gathered in bf16", ("parallel.zero_stage=3",), BF16,
             fault=("plant", None, "fsdp_root_in_bf16"))  # fmt: skip
"""tests/faults.py ``fsdp_root_in_bf16``: ZeRO-3 gathers the embeddings, final norm and head
in bf16, as before the policy."""


def _under_both_rows(got: dict, ref: dict, rank: int) -> list[str | None]:
    """The fault's run compared with one process under the "bf16" row and under the old one:
    the assertion message of each (None: it passed)."""
    import multirank as mr

    assert got["dtype"] == "bf16", got["dtype"]  # the row of layouts that round as one process
    out = []
    for row in (mr.TOLERANCES["bf16"], {**mr.TOLERANCES["bf16"], **OLD_BF16_ROW}):
        mr.TOLERANCES["bf16"], saved = row, mr.TOLERANCES["bf16"]
        try:
            mr.compare_runs(got, ref, what=f"rank {rank}")
            out.append(None)
        except AssertionError as e:
            out.append(str(e))
        finally:
            mr.TOLERANCES["bf16"] = saved
    return out


@pytest.fixture(scope="module")
def ci_job() -> tuple[list[Case], list[list[dict]]]:
    """One spawned job on 2 ranks: one layout of each axis, FP8 rowwise on bf16 under ZeRO-3
    (before the policy its first step's drops differed from one process's by 3.6%) and
    under tp, and the planted fault (the last case)."""
    fp8 = (*BF16, "train.fp8=rowwise")
    cases = [*_cases(CI_LAYOUTS),
             Case("bf16 + FP8 rowwise dp2 zero3", ("parallel.zero_stage=3",), fp8),
             Case("bf16 + FP8 rowwise tp2 SP", ("parallel.tp=2", "parallel.sequence_parallel=true"),
                  fp8), FAULT]  # fmt: skip
    refs = {c.options: reference_run(c.options, STEPS) for c in cases}
    wants = [[expected_layout([*c.options, *c.layout], 2, r) for r in range(2)] for c in cases]
    # _cases_worker: a run beyond the whole-run tolerances comes back whole (``got``), for
    # the verdict to replay step by step.
    return cases, run_ranks(_cases_worker, 2, cases, refs, STEPS, wants, timeout=580)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_bf16_under_each_axis_matches_one_bf16_process(ci_job) -> None:
    """Each case against one bf16 process with its row, on every rank: its layout facts and
    its numbers (``case_failures``, the verdict of ``check_cases``: a run beyond the
    whole-run tolerances is replayed step by step, which decides)."""
    cases, results = ci_job
    failures = case_failures(cases[:-1], [r[:-1] for r in results], STEPS)
    assert not failures, "\n\n".join(failures)
    assert [res["name"] for res in results[0]] == [c.name for c in cases]


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_fsdp_root_in_bf16_is_caught_now_and_was_not_before(ci_job) -> None:
    """The planted fault, judged as the test above judges every case: its layout is right
    and its numbers are not -- the verdict names the first step's diverging gradients, the
    step-by-step replay included; the single bf16 row of before let every difference pass."""
    cases, results = ci_job
    failures = case_failures(cases[-1:], [r[-1:] for r in results], STEPS)
    assert len(failures) == 2, failures  # both ranks
    for rank, (failure, r) in enumerate(zip(failures, results, strict=True)):
        res = r[-1]
        assert failure.startswith(f"{FAULT.name} (rank {rank}):"), failure
        assert not res["problems"], res["problems"]  # the layout facts cannot see it
        assert "grad[step 0 " in res["trajectory"], res["trajectory"]
        assert "anchored at step 0" in failure, failure
        ref = reference_run(FAULT.options, STEPS)
        now, before = _under_both_rows(res["got"], ref, rank)
        assert now is not None and "grad[step 0 " in now, (rank, now)
        assert before is None, (rank, before)
