"""FP8 scales come from whole tensors under every layout, and a test sees when they do not.

The equivalence matrix crosses ``train.fp8`` with every layout (its ``fp8`` factor,
tests/parallel/matrix_options.py) and compares the first step with one FP8 process within
the "fp8" row of ``TOLERANCES`` (tests/multirank.py). That row must allow what FP8 does to
numbers that a layout sums in another order: a value on a rounding boundary of the FP8 grid
rounds the other way, and in a small model the change can travel down that token's later
layers (measured up to 4.3e-2 of a gradient's scale at the first step) -- as much as a scale
computed from one rank's slice of a tensor moves them (3e-2 to 1.2e-1). So the bug is caught
here by what tells them apart: a flip reaches the tokens downstream of it, a wrong scale
every token. The first forward's logits under the layout against one FP8 process, token by
token: under a correct layout few tokens' logits differ beyond fp32's reordering; with
scales from each rank's slice (``fp8_local_amax``, tests/faults.py: a tensor-parallel weight
shard, a row-parallel input split by feature, an expert-TP slice of the FFN width) nearly
all do.
"""

from __future__ import annotations

import dataclasses
import tempfile

import matrix_design as md
import pytest
import torch
from multirank import Case, RankFailure, check_cases, micro_config, run_ranks
from threads import one_thread

TP_SP = ("parallel.tp=2", "parallel.sequence_parallel=true")
EXPERT_TP = ("parallel.tp=2",)  # expert TP (the default): every expert's FFN width split
LAYOUTS = {"tp2 SP": TP_SP, "tp2, expert TP": EXPERT_TP}
OPTIONS = (*md.BASE, "train.fp8=tensorwise")
# Planted under tensorwise: rowwise's scales are powers of two, and a slice's scale differs
# from the whole tensor's by a power of two, which moves no FP8 value above the subnormals --
# the same bug is (nearly) harmless there.

TOKEN_TOL = 1e-5
"""A token's logits differ when max |a - b| over the vocabulary exceeds this fraction of the
largest |logit| of the token: fp32's reordering stays under 1e-6."""
CORRECT_MAX = 0.25
"""Fraction of tokens whose logits may differ under a correct layout (FP8 roundings that a
reordered sum flipped, and the tokens downstream of them). Measured 0.0 (tp2 SP) and 0.0
(expert TP) on this batch."""
PLANTED_MIN = 0.9
"""Fraction of tokens whose logits differ at least, with scales from one rank's slice.
Measured 1.0 under both layouts."""


def first_logits(
    layout: tuple[str, ...], plant: bool, options: tuple[str, ...] = OPTIONS
) -> torch.Tensor:
    """The logits (B, S, V) of the first micro-batch's forward, gathered whole."""
    from torch.distributed.tensor import DTensor

    from moetrain.train.trainer import Trainer

    if plant:
        from faults import plant as plant_fault

        plant_fault("fp8_local_amax")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(micro_config(tmp, "train.steps=1", *options, *layout))
        batch = trainer.train_data.next_step()[0]
        with torch.no_grad():
            logits = trainer.engine.parts[0](batch["input_ids"])
        trainer.close()
    return (logits.full_tensor() if isinstance(logits, DTensor) else logits).detach()


def _worker(
    rank: int, world: int, layout: tuple[str, ...], plant: bool, options: tuple[str, ...] = OPTIONS
) -> torch.Tensor:
    return first_logits(layout, plant, options)


def differing_tokens(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of tokens whose logits differ (``TOKEN_TOL``)."""
    err_BS = (got - ref).abs().amax(-1) / ref.abs().amax(-1)
    return float((err_BS > TOKEN_TOL).double().mean())


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_scales_from_one_ranks_slice_move_every_token_and_whole_tensor_scales_do_not(
    name: str,
) -> None:
    with one_thread():  # as every rank (tests/threads.py)
        ref = first_logits((), plant=False)
    correct = run_ranks(_worker, 2, LAYOUTS[name], False, timeout=280)
    planted = run_ranks(_worker, 2, LAYOUTS[name], True, timeout=280)
    for rank in (0, 1):
        ok, bad = differing_tokens(correct[rank], ref), differing_tokens(planted[rank], ref)
        assert ok <= CORRECT_MAX, (name, rank, ok)
        assert bad >= PLANTED_MIN, (name, rank, bad)
    # The check can fail the other way too: the planted run is not the reference itself.
    assert not torch.equal(planted[0], ref)


SCALED_MM_TOL = 2e-2
"""Largest |logit| difference of the ``scaled_mm`` backend under a tensor-parallel layout
against one process on the same backend, relative to the largest |logit|: the scaled GEMM
rounds its output to bf16, a row-parallel layer each rank's partial sum before the
reduction (2^-9 relative each). Measured 8.3e-3 (also under tp2 SP)."""


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_scaled_mm_backend_runs_on_tensor_parallel_shards() -> None:
    """The ``torch._scaled_mm`` backend (torch's CPU kernel here) under tp2 with expert TP
    (column- and row-parallel linears, experts split over the FFN width): each rank's GEMM
    on its FP8 shards with the whole tensors' scales, no FP8 tensor redistributed (gloo
    cannot carry one; a redistribution would gather a weight)."""
    name = "tp2, expert TP"
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("torch has no _scaled_mm")
    options = (*OPTIONS, "train.fp8_backend=scaled_mm")
    with one_thread():  # as every rank (tests/threads.py)
        ref = first_logits((), False, options)
    got = run_ranks(_worker, 2, LAYOUTS[name], False, options, timeout=280)
    for rank in (0, 1):
        err = float((got[rank] - ref).abs().max() / ref.abs().max())
        assert err <= SCALED_MM_TOL, (name, rank, err)


PIPELINE_EP_TP = ("parallel.pp=2", "parallel.ep=2", "parallel.tp=2", "parallel.pp_virtual_stages=2")
"""Expert parallelism too: its all-to-all hands each rank as many rows as were routed to its
experts (a local dispatcher keeps every row, dropped ones included, whatever the routing)."""
ROWWISE_DROPLESS = (*md.BASE, "train.fp8=rowwise", "moe.capacity_factor=null")


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_a_pipeline_infers_its_shapes_from_the_same_tokens_on_every_expert_tp_rank() -> None:
    """torch.distributed.pipelining infers the shapes between stages by running each stage
    once, a later stage on uninitialised tensors (``torch.empty``). Under expert TP with FP8
    rowwise, each rank's per-row amax of the routed rows is all-reduced over the TP group, so
    two ranks routing different garbage disagree on its size and gloo aborts (found by the
    equivalence matrix: pp2 x ep2 x tp2, FP8 rowwise, capacity 1, when a capacity factor
    still sent only the kept rows; since every expert's segment travels in its capacity's
    slots, the sizes follow the routing only dropless, as here). The engine's warm-up
    zeroes those inputs (``StepContext.zero_stage_input``): the run then equals one process;
    with the garbage handed on (``stage_inputs_uninitialised``, tests/faults.py) a rank dies."""
    case = Case("pp2 x ep2 x tp2 interleaved, FP8 rowwise, dropless", PIPELINE_EP_TP,
                ROWWISE_DROPLESS)  # fmt: skip
    check_cases(8, [case], md.STEPS, timeout=400)
    planted = dataclasses.replace(case, fault=("plant", None, "stage_inputs_uninitialised"))
    with pytest.raises(RankFailure, match="died with exit code|mismatch|doesn't match"):
        check_cases(8, [planted], md.STEPS, timeout=400)
