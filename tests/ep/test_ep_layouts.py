"""Expert-parallel checkpoints reshard: saved under one EP layout, resumed under another.

The micro MoE (4 MoE layers of 4 experts, top-2, capacity 1.0 with token groups of 2
sequences, a shared expert, the expert-bias update, gradient clipping) trains ``STEPS - 1``
fp32 steps under one layout, checkpoints, resumes under another and takes the last step: on
every rank the loss, that step's gradients (experts gathered over EP and expert TP), AdamW's
moments and the parameters equal an uninterrupted single-process run (``check_reshards`` in
tests/multirank.py, the fp32 row of ``TOLERANCES``). Every EP layout itself, with every
model and router option, runs in the equivalence matrix (tests/parallel/test_matrix.py).
"""

from __future__ import annotations

import pytest
from multirank import check_reshards

STEPS = 3
# Smaller than the layout tests' micro model (time budget): 4 layers stay, so that pp=2 with
# two virtual stages (interleaved 1F1B) has a layer per chunk.
SMALL = ("model.dim=32", "model.ffn_dim=64", "moe.expert_ffn_dim=32", "data.seq_len=16")


def check(
    world_size: int,
    reshard: dict[str, tuple[list[str], list[str]]],
    timeout: float,
) -> None:
    cases = [(name, s, ld) for name, (s, ld) in reshard.items()]
    check_reshards(world_size, cases, STEPS, timeout=timeout, options=SMALL)


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_checkpoint_saved_under_ep2_resumes_under_ep1() -> None:
    """ep=2 (experts in their own ZeRO-1 AdamW) saves; dp=2 with ZeRO-3 and whole experts
    resumes: the third step equals three uninterrupted single-process steps."""
    check(
        2,
        {
            "ep=2 zero1 -> ep=1 zero3": (
                ["parallel.ep=2", "parallel.zero_stage=1"],
                ["parallel.ep=1", "parallel.zero_stage=3"],
            ),
        },
        timeout=380,
    )


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoints_reshard_across_ep_and_expert_tp_on_eight_ranks() -> None:
    """Saved under pp=2 x ep=2 x tp=2 (expert TP) and resumed under ep=4 x tp=2 with ZeRO-3;
    saved under dp=4 x ep=2 x tp=2 with expert TP and resumed under ep=1 x tp=2 with
    ZeRO-1 (experts as tp-sharded DTensors there)."""
    check(
        8,
        {
            "pp=2 x ep=2 x tp=2 -> ep=4 x tp=2 zero3": (
                ["parallel.pp=2", "parallel.ep=2", "parallel.tp=2"],
                ["parallel.ep=4", "parallel.tp=2", "parallel.zero_stage=3"],
            ),
            "dp=4 x ep=2 x tp=2 expert_tp -> ep=1 x tp=2 zero1": (
                ["parallel.ep=2", "parallel.tp=2", "parallel.expert_tp=true"],
                ["parallel.tp=2", "parallel.zero_stage=1"],
            ),
        },
        timeout=580,
    )
