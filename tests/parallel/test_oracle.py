"""The layout oracle catches the errors it guards against.

Each test plants one error that a broken layout would make and checks that the oracle of
tests/multirank.py fails and names the tensor (or the rank, or the layout fact):

- a constant factor on some gradients (x0.5 on every RMSNorm weight -- what averaging
  instead of summing the sequence-parallel norm gradients over tp=2 gives --, x2 on one
  expert tensor, x0.5 on the router gate). AdamW's update m / sqrt(v) cancels such a factor,
  so losses and parameters barely move: the gradients must be compared;
- an optimizer state dropped on resume (what a checkpoint that lost a moment would do);
- an error on one rank only (the other rank's report alone would pass);
- a parallel key the code silently ignores (the layout facts must differ), and the
  escapes of tests/faults.py whose numbers equal one process's (breadth-first passes the
  engine's loop ignores, ``parallel.cp`` forced to 1, a pipeline stage given the wrong
  layers with the same total): the facts observed from the run differ from the raw request;
- an initialisation that depends on the layout (tests/faults.py: a rank draws its shards as
  if they began the tensor, or its experts as if they were the first ones): the first
  step's loss and gradients already differ from one process's.
"""

from __future__ import annotations

import re
import tempfile
from typing import Any

import pytest
import torch
from multirank import (
    PARAM_TOL,
    Case,
    anchored_compare,
    check_cases,
    compare_resumed,
    compare_runs,
    micro_run,
    reference_run,
    reshard_run,
    scale_grads,
)
from threads import ORACLE_THREADS

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
    # Why gradients are compared: Adam cancels the factor. Losses, gradient norms and router
    # statistics agree within their tolerances, and the parameters come within a few times
    # theirs (x0.5 on the norm weights: 1.03 times after 3 steps), while the gradient is off
    # by half of itself (5e4 times its tolerance).
    if suffix == "norm.weight":
        ref = reference_run((), STEPS)
        blind = ("grads", "optim", "params")
        compare_runs(
            {**{k: v for k, v in got.items() if k not in blind}, "params": {}},
            {**{k: v for k, v in ref.items() if k not in blind}, "params": {}},
            what="losses and statistics alone",
        )
        param = PARAM_TOL
        excess = max(
            ((got["params"][n] - r).abs() / (param["atol"] + param["rtol"] * r.abs())).max().item()
            for n, r in ref["params"].items()
        )
        assert excess < 10, excess
    assert "ratio of norms" in message


def _at_step(step: int, inject: Any) -> Any:
    """A ``micro_run`` injection that runs at ``step`` only."""
    return lambda engine, t: inject(engine, t) if t == step else None


def _nudge(suffix: str, by: float) -> Any:
    """Moves the parameters whose name ends with ``suffix`` by ``by`` before the optimizer
    step: the update the step makes is then not one process's update of its inputs."""

    def inject(engine: Any, step: int) -> None:
        from moetrain.train.tensors import fqn as _fqn

        for name, p in engine.parts[0].named_parameters():
            if _fqn(name).endswith(suffix):
                p.data.add_(by)

    return inject


