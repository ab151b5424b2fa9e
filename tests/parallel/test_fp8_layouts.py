"""FP8 scales come from whole tensors under every layout, and the oracle sees when they do not.

The equivalence matrix crosses ``train.fp8`` with every layout (its ``fp8`` factor,
tests/parallel/matrix_options.py) within the ``FP8`` tolerance of tests/multirank.py. Here
the same comparison catches the bug that tolerance must not hide: scales computed from each
rank's slice -- a tensor-parallel weight shard, a row-parallel input split by feature, an
expert-TP slice of the FFN width -- instead of the whole tensor (``fp8_local_amax`` of
tests/faults.py); the same cells without it pass, ``train.fp8_experts=false`` among them.
"""

from __future__ import annotations

import matrix_design as md
import pytest
from multirank import Case, check_cases

TP_SP = ("parallel.tp=2", "parallel.sequence_parallel=true")
EXPERT_TP = ("parallel.tp=2",)  # expert TP (the default): every expert's FFN width split
# Planted under tensorwise: rowwise's scales are powers of two, and a slice's scale differs
# from the whole tensor's by a power of two, which moves no FP8 value above the subnormals --
# the same bug is (nearly) harmless there, and the rowwise cells pass with it.
PLANTED = [
    ("tp2 SP, FP8 tensorwise", TP_SP, ("train.fp8=tensorwise",)),
    ("tp2 expert TP, FP8 tensorwise", EXPERT_TP, ("train.fp8=tensorwise",)),
]
CONTROLS = [
    *PLANTED,
    ("tp2 SP, FP8 rowwise", TP_SP, ("train.fp8=rowwise",)),
    ("ep2, FP8 rowwise, dense layers only", ("parallel.ep=2",),
     ("train.fp8=rowwise", "train.fp8_experts=false")),
]  # fmt: skip


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_scales_from_one_ranks_slice_are_caught_and_whole_tensor_scales_pass() -> None:
    fault = ("plant", None, "fp8_local_amax")
    cases = [
        Case(f"{name}, local amax", layout, (*md.BASE, *opts), fault=fault)
        for name, layout, opts in PLANTED
    ] + [Case(name, layout, (*md.BASE, *opts)) for name, layout, opts in CONTROLS]
    with pytest.raises(AssertionError) as info:
        check_cases(2, cases, md.STEPS, timeout=580)
    message = str(info.value)
    for name, _, _ in PLANTED:
        for rank in (0, 1):
            planted = f"{name}, local amax (rank {rank})"
            assert planted in message, message
            # The first step's numbers already differ, far beyond the FP8 tolerance.
            report = message.split(planted, 1)[1].split("\n\n", 1)[0]
            assert "diverge from step 0" in report, report
    for name, _, _ in CONTROLS:
        for rank in (0, 1):
            assert f"{name} (rank {rank})" not in message, message
