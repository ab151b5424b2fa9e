"""Shared experts computed while the expert-parallel all-to-all is in flight
(``parallel.overlap_shared_experts``) give exactly the numbers of the plain order.

The overlapped layer issues the row all-to-all asynchronously, runs the shared experts,
then waits; the plain layer computes the shared experts after the combine. The same
operations on the same tensors: losses, every gradient of every step and the final
parameters must be bitwise equal, with and without expert TP, padded capacity and
activation checkpointing (which recomputes the overlapped forward); and the overlapped run
must really have taken the overlapped path (the dispatcher counts it).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from multirank import micro_run, run_ranks

STEPS = 2
SMALL = ("model.dim=32", "model.ffn_dim=64", "moe.expert_ffn_dim=32", "data.seq_len=16",
         "moe.shared_expert_gate=true")  # fmt: skip
PAIRS = {
    "ep=2 padded, full AC, zero3": [
        "parallel.ep=2", "moe.pad_to_capacity=true", "parallel.activation_checkpointing=full",
        "parallel.zero_stage=3"],
}  # fmt: skip
EXPERT_TP = {"ep=2 x tp=2 expert TP": ["parallel.ep=2", "parallel.tp=2"]}


def _worker(rank: int, world: int, layouts: dict[str, list[str]]) -> dict[str, tuple]:
    from moetrain.train.trainer import Trainer

    out = {}
    for name, overrides in layouts.items():
        runs = []
        for overlap in (False, True):
            extra = [f"parallel.overlap_shared_experts={str(overlap).lower()}"]
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(micro_run(tmp, STEPS, *SMALL, *overrides, *extra, traffic=False))
        calls = 0
        with tempfile.TemporaryDirectory() as tmp:  # the path the overlapped run took
            from multirank import micro_config

            trainer = Trainer(
                micro_config(
                    tmp, "train.steps=1", *SMALL, *overrides, "parallel.overlap_shared_experts=true"
                )
            )
            trainer.train_step()
            layers = trainer.engine.moe.values()
            calls = min(getattr(m.dispatcher, "overlapped", 0) for m in layers)
            trainer.close()
        out[name] = (runs[0], runs[1], calls)
    return out


def _assert_equal(plain: dict, overlapped: dict, what: str) -> None:
    assert plain["loss"] == overlapped["loss"], what
    for step, (g, r) in enumerate(zip(overlapped["grads"], plain["grads"], strict=True)):
        for name in r:
            assert torch.equal(g[name], r[name]), f"{what}: grad[step {step} {name}] differs"
    for name in plain["params"]:
        assert torch.equal(overlapped["params"][name], plain["params"][name]), (what, name)


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_overlapped_shared_experts_equal_the_plain_order_on_two_ranks() -> None:
    results = run_ranks(_worker, 2, PAIRS, timeout=280)
    for rank, per_rank in enumerate(results):
        for name, (plain, overlapped, calls) in per_rank.items():
            _assert_equal(plain, overlapped, f"{name} (rank {rank})")
            assert calls > 0, f"{name}: the overlapped path never ran"


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_overlapped_shared_experts_equal_the_plain_order_under_expert_tp() -> None:
    results = run_ranks(_worker, 4, EXPERT_TP, timeout=280)
    for rank, per_rank in enumerate(results):
        for name, (plain, overlapped, calls) in per_rank.items():
            _assert_equal(plain, overlapped, f"{name} (rank {rank})")
            assert calls > 0, f"{name}: the overlapped path never ran"


def test_overlap_is_refused_where_there_is_no_all_to_all_or_no_shared_expert() -> None:
    from moetrain.config import ConfigError, load_config
    from moetrain.parallel.dims import ParallelDims

    with pytest.raises(ConfigError, match="parallel.overlap_shared_experts: .* needs parallel.ep"):
        load_config(None, ["parallel.overlap_shared_experts=true"])
    with pytest.raises(ConfigError, match="parallel.ep_dispatcher=all_to_all"):
        load_config(
            None,
            [
                "parallel.overlap_shared_experts=true",
                "parallel.ep=2",
                "parallel.ep_dispatcher=all_gather",
            ],
        )
    cfg = load_config(
        None,
        [
            "parallel.overlap_shared_experts=true",
            "parallel.ep=2",
            "moe.num_shared_experts=0",
            "model.vocab_size=512",
        ],
    )
    with pytest.raises(ConfigError, match="moe.num_shared_experts=0 .* nothing to overlap"):
        ParallelDims.from_config(cfg.parallel, 2).validate(cfg)
