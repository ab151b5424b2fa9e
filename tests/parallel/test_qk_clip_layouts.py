"""QK-clip under layouts that shard the projections it rescales, and its layout check can fail.

The equivalence matrix runs QK-clip as a value of its "qk_clip" factor under every layout
(each option value meets every layout in CI: ``value_rows``), comparing each attention
layer's largest logit, every gradient, moment and parameter with one process. Here: the
compositions where the rescaled rows are split twice (FSDP2's ZeRO-3 shards of tensor-parallel
blocks, multi-head latent attention's per-head rows under tp x cp), and a realistic bug planted
in the reduction of the maxima (tests/faults.py ``qk_clip_local_maxima``: each rank rescales
from the tokens it saw), which the same comparison must name."""

from __future__ import annotations

import matrix_design as md
import pytest
from oracle import Case, caught_reports, check_cases

pytestmark = pytest.mark.multirank

QK = (*md.BASE, "optim.qk_clip=0.03")  # some heads of every kind rescaled (matrix_options)
MLA = ("model.attention=mla", "model.q_lora_rank=24", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16")  # fmt: skip


@pytest.mark.slow
def test_rescaled_shards_equal_one_process_on_four_ranks() -> None:
    cases = [
        Case("dp2 x tp2 SP zero3, q/k biases", ("parallel.tp=2", "parallel.sequence_parallel=true",
             "parallel.zero_stage=3"), (*QK, "model.qkv_bias=true")),
        Case("cp2 x tp2, MLA, Muon", ("parallel.tp=2", "parallel.cp=2"),
             (*QK, *MLA, "optim.name=muon", "optim.muon_ns_dtype=fp32")),
    ]  # fmt: skip
    check_cases(4, cases, md.STEPS, timeout=600)


def test_maxima_left_unreduced_are_caught() -> None:
    case = Case("dp2, each rank's own maxima", ("parallel.zero_stage=0",), QK,
                fault=("plant", None, "qk_clip_local_maxima"))  # fmt: skip
    for report in caught_reports(2, case, md.STEPS, timeout=300):
        assert "max logit" in report and "attention.wq" in report, report
