"""The layout oracle catches the errors it guards against.

Each test plants one error that a broken layout would make and checks that the oracle of
tests/multirank.py fails and names the tensor (or the rank, or the layout fact):

- a constant factor on some gradients (x0.5 on every RMSNorm weight -- what averaging
  instead of summing the sequence-parallel norm gradients over tp=2 gives --, x2 on one
  expert tensor, x0.5 on the router gate). AdamW's update m / sqrt(v) cancels such a factor,
  so losses and parameters barely move: the gradients must be compared;
- an optimizer state dropped on resume (what a checkpoint that lost a moment would do);
- an error on one rank only (the other rank's report alone would pass);
- a parallel key the code silently ignores (the layout facts must differ).
"""

from __future__ import annotations

import re
import tempfile

import pytest
from multirank import (
    Case,
    check_cases,
    compare_resumed,
    compare_runs,
    micro_run,
    reference_run,
    reshard_run,
    scale_grads,
)

STEPS = 3


def _fails_naming(got: dict, pattern: str) -> str:
    with pytest.raises(AssertionError) as info:
        compare_runs(got, reference_run((), STEPS), what="planted")
    message = str(info.value)
    assert re.search(pattern, message), message
    return message


@pytest.mark.parametrize(
    ("suffix", "factor", "pattern"),
    [
        ("norm.weight", 0.5, r"grad\[step 0 [\w.]*norm\.weight\]"),
        ("layers.1.ffn.experts.w2", 2.0, r"grad\[step 0 layers\.1\.ffn\.experts\.w2\]"),
        ("router.gate.weight", 0.5, r"grad\[step 0 layers\.\d\.ffn\.router\.gate\.weight\]"),
    ],
    ids=["x0.5 norm weights", "x2 one expert tensor", "x0.5 router gate"],
)
def test_a_scaled_gradient_is_caught_and_named(suffix: str, factor: float, pattern: str) -> None:
    with tempfile.TemporaryDirectory() as out:
        got = micro_run(out, STEPS, inject=scale_grads(suffix, factor))
    message = _fails_naming(got, pattern)
    # The comparisons the oracle had before it looked at gradients: they let x0.5 on the
    # norm weights through (Adam cancels the factor), which is why gradients are compared.
    if suffix == "norm.weight":
        lenient = {k: v for k, v in got.items() if k not in ("grads", "optim")}
        ref = {k: v for k, v in reference_run((), STEPS).items() if k not in ("grads", "optim")}
        try:
            compare_runs(lenient, ref)
        except AssertionError:
            pass  # caught anyway (e.g. by the gradient norm): fine, the point stands above
    assert "ratio of norms" in message


def test_a_dropped_optimizer_state_on_resume_is_caught_and_named() -> None:
    def drop(trainer) -> None:
        from moetrain.train.tensors import fqn as _fqn

        opt = trainer.engine.optimizers[0]
        for name, p in trainer.engine.parts[0].named_parameters():
            if _fqn(name) == "layers.2.attention.wq.weight":
                del opt.state[p]
                return
        raise AssertionError("parameter not found")

    with tempfile.TemporaryDirectory() as out:
        got = reshard_run(out, STEPS, [], [], after_load=drop)
    with pytest.raises(AssertionError, match=r"optim\[layers\.2\.attention\.wq\.weight\.exp_avg"):
        compare_resumed(got, reference_run((), STEPS), what="planted")
    # And the same resume without the planted error passes.
    with tempfile.TemporaryDirectory() as out:
        compare_resumed(reshard_run(out, STEPS, [], []), reference_run((), STEPS))


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_an_error_on_one_rank_and_an_ignored_parallel_key_are_caught() -> None:
    cases = [
        Case(
            "dp=2, rank 1 halves its norm gradients after the reduction",
            ("parallel.zero_stage=0",),
            fault=("scale", 1, "norm.weight", 0.5),
        ),
        Case(
            "dp=2 full AC, activation checkpointing silently skipped",
            ("parallel.activation_checkpointing=full",),
            fault=("disable", None, "moetrain.parallel.parallelize:apply_ac"),
        ),
        Case(
            "tp=2 + SP, tensor parallelism silently skipped",
            ("parallel.tp=2", "parallel.sequence_parallel=true"),
            fault=("disable", None, "moetrain.parallel.parallelize:apply_tp"),
        ),
    ]
    with pytest.raises(AssertionError) as info:
        check_cases(2, cases, STEPS, timeout=280)
    message = str(info.value)
    assert "rank 1 halves its norm gradients after the reduction (rank 1)" in message
    assert "after the reduction (rank 0)" not in message, message
    for rank in (0, 1):
        # Training is unchanged by a skipped layout (the model is just not distributed): only
        # the layout facts can tell, and they do.
        assert re.search(
            rf"checkpointing silently skipped \(rank {rank}\):\n  layout checkpointed", message
        ), message
        assert re.search(
            rf"parallelism silently skipped \(rank {rank}\):\n  layout tp_placement", message
        ), message
