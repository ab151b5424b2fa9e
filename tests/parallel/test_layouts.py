"""Every parallel layout reproduces the single-process run of the micro MoE.

The oracle (``check_cases`` in tests/multirank.py): ``micro_run`` trains the micro MoE for
``STEPS`` fp32 steps on the same global batches, in one process and under each layout. On
every rank, the layout must agree with one process on the losses, the gradient norm, every
MoE layer's aux / seq-aux / z losses, router entropy, token counts, drops and expert bias,
every parameter's gradient at every step (gathered to full size, before clipping), AdamW's
two moments after the last step and every final parameter; and the layout must really have
run (``expected_layout``: DTensor placements under tp, FSDP units and resharding under
ZeRO-2/3, ZeRO-1 shards, pipeline stages and schedule, checkpoint wrappers, experts per
rank, and traffic on each parallel axis). Tolerances: ``VALUE_TOL``, ``PARAM_TOL`` and
``GRAD_TOL`` of tests/multirank.py, stated there once with what was measured.

Several layouts share one spawned job (one process group, a fresh Trainer per layout) to
keep the suite inside its time budget on two cores. Every option of the model and the
router is crossed with these layouts in tests/parallel/test_matrix.py.
"""

from __future__ import annotations

import pytest
from multirank import Case, check_cases, check_reshards

STEPS = 3


def _cases(layouts: dict[str, list[str]], **options: list[str]) -> list[Case]:
    return [
        Case(name, tuple(overrides), tuple(options.get(name, ())))
        for name, overrides in layouts.items()
    ]


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_each_axis_alone_on_two_ranks() -> None:
    layouts = {
        "dp=2 zero0": ["parallel.zero_stage=0"],
        "dp=2 zero1": ["parallel.zero_stage=1"],
        "dp=2 zero2 + full AC": [
            "parallel.zero_stage=2",
            "parallel.activation_checkpointing=full",
        ],
        "dp=2 zero3": ["parallel.zero_stage=3"],
        "tp=2": ["parallel.tp=2"],
        "tp=2 + SP + selective AC": [
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.activation_checkpointing=selective",
        ],
        "pp=2 gpipe": ["parallel.pp=2", "parallel.pp_schedule=gpipe"],
        "pp=2 1f1b, 4 pipeline micro-batches of 2 (one process: 2 of 4)": [
            "parallel.pp=2",
            "parallel.pp_schedule=1f1b",
            "parallel.pp_microbatches=4",
        ],
        "pp=2 interleaved_1f1b v=2": ["parallel.pp=2", "parallel.pp_virtual_stages=2"],
        "pp=2 zero_bubble v=2": [
            "parallel.pp=2",
            "parallel.pp_schedule=zero_bubble",
            "parallel.pp_virtual_stages=2",
        ],
        "pp=2 looped_bfs v=2": [
            "parallel.pp=2",
            "parallel.pp_schedule=looped_bfs",
            "parallel.pp_virtual_stages=2",
        ],
        "pp=2 zbv (V placement)": [
            "parallel.pp=2",
            "parallel.pp_schedule=zbv",
            "parallel.pp_virtual_stages=2",
        ],
        "pp=2 dualpipev (V placement), 4 pipeline micro-batches of 2 (one process: 2 of 4)": [
            "parallel.pp=2",
            "parallel.pp_schedule=dualpipev",
            "parallel.pp_virtual_stages=2",
            "parallel.pp_microbatches=4",
        ],
        "pp=2 1f1b, 2 depth-first passes of 2 micro-batches of 2 (one process: 2 of 4)": [
            "parallel.pp=2",
            "parallel.pp_schedule=1f1b",
            "parallel.pp_microbatches=4",
            "parallel.depth_first_micro_batches=2",
        ],
        "dp=2 zero2, breadth-first: 2 forwards then their backwards": [
            "parallel.zero_stage=2",
            "parallel.breadth_first_micro_batches=2",
        ],
    }
    # parallel.pp_microbatches re-cuts the pipeline's micro-batches: the reference
    # accumulates 2 micro-batches of 4 sequences, the pipeline 4 of 2; token groups of 2
    # sequences keep routing, capacity and the balancing losses the same.
    options = {
        name: ["train.micro_batch_size=4"] for name in layouts if "(one process: 2 of 4)" in name
    }
    check_cases(2, _cases(layouts, **options), STEPS, timeout=380)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_axis_compositions_on_four_ranks() -> None:
    layouts = {
        "dp x tp = 2x2, zero2, SP": [
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.zero_stage=2",
        ],
        "pp x dp = 2x2, zero1": ["parallel.pp=2", "parallel.zero_stage=1"],
        "pp x dp = 2x2, zero3": ["parallel.pp=2", "parallel.zero_stage=3"],
        "hybrid dp_replicate x dp_shard = 2x2, zero3": [
            "parallel.dp_replicate=2",
            "parallel.zero_stage=3",
        ],
        "hybrid dp_replicate x dp_shard = 2x2, zero1": [
            "parallel.dp_replicate=2",
            "parallel.zero_stage=1",
        ],
    }
    check_cases(4, _cases(layouts), STEPS, timeout=380)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_three_axes_pp_dp_tp_on_eight_ranks() -> None:
    layouts = {
        "pp x dp x tp = 2x2x2, zero3, SP, interleaved v=2": [
            "parallel.pp=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.zero_stage=3",
            "parallel.pp_virtual_stages=2",
        ],
    }
    check_cases(8, _cases(layouts), STEPS, timeout=380)


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_checkpoint_saved_under_one_layout_loads_under_another() -> None:
    """dp=4 with ZeRO-1 saves after 2 steps; pp=2 x tp=2 (+SP) loads it and takes the third
    step: the same loss, gradients, optimizer moments and parameters as three uninterrupted
    single-process steps."""
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
        timeout=380,
    )


# ----------------------------------------------------------------------------- bf16

# Dense routing (every token to all 4 experts, no capacity) for the bf16 layouts: with
# top_k < E a 1-ulp bf16 difference flips near-tied expert choices, which changes those
# tokens' expert gradients wholesale and would say nothing about precision. Top-k routing
# itself is proven under every layout in fp32.
BF16 = ("train.dtype=bf16", "moe.top_k=4", "moe.capacity_factor=null")


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_bf16_under_zero3_and_tp_matches_one_bf16_process() -> None:
    """bf16 autocast with fp32 master weights: dp=2 with ZeRO-3 (FSDP2 MixedPrecisionPolicy,
    bf16 all-gathers, fp32 reduce-scatters) and tp=2 against one bf16 process, with the bf16
    row of TOLERANCES."""
    layouts = {
        "bf16 dp=2 zero3": ["parallel.zero_stage=3"],
        "bf16 tp=2 + SP": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    }
    check_cases(
        2,
        [Case(n, tuple(o), BF16) for n, o in layouts.items()],
        STEPS,
        timeout=380,
    )
