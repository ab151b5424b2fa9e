"""Muon orthogonalizes whole matrices under every layout, and a test sees when it does not.

The equivalence matrix trains the micro MoE under every layout with Muon (its ``optimizer``
factor, tests/parallel/matrix_options.py: Newton-Schulz in fp32, within the fp32 tolerances
of tests/multirank.py). Newton-Schulz in bf16, the default, rounds its input: a gradient
element that a layout sums in another fp32 order and that lies on a bf16 rounding boundary
rounds the other way, and the iteration amplifies it (up to 1.3e-4 on a parameter after two
steps of the micro MoE, 2.5x the fp32 parameter tolerance) -- so the bf16 path is proven here
on the optimizer alone, where nothing else differs: every layout's optimizers step twice on
the same full gradients (drawn from each parameter's name, each rank given its slice), and
the parameters and momentum buffers equal one process's to fp32 rounding (measured: bit for
bit). Every matrix of the model is Muon's here (the embedding, output head and router gates
too: the vocabulary-parallel embedding, the column-parallel head, FSDP2's fp32 router units).

Each rank's own slice orthogonalized instead of the whole matrix (``muon_local_shard``,
tests/faults.py) moves a sharded matrix by two thirds of its whole update, caught under
the layouts that shard matrices.
"""

from __future__ import annotations

import tempfile
import zlib

import matrix_design as md
import pytest
import torch
from multirank import micro_config, run_ranks
from threads import one_thread

OPTIONS = (*md.BASE, "optim.name=muon", "optim.muon_embedding=true", "optim.muon_output=true",
           "optim.muon_router=true")  # fmt: skip
STEPS = 2
EQUAL = 1e-6
"""Largest difference from one process, relative to the tensor's largest element (fp32
rounding; measured 0: the same bits)."""
PLANTED_MIN = 0.3
"""The planted fault's worst difference from one process, relative to the largest move of
that parameter in one process's two steps, at least (measured 0.67 under tp2 SP, 0.69
under ZeRO-3)."""

TWO_RANKS = {
    "dp2 zero0": ("parallel.zero_stage=0",),
    "dp2 zero1": ("parallel.zero_stage=1",),
    "dp2 zero2": ("parallel.zero_stage=2",),
    "dp2 zero3": ("parallel.zero_stage=3",),
    "tp2 SP (expert TP)": ("parallel.tp=2", "parallel.sequence_parallel=true"),
    "tp2 SP replicated experts": ("parallel.tp=2", "parallel.sequence_parallel=true",
                                  "parallel.expert_tp=false"),
    "ep2": ("parallel.ep=2",),
    "pp2 interleaved v2": ("parallel.pp=2", "parallel.pp_virtual_stages=2"),
    "cp2": ("parallel.cp=2",),
}  # fmt: skip
FOUR_RANKS = {
    "hsdp 2x2 zero3": ("parallel.dp_replicate=2", "parallel.zero_stage=3"),
    "hsdp 2x2 zero1": ("parallel.dp_replicate=2", "parallel.zero_stage=1"),
    "dp2 x tp2 SP zero3": ("parallel.tp=2", "parallel.sequence_parallel=true",
                           "parallel.zero_stage=3"),
    "dp2 x tp2 zero1": ("parallel.tp=2", "parallel.zero_stage=1"),
    "ep2 x tp2 expert TP": ("parallel.ep=2", "parallel.tp=2"),
    "ep2 x edp2 zero2": ("parallel.ep=2", "parallel.zero_stage=2"),
    "cp2 x ep2 x dp2 zero1": ("parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=1"),
}  # fmt: skip
IN_CI = ("dp2 zero1", "dp2 zero3", "tp2 SP (expert TP)")
"""The two-rank layouts the default selection runs (ZeRO-1's flat slices, FSDP2's shards,
column and row blocks and expert TP's FFN slices); every layout under ``-m slow``."""
PLANTED = {
    "dp2 zero3": TWO_RANKS["dp2 zero3"],
    "tp2 SP (expert TP)": TWO_RANKS["tp2 SP (expert TP)"],
}


