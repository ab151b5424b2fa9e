"""Expert parallelism through the real trainer and engine reproduces the single-process run.

The oracle of tests/parallel/test_layouts.py: ``micro_run`` (tests/multirank.py) trains the
micro MoE (4 MoE layers of 4 experts, top-2, capacity 1.0 with token groups of 2 sequences, a
shared expert, the expert-bias update, gradient clipping) for ``STEPS`` fp32 steps in one
process and under each layout; they must agree on the loss, the gradient norm, every MoE
layer's aux / seq-aux / z losses, router entropy, token counts, drops and expert bias, and on
every final parameter (experts gathered over EP). Under EP the job also reports the token
bytes its dispatchers sent to other ranks (``a2a_bytes``, 0 in one process): checked > 0,
left out of the comparison.

Tolerances (fp32, ``VALUE_TOL``/``PARAM_TOL`` of tests/multirank.py): values atol 1e-5, rtol 1e-4;
parameters atol 5e-5, rtol 1e-4 (see there why); token and drop counts are compared with
the same tolerance, which for integer counts is exact.

Several layouts share one spawned job (one process group, a fresh Trainer per layout) to
keep the folder inside its time budget on two cores.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from multirank import PARAM_TOL, VALUE_TOL, compare_runs, micro_config, micro_run, run_ranks

STEPS = 3
# Smaller than the layout tests' micro model (time budget): 4 layers stay, so that pp=2 with
# two virtual stages (interleaved 1F1B) has a layer per chunk.
SMALL = ["model.dim=32", "model.ffn_dim=64", "moe.expert_ffn_dim=32", "data.seq_len=16"]


@pytest.fixture(scope="module")
def reference() -> dict:
    with tempfile.TemporaryDirectory() as out:
        return micro_run(out, STEPS, *SMALL)


def _reshard(out: str, save: list[str], load: list[str]) -> dict:
    """Train STEPS - 1 steps under ``save``, checkpoint, resume under ``load``, one step."""
    from moetrain.train.trainer import Trainer

    first = Trainer(micro_config(out, f"train.steps={STEPS}", *SMALL, *save))
    losses = [first.train_step().loss for _ in range(STEPS - 1)]
    first.save_checkpoint()
    first.close()
    del first
    second = Trainer(micro_config(out, f"train.steps={STEPS}", *SMALL, *load))
    second.maybe_resume()
    assert second.step == STEPS - 1, second.step
    losses.append(second.train_step().loss)
    params = second.full_model_state_dict()
    second.close()
    return {"loss": losses, "params": params}


def _worker(
    rank: int, world_size: int, root: str, tasks: list[tuple[str, list, list]]
) -> list | None:
    results = []
    for i, (kind, a, b) in enumerate(tasks):
        if kind == "run":
            with tempfile.TemporaryDirectory() as out:
                results.append(micro_run(out, STEPS, *SMALL, *a))
        else:  # the checkpoint directory is shared by every rank
            results.append(_reshard(f"{root}/{i}", a, b))
    return results if rank == 0 else None


def _split_a2a(run: dict) -> float:
    """Remove ``a2a_bytes`` from every step's statistics; return their total."""
    total = 0.0
    for step in run["moe"]:
        for stats in step.values():
            total += float(stats.pop("a2a_bytes", 0.0))
    return total


def check(
    world_size: int,
    layouts: dict[str, list[str]],
    reference: dict,
    timeout: float,
    reshard: dict[str, tuple[list[str], list[str]]] | None = None,
) -> None:
    tasks = [("run", o, []) for o in layouts.values()]
    tasks += [("reshard", s, ld) for s, ld in (reshard or {}).values()]
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_worker, world_size, root, tasks, timeout=timeout)[0]
    ref = {**reference, "moe": [{i: dict(s) for i, s in st.items()} for st in reference["moe"]]}
    assert _split_a2a(ref) == 0.0
    failures = []
    for name, got in zip(layouts, results, strict=False):
        try:
            sent = _split_a2a(got)
            assert sent > 0, f"{name}: no a2a bytes counted under EP"
            errs = compare_runs(
                got,
                ref,
                atol=VALUE_TOL["atol"],
                rtol=VALUE_TOL["rtol"],
                param_tol=PARAM_TOL,
                what=name,
            )
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
        else:
            print(f"{name}: max abs errors {errs}, a2a bytes {sent:.0f}")
    for name, got in zip(reshard or {}, results[len(layouts) :], strict=True):
        try:
            torch.testing.assert_close(
                torch.tensor(got["loss"]), torch.tensor(ref["loss"]), **VALUE_TOL
            )
            for key, value in ref["params"].items():
                torch.testing.assert_close(got["params"][key], value, **PARAM_TOL, msg=key)
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
        else:
            print(f"{name}: losses {got['loss']}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_ep2_with_each_zero_stage_and_reshard_to_ep1(reference: dict) -> None:
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
        reference,
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
def test_ep4_and_ep2_composed_with_tp_pp_edp_on_four_ranks(reference: dict) -> None:
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
        reference,
        timeout=380,
    )


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ep_on_eight_ranks_and_reshard_ep2_to_ep4(reference: dict) -> None:
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
        reference,
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
