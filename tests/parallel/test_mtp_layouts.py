"""Multi-token prediction under a pipeline: what the equivalence matrix's pp=2 cells (and
its tensor-parallel ones) leave out.

The modules live on the last stage, which keeps its own copy of the embedding for their
inputs; the engine sums the copy's gradient with the first stage's after backward
(``Engine._sync_embedding_copies``): over the pp group at pp=2, locally under the V
schedules (the first and the last stage share rank 0; matrix cells), and over a group of
the two ranks at pp > 2 -- here, four stages against one process. And the oracle sees the
copies apart when the sum is left out (``embedding_copies_unsynced``, tests/faults.py).

Checkpoints hold the embedding once; a resume into the V placement, where one rank holds both
copies, gives each its own optimizer moments (they once shared one tensor and stepped it
twice: exp_avg 1.4 times the reference's after the resumed step).
"""

from __future__ import annotations

import pytest
from multirank import Case, check_cases, check_reshards

STEPS = 2
MTP = ("model.mtp_depth=1", "model.mtp_loss_weight=0.3", "model.tie_embeddings=false")


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mtp_under_four_pipeline_stages() -> None:
    layout = ("parallel.pp=4", "parallel.pp_schedule=1f1b")
    check_cases(4, [Case("pp=4 1f1b, multi-token prediction", layout, MTP)], STEPS, timeout=560)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_embedding_copies_left_apart_are_caught() -> None:
    case = Case(
        "pp=2 1f1b, multi-token prediction, the embedding copies' gradients not summed",
        ("parallel.pp=2", "parallel.pp_schedule=1f1b"),
        MTP,
        fault=("plant", None, "embedding_copies_unsynced"),
    )
    with pytest.raises(AssertionError, match=r"grad\[step 0 tok_embeddings\.weight\]"):
        check_cases(2, [case], STEPS, timeout=280)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_resumes_into_the_v_placement() -> None:
    """tp=2 + SP saves after 2 steps; pp=2 zbv (rank 0 holds the first and the last stage,
    both copies of the embedding) resumes and takes the third: one process's numbers."""
    tp_sp = ["parallel.tp=2", "parallel.sequence_parallel=true"]
    zbv = ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2"]
    check_reshards(2, [("tp=2 + SP -> pp=2 zbv", tp_sp, zbv)], 3, timeout=560, options=MTP)
