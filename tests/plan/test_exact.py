"""``moetrain plan`` against real runs at small scale: for each layout the planned parameter,
gradient and optimizer bytes of every rank EQUAL what ``model_state_bytes`` reads from the
real tensors of that rank after a step (parameters and optimizer states after the step,
gradients at their peak), the planned start-up EQUALS what the rank held when the trainer
had started (its parameter and buffer storages, plus the largest generator block its
initialisation drew: ``Engine.init_block``), and the planned activations are within the
accounting's tolerance (``MEMORY_TOL`` of tests/parallel/test_accounting.py) of the tensors
autograd kept (``SavedActivations``) -- with routing forced to balance
(``moe.force_load_balancing``), the routing the plan prices, so that every rank's expert rows
are known. Under ``optim.name=muon`` the planned bytes Muon's all-to-alls (or ZeRO-1's
gathers) send per step and its Newton-Schulz FLOPs EQUAL what the real optimizer step sent
(``CommCounter``) and computed (torch's ``FlopCounterMode``).

One spawned job per world size runs all its layouts (2 ranks: ZeRO-1/2/3, tp + SP, pp
interleaved, ZB-V, cp, ZeRO-1 and ZeRO-3 with Muon; 4 ranks: ep with expert tp and ZeRO-3,
with AdamW and with Muon; under ``-m exhaustive`` 8 ranks: pp x dp x tp); the plans are made
here, in the test process, for every rank. A plan that forgets a shard is caught
(``test_a_plan_that_forgets_a_shard_is_caught``), and so is one that prices Muon's matrices
as if no rank held a slice of them, or as if one rank orthogonalized all of them.
"""

from __future__ import annotations

import tempfile

import pytest
from multirank import micro_config, run_ranks

MEMORY_TOL = 0.05  # the accounting's (tests/parallel/test_accounting.py)
BALANCED = ["moe.force_load_balancing=true", "train.benchmark=true", "train.steps=2"]

LAYOUTS: dict[int, dict[str, list[str]]] = {
    2: {
        "ZeRO-1": ["parallel.zero_stage=1", "train.global_batch_size=4"],
        "ZeRO-2": ["parallel.zero_stage=2", "train.global_batch_size=4"],
        "ZeRO-3": ["parallel.zero_stage=3", "train.global_batch_size=4"],
        "tp=2 + SP": ["parallel.tp=2", "parallel.sequence_parallel=true",
                      "train.global_batch_size=2"],
        "pp=2 interleaved": ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                             "parallel.pp_virtual_stages=2"],
        "pp=2 ZB-V": ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2"],
        "cp=2": ["parallel.cp=2", "train.global_batch_size=2"],
        # Muon: ZeRO-1's flat slices gathered once, in fp32 (optim.muon_ns_dtype)
        "ZeRO-1, Muon": ["parallel.zero_stage=1", "train.global_batch_size=4",
                         "optim.name=muon", "optim.muon_ns_dtype=fp32"],
        # Muon: FSDP2's row shards, each matrix to one owner (optim.muon_distributed=owners)
        "ZeRO-3, Muon": ["parallel.zero_stage=3", "train.global_batch_size=4",
                         "optim.name=muon"],
    },
    4: {
        "ep=2 x expert tp=2 + SP, ZeRO-3": [
            "parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
            "parallel.zero_stage=3", "train.global_batch_size=4"],
        # Muon: each matrix FSDP2 shards over dp, TP splits in blocks or expert TP splits in
        # its FFN width sent to one owner and returned in slices (optim.muon_distributed)
        "ep=2 x expert tp=2 + SP, ZeRO-3, Muon": [
            "parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
            "parallel.zero_stage=3", "train.global_batch_size=4", "optim.name=muon"],
    },
}  # fmt: skip
EIGHT_RANKS = {
    "pp=2 x dp=2 (ZeRO-2) x tp=2 + SP, interleaved": [
        "parallel.pp=2", "parallel.pp_virtual_stages=2", "parallel.tp=2",
        "parallel.sequence_parallel=true", "parallel.zero_stage=2", "train.global_batch_size=8"],
}  # fmt: skip
"""The 3-D composition on 8 ranks: in the exhaustive selection (an 8-rank job costs about as
much as the two above together on two cores)."""


def _measure(rank: int, world: int, layouts: list[list[str]]) -> list[dict[str, int]]:
    from moetrain.parallel.accounting import measure_step, model_state_bytes
    from moetrain.train.trainer import Trainer

    out = []
    for overrides in layouts:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(micro_config(tmp, *BALANCED, *overrides))
            parts = trainer.engine.parts
            storages = {b.untyped_storage()._cdata: b.untyped_storage().nbytes()
                        for part in parts for b in part.buffers()}  # fmt: skip
            start_up = (model_state_bytes(parts, []).params + sum(storages.values())
                        + trainer.engine.init_block * 4)  # fp32 blocks  # fmt: skip
            trainer.train_step()  # Adam states exist
            muon = _count_optimizer_steps(trainer.engine.optimizers)
            report = measure_step(trainer)
            m = report.memory
            out.append(
                {
                    "params": m["step"].params,
                    "grads": max(s.grads for s in m.values()),
                    "optim": m["step"].optim,
                    "activations": report.activations,
                    "start_up": start_up,
                    **muon,
                }
            )
            trainer.close()
    return out


