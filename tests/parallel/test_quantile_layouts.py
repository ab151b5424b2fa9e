"""Quantile balancing's layout check can fail: a histogram reduced wrongly is caught.

The equivalence matrix runs quantile balancing as a value of its "expert_bias" factor under
every layout (each option value meets every layout in CI: ``value_rows``), comparing the
histogram of required biases, the expert bias it sets and every gradient, moment and
parameter with one process. Here a realistic bug is planted in that reduction (tests/faults.py
``quantile_counts_averaged``: the histogram divided by the data-parallel ranks like the
expert bias beside it) and the same comparison must name the histogram and the bias.

The cell uses capacity 1 and micro-batches of 2 (4 per step and rank): the bias set after the
first step moves which tokens the second step's capacity keeps."""

from __future__ import annotations

import matrix_design as md
import pytest
from oracle import Case, caught_reports

pytestmark = pytest.mark.multirank

QB = (*md.BASE, "moe.expert_bias_rate=0.0", "moe.route_with_bias=false",
      "moe.quantile_balancing=true", "moe.quantile_balancing_ema=0.5",
      "moe.capacity_factor=1.0", "train.micro_batch_size=2")  # fmt: skip


def test_counts_averaged_like_the_bias_are_caught() -> None:
    case = Case("dp2, the histogram averaged over the ranks", ("parallel.zero_stage=0",), QB,
                fault=("plant", None, "quantile_counts_averaged"))  # fmt: skip
    for report in caught_reports(2, case, md.STEPS, timeout=300):
        assert "qb_hist" in report and "expert_bias" in report, report
