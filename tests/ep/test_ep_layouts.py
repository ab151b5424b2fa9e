"""Expert parallelism through the real trainer and engine reproduces the single-process run.

The oracle of tests/parallel/test_layouts.py (``check_cases`` / ``check_reshards`` in
tests/multirank.py): the micro MoE (4 MoE layers of 4 experts, top-2, capacity 1.0 with
token groups of 2 sequences, a shared expert, the expert-bias update, gradient clipping),
``STEPS`` fp32 steps in one process and under each layout; on every rank the layout must
agree with one process on losses, MoE statistics, every gradient (experts gathered over EP
and expert TP), AdamW's moments and every final parameter, and it must have run as asked
(E / ep experts per rank, the EP dispatcher, bytes sent between EP ranks). Tolerances: the
fp32 row of ``TOLERANCES`` in tests/multirank.py.

Several layouts share one spawned job (one process group, a fresh Trainer per layout) to
keep the folder inside its time budget on two cores.
"""

from __future__ import annotations

import pytest
from multirank import Case, check_cases, check_reshards

STEPS = 3
# Smaller than the layout tests' micro model (time budget): 4 layers stay, so that pp=2 with
# two virtual stages (interleaved 1F1B) has a layer per chunk.
SMALL = ("model.dim=32", "model.ffn_dim=64", "moe.expert_ffn_dim=32", "data.seq_len=16")


def check(
    world_size: int,
    layouts: dict[str, list[str]],
    timeout: float,
    reshard: dict[str, tuple[list[str], list[str]]] | None = None,
) -> None:
    check_cases(
        world_size,
        [Case(name, tuple(o), SMALL) for name, o in layouts.items()],
        STEPS,
        timeout=timeout,
    )
    if reshard:
        cases = [(name, s, ld) for name, (s, ld) in reshard.items()]
        check_reshards(world_size, cases, STEPS, timeout=timeout, options=SMALL)


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_ep2_with_each_zero_stage_and_reshard_to_ep1() -> None:
    """dp = ep = 2 under ZeRO 0-3 (experts outside FSDP / the ZeRO-1 shards); a checkpoint
    saved under ep=2 (ZeRO-1) resumes under ep=1 (dp=2, ZeRO-3)."""
    check(
        2,
        {
            "ep=2 zero0": ["parallel.ep=2", "parallel.zero_stage=0"],
            "ep=2 zero1": ["parallel.ep=2", "parallel.zero_stage=1"],
            "ep=2 zero2 all_gather": [
                "parallel.ep=2",
                "parallel.zero_stage=2",
                "parallel.ep_dispatcher=all_gather",
            ],
            "ep=2 zero3 + full AC": [
                "parallel.ep=2",
                "parallel.zero_stage=3",
                "parallel.activation_checkpointing=full",
            ],
        },
        timeout=380,
        reshard={
            "ep=2 zero1 -> ep=1 zero3": (
                ["parallel.ep=2", "parallel.zero_stage=1"],
                ["parallel.ep=1", "parallel.zero_stage=3"],
            ),
        },
    )


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_ep4_and_ep2_composed_with_tp_pp_edp_on_four_ranks() -> None:
    check(
        4,
        {
            "ep=4 (dp=4) zero0": ["parallel.ep=4"],
            "dp=4 ep=2 (edp=2) zero1": ["parallel.ep=2", "parallel.zero_stage=1"],
            "dp=4 ep=2 (edp=2) zero3": ["parallel.ep=2", "parallel.zero_stage=3"],
            "ep=2 x tp=2 + SP": [
                "parallel.ep=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ],
            "ep=2 x tp=2 expert_tp zero2": [
                "parallel.ep=2",
                "parallel.tp=2",
                "parallel.expert_tp=true",
                "parallel.zero_stage=2",
            ],
            "ep=2 x pp=2 interleaved_1f1b v=2": [
                "parallel.ep=2",
                "parallel.pp=2",
                "parallel.pp_virtual_stages=2",
            ],
        },
        timeout=380,
    )


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ep_on_eight_ranks_and_reshard_ep2_to_ep4() -> None:
    """ep=4 x tp=2 (the tiny_ep.yaml layout) and pp=2 x ep=2 x tp=2 with ZeRO-1; checkpoints
    saved under pp=2 x ep=2 x tp=2 and under dp=4 x ep=2 x tp=2 with expert TP (experts
    sharded over ep and tp) resume under ep=4 x tp=2 and under ep=1 x tp=2."""
    check(
        8,
        {
            "ep=4 x tp=2": ["parallel.ep=4", "parallel.tp=2"],
            "pp=2 x ep=2 x tp=2 zero1 interleaved v=2": [
                "parallel.pp=2",
                "parallel.ep=2",
                "parallel.tp=2",
                "parallel.zero_stage=1",
                "parallel.pp_virtual_stages=2",
            ],
        },
        timeout=380,
        reshard={
            "pp=2 x ep=2 x tp=2 -> ep=4 x tp=2 zero3": (
                ["parallel.pp=2", "parallel.ep=2", "parallel.tp=2"],
                ["parallel.ep=4", "parallel.tp=2", "parallel.zero_stage=3"],
            ),
            "dp=4 x ep=2 x tp=2 expert_tp -> ep=1 x tp=2 zero1": (
                ["parallel.ep=2", "parallel.tp=2", "parallel.expert_tp=true"],
                ["parallel.tp=2", "parallel.zero_stage=1"],
            ),
        },
    )