def _count_optimizer_steps(optimizers: list) -> dict[str, int]:
    """Count what the optimizers' next steps send (``CommCounter``, ring convention) and the
    matmul FLOPs they compute (torch's ``FlopCounterMode``): Muon's gathers and
    Newton-Schulz; AdamW's step has neither. Filled in when the steps run."""
    from torch.utils.flop_counter import FlopCounterMode

    from moetrain.parallel.accounting import CommCounter

    counts = {"muon_sent": 0, "muon_flops": 0}

    def counted(step):
        def wrapper(*args, **kwargs):
            with CommCounter() as comm, FlopCounterMode(display=False) as flops:
                out = step(*args, **kwargs)
            counts["muon_sent"] += round(sum(comm.sent_by_kind().values()))
            counts["muon_flops"] += flops.get_total_flops()
            return out

        return wrapper

    for opt in optimizers:
        opt.step = counted(opt.step)
    return counts


def planned(world: int, overrides: list[str]) -> list[dict[str, int]]:
    """Every rank's plan of the layout (its own build, in this process)."""
    import torch

    from moetrain.parallel.dims import ParallelDims
    from moetrain.plan.build import build_rank
    from moetrain.plan.planner import Plan, plan_rank
    from moetrain.train.engine import build_optimizers

    cfg = micro_config(tempfile.mkdtemp(), *BALANCED, *overrides)
    cfg.model.vocab_size = 4096  # the default tokenizer's, as the trainer reads it
    dims = ParallelDims.from_config(cfg.parallel, world).validate(cfg)
    out = []
    for rank in range(world):
        state = build_rank(cfg, dims, rank, build_optimizers, "cpu")
        rp = plan_rank(cfg, dims, state, torch.float32, "cpu")
        start_up = Plan(cfg, dims, "cpu", torch.float32, [rp]).start_up_of(rp)
        out.append(
            {
                "params": state.params,
                "grads": state.grads,
                "optim": state.optim,
                "activations": rp.activations + rp.rope,
                "start_up": start_up,
                "muon_sent": state.muon_sent,
                "muon_flops": state.muon_flops,
            }
        )
    return out


def problems(name: str, plan: list[dict], measured: list[dict]) -> list[str]:
    """Where the plan is not the run: model state not equal, activations beyond MEMORY_TOL."""
    out = []
    for rank, (p, m) in enumerate(zip(plan, measured, strict=True)):
        for key in ("params", "grads", "optim", "start_up", "muon_sent", "muon_flops"):
            if p[key] != m[key]:
                out.append(f"{name}, rank {rank}: {key} planned {p[key]} != measured {m[key]}")
        ratio = p["activations"] / m["activations"]
        if abs(ratio - 1) > MEMORY_TOL:
            out.append(f"{name}, rank {rank}: activations planned / measured = {ratio:.4f}")
    return out


def _whole(t):
    """A DTensor as if it were not sharded: its global shape, a storage of its own."""
    import torch

    return torch.empty(t.shape, dtype=t.dtype, device="meta") if hasattr(t, "to_local") else t


@pytest.fixture(scope="module")
def measured() -> dict[tuple[int, str], list[dict]]:
    out = {}
    for world, layouts in LAYOUTS.items():
        results = run_ranks(_measure, world, list(layouts.values()), timeout=400)
        for i, name in enumerate(layouts):
            out[(world, name)] = [results[rank][i] for rank in range(world)]
    return out


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_plan_equals_the_real_run(measured) -> None:
    found = []
    for (world, name), per_rank in measured.items():
        found += problems(name, planned(world, LAYOUTS[world][name]), per_rank)
    assert not found, "\n".join(found)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_a_plan_that_forgets_a_shard_is_caught(measured, monkeypatch) -> None:
    """The oracle can fail: a plan that counts tensor-parallel and FSDP parameters whole (as
    if the sharding had not happened: at the step and at start-up) and one that forgets the
    pipeline's micro-batches in flight are both reported."""
    from moetrain.plan import activations, build

    world, name = 2, "tp=2 + SP"
    with monkeypatch.context() as m:
        m.setattr(build, "_local", _whole)
        found = problems(name, planned(world, LAYOUTS[world][name]), measured[(world, name)])
    assert any("params planned" in f for f in found), found
    assert any("start_up planned" in f for f in found), found
    name = "pp=2 interleaved"
    with monkeypatch.context() as m:
        m.setattr(activations, "_flat", lambda actions: [])  # no schedule: nothing in flight
        found = problems(name, planned(world, LAYOUTS[world][name]), measured[(world, name)])
    assert any("activations planned" in f for f in found), found
    from moetrain.train import muon_owners

    world, name = 4, "ep=2 x expert tp=2 + SP, ZeRO-3, Muon"
    with monkeypatch.context() as m:  # every slice already at its owner: nothing sent
        m.setattr(muon_owners, "slice_numels",
                  lambda unit: dict.fromkeys(muon_owners.coords_of(unit.sizes), 0))  # fmt: skip
        found = problems(name, planned(world, LAYOUTS[world][name]), measured[(world, name)])
    assert any("muon_sent planned" in f for f in found), found
    with monkeypatch.context() as m:  # every rank owning every matrix
        m.setattr(muon_owners, "assign_owners", lambda flops, n: [0] * len(flops))
        found = problems(name, planned(world, LAYOUTS[world][name]), measured[(world, name)])
    assert any("muon_flops planned" in f for f in found), found


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_plan_equals_the_real_run_on_eight_ranks() -> None:
    results = run_ranks(_measure, 8, list(EIGHT_RANKS.values()), timeout=800)
    found = []
    for i, (name, overrides) in enumerate(EIGHT_RANKS.items()):
        found += problems(name, planned(8, overrides), [results[r][i] for r in range(8)])
    assert not found, "\n".join(found)
