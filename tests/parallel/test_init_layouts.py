"""Every layout starts from the single process's parameters, bit for bit.

The trainer builds the model on the meta device, applies the layout there and initialises
only this rank's shards (``moetrain.parallel.materialize``): each parameter's values are a
function of the seed, its name and the position in the tensor, never of the layout
(``moetrain.model.init``). Here the initial full state -- every parameter and persistent
buffer gathered over every parallel dimension -- of the micro MoE under tp=2 + SP (tied
embeddings), ZeRO-3, pp=2 (with a multi-token-prediction module: the last stage's copy of
the embedding), cp=2, and ep=2 x expert tp=2 + ZeRO-3 is compared with ``build_model``'s
(which the single-process trainer uses) with ``torch.equal``. The equivalence matrix then
compares gradients from step 1 on.

The check can fail: a materialisation that draws every shard as if it began the tensor
(offsets forgotten: each rank's rows are the first rows; ``init_offsets_forgotten`` of
tests/faults.py) is caught under ZeRO-3 and tp.

Cost: one 2-rank job (five trainer starts) and one 4-rank job (one), ~30 s on 2 busy cores;
no step is run.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from multirank import micro_config, run_ranks

TWO_RANKS: dict[str, list[str]] = {
    "tp=2 + SP, tied embeddings": ["parallel.tp=2", "parallel.sequence_parallel=true",
                                   "model.tie_embeddings=true", "train.global_batch_size=2"],
    "ZeRO-3": ["parallel.zero_stage=3", "train.global_batch_size=4"],
    "pp=2 + MTP": ["parallel.pp=2", "model.mtp_depth=1"],
    "cp=2": ["parallel.cp=2", "train.global_batch_size=2"],
}  # fmt: skip
FOUR_RANKS: dict[str, list[str]] = {
    "ep=2 x expert tp=2 + SP, ZeRO-3": [
        "parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
        "parallel.zero_stage=3", "train.global_batch_size=4"],
}  # fmt: skip
INJECTED = ["ZeRO-3", "tp=2 + SP, tied embeddings"]
"""Layouts run again with the offsets forgotten: the oracle must see them differ."""


def _initial_states(rank: int, world: int, layouts: list[list[str]], inject: bool):
    from moetrain.train.trainer import Trainer

    if inject:
        from faults import plant

        plant("init_offsets_forgotten")
    out = []
    for overrides in layouts:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(micro_config(tmp, *overrides))
            out.append(trainer.full_model_state_dict())
            trainer.close()
    return out


def reference(overrides: list[str]) -> dict[str, torch.Tensor]:
    """The single process's initial state: ``build_model`` from the seed."""
    from moetrain.model import build_model

    cfg = micro_config(tempfile.mkdtemp(), *overrides)
    cfg.model.vocab_size = 4096  # the default tokenizer's, as the trainer reads it
    return build_model(cfg.model, cfg.moe, seed=cfg.train.seed).state_dict()


def differences(name: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]):
    if got.keys() != want.keys():
        return [f"{name}: names differ: {sorted(got.keys() ^ want.keys())}"]
    return [f"{name}: {k} differs (max |diff| {(got[k] - want[k]).abs().max():.3g})"
            for k in want if not torch.equal(got[k], want[k])]  # fmt: skip


@pytest.fixture(scope="module")
def states() -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for world, layouts in ((2, TWO_RANKS), (4, FOUR_RANKS)):
        result = run_ranks(_initial_states, world, list(layouts.values()), False, timeout=400)
        for i, name in enumerate(layouts):
            out[name] = result[0][i]
    return out


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_every_layout_starts_from_the_single_process_parameters(states) -> None:
    found = []
    for name, overrides in {**TWO_RANKS, **FOUR_RANKS}.items():
        found += differences(name, states[name], reference(overrides))
    assert not found, "\n".join(found)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_a_layout_dependent_init_is_caught() -> None:
    layouts = [TWO_RANKS[name] for name in INJECTED]
    result = run_ranks(_initial_states, 2, layouts, True, timeout=400)
    for i, name in enumerate(INJECTED):
        found = differences(name, result[0][i], reference(TWO_RANKS[name]))
        assert found, f"{name}: a shard drawn from the tensor's start went unnoticed"
