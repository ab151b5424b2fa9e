"""Quantile balancing under the layouts that split a step's tokens differently: the histogram
of required biases, the expert bias it sets and every gradient, moment and parameter equal
one process's (the equivalence matrix holds the option too, as a value of its "expert_bias"
factor, crossed with the other options; this file adds the layouts where the counts travel
furthest and the check that it catches counts reduced wrongly).

The cells use capacity 1 and micro-batches of 2 (4 per step and rank): the bias set after the
first step moves which tokens the second step's capacity keeps."""

from __future__ import annotations

import matrix_design as md
import pytest
from oracle import Case, check_cases

pytestmark = pytest.mark.multirank

QB = (*md.BASE, "moe.expert_bias_rate=0.0", "moe.route_with_bias=false",
      "moe.quantile_balancing=true", "moe.quantile_balancing_ema=0.5",
      "moe.capacity_factor=1.0", "train.micro_batch_size=2")  # fmt: skip


def test_quantile_balancing_equals_one_process_where_the_counts_travel() -> None:
    layouts = {
        "dp2 ZeRO-3": ("parallel.zero_stage=3",),
        "pp2 1f1b": ("parallel.pp=2", "parallel.pp_schedule=1f1b"),
        "ep2": ("parallel.ep=2",),
        "cp2": ("parallel.cp=2",),
    }
    check_cases(2, [Case(name, layout, QB) for name, layout in layouts.items()], md.STEPS,
                timeout=400)  # fmt: skip


def test_counts_averaged_like_the_bias_are_caught() -> None:
    case = Case("dp2, the histogram averaged over the ranks", ("parallel.zero_stage=0",), QB,
                fault=("plant", None, "quantile_counts_averaged"))  # fmt: skip
    with pytest.raises(AssertionError) as info:
        check_cases(2, [case], md.STEPS, timeout=300)
    message = str(info.value)
    for rank in (0, 1):
        report = message.split(f"averaged over the ranks (rank {rank})", 1)[1].split("\n\n")[0]
        assert "qb_hist" in report and "expert_bias" in report, report
