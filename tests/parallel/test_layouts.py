"""Every parallel layout reproduces the single-process run of the micro MoE.

The oracle: ``micro_run`` (tests/multirank.py) trains the micro MoE for ``STEPS`` fp32 steps
on the same global batches, in one process and under each layout; the layouts must agree on
the loss, the gradient norm, every MoE layer's aux / seq-aux / z losses, router entropy,
token counts, drops and expert bias, and on every final parameter.

Tolerances (fp32, stated once):
- losses, gradient norms and router statistics: atol 1e-5, rtol 1e-4 (the fp32 row of the
  model tests' table): layouts only reorder fp32 sums.
- final parameters: atol 5e-5, rtol 1e-4. Adam's update m / sqrt(v) does not scale with the
  gradient, so a gradient element near zero whose fp32 rounding differs by reduction order
  can move by a sizeable fraction of the learning rate (1e-3 in the warm-up): 5e-5 is 1/20
  of one such update. Measured: <= 1.2e-5.

Several layouts share one spawned job (one process group, a fresh Trainer per layout) to
keep the suite inside its time budget on two cores.
"""

from __future__ import annotations

import tempfile

import pytest
from multirank import PARAM_TOL, VALUE_TOL, compare_runs, micro_run, run_ranks

STEPS = 3


@pytest.fixture(scope="module")
def reference() -> dict:
    with tempfile.TemporaryDirectory() as out:
        return micro_run(out, STEPS)


def _layouts_worker(rank: int, world_size: int, layouts: list[list[str]]) -> list[dict] | None:
    results = []
    for overrides in layouts:
        with tempfile.TemporaryDirectory() as out:
            results.append(micro_run(out, STEPS, *overrides))
    return results if rank == 0 else None


def check_layouts(
    world_size: int, layouts: dict[str, list[str]], reference: dict, timeout: float
) -> None:
    results = run_ranks(_layouts_worker, world_size, list(layouts.values()), timeout=timeout)[0]
    failures = []
    for name, got in zip(layouts, results, strict=True):
        try:
            errs = compare_runs(
                got,
                reference,
                atol=VALUE_TOL["atol"],
                rtol=VALUE_TOL["rtol"],
                param_tol=PARAM_TOL,
                what=name,
            )
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
        else:
            print(f"{name}: max abs errors {errs}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_each_axis_alone_on_two_ranks(reference: dict) -> None:
    check_layouts(
        2,
        {
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
            "pp=2 1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
            "pp=2 interleaved_1f1b v=2": ["parallel.pp=2", "parallel.pp_virtual_stages=2"],
            "pp=2 zero_bubble v=2": [
                "parallel.pp=2",
                "parallel.pp_schedule=zero_bubble",
                "parallel.pp_virtual_stages=2",
            ],
        },
        reference,
        timeout=380,
    )


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_axis_compositions_on_four_ranks(reference: dict) -> None:
    check_layouts(
        4,
        {
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
        },
        reference,
        timeout=380,
    )


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_three_axes_pp_dp_tp_on_eight_ranks(reference: dict) -> None:
    check_layouts(
        8,
        {
            "pp x dp x tp = 2x2x2, zero3, SP, interleaved v=2": [
                "parallel.pp=2",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "parallel.zero_stage=3",
                "parallel.pp_virtual_stages=2",
            ],
        },
        reference,
        timeout=380,
    )


# ----------------------------------------------------------------------------- checkpoints


def _reshard_worker(
    rank: int, world_size: int, out: str, save: list[str], load: list[str]
) -> dict | None:
    from multirank import micro_config

    from moetrain.train.trainer import Trainer

    first = Trainer(micro_config(out, f"train.steps={STEPS}", *save))
    losses = [first.train_step().loss for _ in range(STEPS - 1)]
    first.save_checkpoint()
    first.close()
    del first
    second = Trainer(micro_config(out, f"train.steps={STEPS}", *load))
    second.maybe_resume()
    assert second.step == STEPS - 1, second.step
    losses.append(second.train_step().loss)
    params = second.full_model_state_dict()
    second.close()
    return {"loss": losses, "params": params} if rank == 0 else None


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_checkpoint_saved_under_one_layout_loads_under_another(reference: dict, tmp_path) -> None:
    """dp=4 with ZeRO-1 saves after 2 steps; pp=2 x tp=2 (+SP) loads it and takes the third
    step: the same loss and parameters as three uninterrupted single-process steps."""
    got = run_ranks(
        _reshard_worker,
        4,
        str(tmp_path / "dp4"),
        ["parallel.zero_stage=1"],
        ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
        timeout=380,
    )[0]
    import torch

    torch.testing.assert_close(
        torch.tensor(got["loss"]), torch.tensor(reference["loss"]), **VALUE_TOL
    )
    for name, value in reference["params"].items():
        torch.testing.assert_close(got["params"][name], value, **PARAM_TOL, msg=name)
