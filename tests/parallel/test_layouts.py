"""Every parallel layout reproduces the single-process run of the micro MoE.

The oracle (``check_cases`` in tests/multirank.py): ``micro_run`` trains the micro MoE for
``STEPS`` fp32 steps on the same global batches, in one process and under each layout. On
every rank, the layout must agree with one process on the losses, the gradient norm, every
MoE layer's aux / seq-aux / z losses, router entropy, token counts, drops and expert bias,
every parameter's gradient at every step (gathered to full size, before clipping), AdamW's
two moments after the last step and every final parameter; and the layout must really have
run (``expected_layout``: DTensor placements under tp, FSDP units and resharding under
ZeRO-2/3, ZeRO-1 shards, pipeline stages and schedule, checkpoint wrappers, experts per
rank, and traffic on each parallel axis). Tolerances: ``TOLERANCES`` of
tests/multirank.py, per dtype, stated there once with what was measured.

Every layout, crossed with every option of the model and the router, runs in the
equivalence matrix (tests/parallel/test_matrix.py, docs/matrix.md). This file holds what the
matrix does not: a checkpoint saved under one layout and resumed under another (bf16 under
every layout: tests/parallel/test_bf16_layouts.py).
"""

from __future__ import annotations

import pytest
from multirank import check_reshards

STEPS = 3


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_saved_under_one_layout_loads_under_another() -> None:
    """dp=4 with ZeRO-1 saves after 2 steps; pp=2 x tp=2 (+SP) loads it and takes the third
    step: the same loss, gradients, optimizer moments and parameters as three uninterrupted
    single-process steps. And across pipeline splits on 2 ranks: uneven stages (3 + 1
    layers) resumed as equal ones, and equal interleaved stages resumed in DualPipe-V's V
    with stages of 1, 2, 1 and 0 layers (each layer's parameters and moments move to
    another rank or chunk)."""
    check_reshards(
        2,
        [
            (
                "pp=2 1f1b stages of 3 + 1 layers -> pp=2 1f1b equal stages",
                ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_stage_layers=[3,1]"],
                ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
            ),
            (
                "pp=2 interleaved equal stages -> pp=2 dualpipev stages of 1, 2, 1, 0 layers",
                ["parallel.pp=2", "parallel.pp_virtual_stages=2"],
                [
                    "parallel.pp=2",
                    "parallel.pp_schedule=dualpipev",
                    "parallel.pp_virtual_stages=2",
                    "parallel.pp_microbatches=4",
                    "parallel.pp_stage_layers=[1,2,1,0]",
                ],
            ),
        ],
        STEPS,
        timeout=280,
    )
    check_reshards(
        4,
        [
            (
                "dp=4 zero1 -> pp=2 x tp=2 + SP",
                ["parallel.zero_stage=1"],
                ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
            )
        ],
        STEPS,
        timeout=300,
    )