@pytest.mark.thread_counts
def test_every_run_an_exact_comparison_reads_computes_on_the_oracles_threads(
    monkeypatch: pytest.MonkeyPatch, ambient_threads: int
) -> None:
    """The layout's run, the single-process reference, the step-by-step replay and a resumed
    run each compute on ``ORACLE_THREADS`` intra-op threads whatever the caller's setting: the
    same fp32 sums blocked for another thread count differ in their last bits (by how much
    depends on the machine), and ``anchored_compare`` asserts the replay of a correct run
    exact."""
    from moetrain.train.trainer import Trainer

    seen: list[tuple[str, int]] = []
    step = Trainer.train_step
    what = ["run"]

    def counting(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        seen.append((what[0], torch.get_num_threads()))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", counting)
    options = (f"optim.lr={ambient_threads}e-3",)  # a reference no other test has computed
    with tempfile.TemporaryDirectory() as out:
        got = micro_run(out, 2, *options)
    what[0] = "reference"
    reference_run(options, 2)
    what[0] = "replay"
    anchored_compare(options, got, 2)
    what[0] = "resumed"
    with tempfile.TemporaryDirectory() as out:
        reshard_run(out, 2, list(options), list(options))
    assert {w for w, _ in seen} == {"run", "reference", "replay", "resumed"}, seen
    assert all(n == ORACLE_THREADS for _, n in seen), (ambient_threads, seen)
    assert torch.get_num_threads() == ambient_threads  # and the caller's setting is restored


@pytest.mark.slow  # three 3-step runs and their replays (about 25 s on two idle cores)
@pytest.mark.thread_counts
def test_the_step_by_step_check_is_exact_and_forgives_no_later_error(ambient_threads) -> None:
    """``anchored_compare`` (what decides a cell past the whole-run tolerances, where Adam has
    amplified last-bit differences) replays the run step by step from the run's own states:
    a correct run passes it with nothing to spare; a gradient error at a later step only, or
    an update that is not the optimizer's, fails it and is named at its step."""
    with tempfile.TemporaryDirectory() as out:
        clean = micro_run(out, STEPS)
    errs = anchored_compare((), clean, STEPS)
    assert errs["param"] == 0.0 and errs["grad first step"] == 0.0, errs
    with tempfile.TemporaryDirectory() as out:
        late = micro_run(
            out, STEPS, inject=_at_step(1, scale_grads("layers.1.ffn.experts.w2", 1.01))
        )
    _fails_naming(late, r"grad\[step 1 layers\.1\.ffn\.experts\.w2\]")
    with pytest.raises(
        AssertionError, match=r"anchored at step 1[\s\S]*layers\.1\.ffn\.experts\.w2"
    ):
        anchored_compare((), late, STEPS)
    with tempfile.TemporaryDirectory() as out:
        moved = micro_run(
            out, STEPS, inject=_at_step(2, _nudge("layers.0.attention.wq.weight", 1e-4))
        )
    with pytest.raises(
        AssertionError, match=r"anchored at step 2[\s\S]*param\[layers\.0\.attention\.wq"
    ):
        anchored_compare((), moved, STEPS)


def test_a_dropped_optimizer_state_on_resume_is_caught_and_named() -> None:
    def drop(trainer) -> None:
        from moetrain.train.tensors import fqn as _fqn

        opt = trainer.engine.optimizers[0]
        for name, p in trainer.engine.parts[0].named_parameters():
            if _fqn(name) == "layers.2.attention.wq.weight":
                # The planted error needs moments to drop: a resume that already lost them
                # fails here, by this assertion, not with a KeyError of the test's own.
                assert p in opt.state and opt.state[p], (
                    "the resume lost the moments of layers.2.attention.wq.weight before the "
                    "planted error could drop them"
                )
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
@pytest.mark.timeout(500)
def test_an_error_on_one_rank_and_ignored_layouts_are_caught() -> None:
    """Errors only the layout facts can see: the numbers are those of one process either
    way. Two of them (tests/faults.py) once passed every cell, because the facts read the
    configuration (the engine's breadth attribute, the validated config) rather than what
    ran; they are observed now, against the raw request."""
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
        Case(
            "dp=2 breadth-first passes of 2, ignored by the engine's loop",
            ("parallel.breadth_first_micro_batches=2",),
            fault=("plant", None, "breadth_first_ignored"),
        ),
        Case(
            "cp=2, forced to 1 by config validation",
            ("parallel.cp=2",),
            fault=("plant", None, "cp_forced_to_1"),
        ),
        Case(
            "dp=2 ZeRO-3, each rank initialises its shards from the tensor's start",
            ("parallel.zero_stage=3",),
            fault=("plant", None, "init_offsets_forgotten"),
        ),
        Case(
            "ep=2, each rank initialises its experts as the first ones",
            ("parallel.ep=2",),
            fault=("plant", None, "expert_layouts_ignored"),
        ),
        Case(
            "pp=2 stages of 3 + 1 layers, built as 1 + 3",
            ("parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_stage_layers=[3,1]"),
            fault=("plant", None, "stage_layers_misassigned"),
        ),
    ]
    with pytest.raises(AssertionError) as info:
        check_cases(2, cases, STEPS, timeout=450)
    message = str(info.value)
    assert "rank 1 halves its norm gradients after the reduction (rank 1)" in message
    assert "after the reduction (rank 0)" not in message, message
    for rank in (0, 1):
        # Training is unchanged by a skipped layout (the model is just not distributed): only
        # the layout facts can tell, and they do.
        skipped_ac = _section(message, f"checkpointing silently skipped (rank {rank})")
        assert "layout checkpointed: the request asks for" in skipped_ac, skipped_ac
        skipped_tp = _section(message, f"parallelism silently skipped (rank {rank})")
        assert "layout tp_placement: the request asks for 'S(0)'" in skipped_tp, skipped_tp
        # ... and what each rank's attention saw: all 4 heads instead of 2 per tp rank.
        assert "layout attention_shapes: the request asks for ((2, 32, 2, 16)" in skipped_tp
        # Forwards and backwards as they ran: one at a time instead of passes of two.
        ignored = _section(message, f"ignored by the engine's loop (rank {rank})")
        assert "layout breadth_first: the request asks for (2,), the run has (1, 1)" in ignored
        assert "layout order: the request asks for 'FFBB', the run has 'FBFB'" in ignored
        # The positions and attention shapes each rank used: whole sequences, not a half.
        forced = _section(message, f"forced to 1 by config validation (rank {rank})")
        mine = (*range(0, 8), *range(24, 32)) if rank == 0 else tuple(range(8, 24))
        assert (
            f"layout positions: the request asks for {mine}, the run has {tuple(range(32))}"
        ) in forced, forced
        assert "layout attention_shapes: the request asks for ((2, 16, 4, 16)" in forced, forced
        assert "layout attend: the request asks for 'ContextParallelAttention'" in forced
        # A layout-dependent initialisation: another model, whose first gradients differ (the
        # first loss of the micro model, near log(vocab) at any small init, may not).
        for case in ("from the tensor's start", "experts as the first ones"):
            init = _section(message, f"{case} (rank {rank})")
            assert re.search(r"tensors diverge from step 0", init), init
            assert "grad[step 0 " in init, init
        # The layers each rank's stage held: the same four in all, on the wrong stages.
        split = _section(message, f"built as 1 + 3 (rank {rank})")
        want, got = ((0, 1, 2), (0,)) if rank == 0 else ((3,), (1, 2, 3))
        assert (
            f"layout stage_layers: the request asks for ({want},), the run has ({got},)"
        ) in split, split
        assert "grad[" not in split and "loss" not in split, split  # the same numbers


def _section(message: str, case: str) -> str:
    """The report of one case and rank from ``check_cases``' message."""
    assert case in message, message
    return message.split(case, 1)[1].split("\n\n", 1)[0]