def full_gradient(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    """The gradient every layout is given: drawn from the parameter's full-model name."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * step)
    return torch.randn(shape, generator=gen) * 0.1


def _set_gradients(engine, step: int) -> None:
    """This rank's slice of every parameter's ``full_gradient``, as the reduction would leave
    it (ZeRO-1: on its flat views)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from moetrain.parallel.expert_parallel import expert_layouts
    from moetrain.train.muon import global_shape
    from moetrain.train.tensors import fqn, local

    layouts = expert_layouts(engine.parts, engine.meshes, engine.cfg.parallel)
    for part in engine.parts:
        for name, p in part.named_parameters():
            layout = layouts.get(fqn(name))
            full = full_gradient(fqn(name), global_shape(p, layout), step)
            if isinstance(p, DTensor):
                p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            elif layout is not None:
                p.grad = distribute_tensor(full, *layout, src_data_rank=None).to_local()
            else:
                p.grad = full
    if engine.zero_stage == 1:
        for shard in engine.grad_sync.shards:
            for v, (i, start, length) in zip(shard.views, shard.pieces, strict=True):
                v.grad = local(shard.params[i].grad).reshape(-1)[start : start + length].clone()


def optimizer_run(overrides: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """The micro MoE's optimizers stepped ``STEPS`` times on ``full_gradient`` under the
    layout of ``overrides``: the parameters before and after, the momentum buffers after."""
    from moetrain.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(micro_config(tmp, f"train.steps={STEPS}", *overrides))
        engine = trainer.engine
        before = trainer.full_model_state_dict()
        for step in range(STEPS):
            _set_gradients(engine, step)
            for opt in engine.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if engine.grad_sync is not None:
                engine.grad_sync.gather_params()
                engine.grad_sync.zero_grad()
            for part in engine.parts:
                part.zero_grad(set_to_none=True)
        out = {"before": before, "params": trainer.full_model_state_dict(),
               "optim": engine.full_optimizer_state()}  # fmt: skip
        trainer.close()
    return out


def _worker(rank: int, world: int, layouts: list[tuple[str, ...]], plant: bool) -> list[dict]:
    if plant:
        from faults import plant as plant_fault

        plant_fault("muon_local_shard")
    return [optimizer_run((*OPTIONS, *layout)) for layout in layouts]


_REFERENCE: dict[str, dict[str, torch.Tensor]] = {}


def reference() -> dict[str, dict[str, torch.Tensor]]:
    if not _REFERENCE:
        with one_thread():  # as every rank (tests/threads.py)
            _REFERENCE.update(optimizer_run(OPTIONS))
    return _REFERENCE


def worst(got: dict, ref: dict) -> tuple[float, str]:
    """The largest difference of a parameter or momentum buffer from one process, relative
    to the tensor's largest element, and which."""
    out = (0.0, "")
    for kind in ("params", "optim"):
        assert got[kind].keys() == ref[kind].keys(), kind
        for name, want in ref[kind].items():
            if not want.is_floating_point() or not want.abs().max() > 0:
                continue
            err = float((got[kind][name].double() - want.double()).abs().max()
                        / want.double().abs().max())  # fmt: skip
            out = max(out, (err, name))
    return out


def _check(world: int, cases: dict[str, tuple[str, ...]]) -> None:
    ref = reference()
    muon_moved = [n for n in ref["optim"] if n.endswith("momentum_buffer")]
    assert len(muon_moved) > 20, muon_moved  # every matrix is Muon's here
    results = run_ranks(_worker, world, list(cases.values()), False, timeout=560)
    problems, errors = [], {}
    for rank, per_rank in enumerate(results):
        for name, got in zip(cases, per_rank, strict=True):
            err, where = worst(got, ref)
            errors[name] = max(errors.get(name, 0.0), err)
            if err > EQUAL:
                problems.append(f"{name}, rank {rank}: {where} off by {err:.3g} of its scale")
    print(f"worst relative difference per layout: {errors}")
    assert not problems, "\n".join(problems)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_muon_steps_equal_one_process_under_two_rank_layouts_that_shard_matrices() -> None:
    ref = reference()
    moved = [n for n, w in ref["params"].items()
             if w.is_floating_point() and not torch.equal(w, ref["before"][n])]  # fmt: skip
    assert "layers.0.ffn.experts.w1" in moved and "output.weight" in moved
    _check(2, {name: TWO_RANKS[name] for name in IN_CI})


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_muon_steps_equal_one_process_under_every_other_two_rank_layout() -> None:
    _check(2, {name: layout for name, layout in TWO_RANKS.items() if name not in IN_CI})


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_muon_steps_equal_one_process_under_four_rank_compositions() -> None:
    _check(4, FOUR_RANKS)


def update_error(got: dict, ref: dict) -> tuple[float, str]:
    """The largest difference of a parameter from one process's, relative to the largest
    move one process's steps made in that parameter."""
    out = (0.0, "")
    for name, want in ref["params"].items():
        moved = (want.double() - ref["before"][name].double()).abs().max()
        if want.is_floating_point() and moved > 0:
            out = max(out, (float((got["params"][name].double() - want).abs().max() / moved), name))
    return out


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_each_ranks_slice_orthogonalized_alone_is_caught() -> None:
    ref = reference()
    results = run_ranks(_worker, 2, list(PLANTED.values()), True, timeout=560)
    for rank, per_rank in enumerate(results):
        for name, got in zip(PLANTED, per_rank, strict=True):
            err, where = update_error(got, ref)
            print(f"planted, {name}, rank {rank}: {where} off by {err:.3g} of its update")
            assert err >= PLANTED_MIN, (name, rank, err, where)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_muon_state_reshards_across_layouts() -> None:
    """Muon's momentum buffers saved under one layout and loaded under another (DCP
    reshards them like AdamW's moments): ZeRO-1's flat slices resumed under tp2 SP with
    expert TP, EP's expert slices resumed under ZeRO-3; the resumed step reproduces three
    uninterrupted single-process steps (fp32 Newton-Schulz: the whole run is compared)."""
    from multirank import check_reshards

    check_reshards(
        2,
        [
            ("dp2 zero1 -> tp2 SP", ["parallel.zero_stage=1"],
             ["parallel.tp=2", "parallel.sequence_parallel=true"]),
            ("ep2 -> dp2 zero3", ["parallel.ep=2"], ["parallel.zero_stage=3"]),
        ],
        3,
        timeout=560,
        options=("optim.name=muon", "optim.muon_ns_dtype=fp32"),
    )  # fmt: skip
