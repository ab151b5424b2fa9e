"""Routing replay in training (``train.routing_replay``) and the routing record
(``train.record_routing``).

- Replaying a run's own recorded routing reproduces the unreplayed run exactly: the same
  losses and bit-identical parameters, with router jitter, the aux-loss-free bias and
  capacity dropping all on (so the router's own choice depends on state the replay must
  not disturb).
- Replaying a different routing changes exactly the tokens it should: in the first MoE layer
  of the first step, the output rows of the tokens whose expert set was changed differ and
  every other row is bit-identical (dropless, so no token's capacity slot moves).
- The router keeps learning: its gate gets the same gradient as without replay when the
  replayed routing is its own, and the balancing losses count the replayed choices.
- A replay file that does not fit the step is refused with a message naming the key.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from multirank import micro_config

from moetrain.config import ConfigError
from moetrain.train.replay import load_replay_step, save_record, step_file
from moetrain.train.trainer import Trainer

STEPS = 3
OPTIONS = ("moe.jitter_eps=0.1", "moe.expert_bias_rate=0.01", "moe.capacity_factor=1.0")


def _train(out: str, *overrides: str, hook=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    trainer = Trainer(micro_config(out, f"train.steps={STEPS}", *OPTIONS, *overrides))
    if hook is not None:
        hook(trainer)
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    params = trainer.full_model_state_dict()
    trainer.close()
    return losses, params


def test_replaying_the_runs_own_routing_reproduces_it_exactly(tmp_path: Path) -> None:
    ref_losses, ref_params = _train(str(tmp_path / "a"), "train.record_routing=true")
    record = tmp_path / "a" / "routing" / "train"
    assert sorted(p.name for p in record.iterdir()) == [
        f"step_{s:08d}.pt" for s in range(1, STEPS + 1)
    ]
    losses, params = _train(str(tmp_path / "b"), f"train.routing_replay={record}")
    assert losses == ref_losses
    for name, value in ref_params.items():
        assert torch.equal(params[name], value), name
    # The record is the routing the router chose: a run whose routing differs diverges.
    other = tmp_path / "other"
    for step in range(1, STEPS + 1):
        trace = torch.load(step_file(record, step), weights_only=True)
        ids = {k: (v.view(8, 32, 2) + 1) % 4 for k, v in trace["ids"].items()}
        save_record(other, step, {"input_ids": trace["input_ids"][0], "ids": ids}, 4, 2, 0.0)
    changed, _ = _train(str(tmp_path / "c"), f"train.routing_replay={other}")
    assert changed[0] != ref_losses[0]


def _layer0_outputs(out: str, *overrides: str) -> torch.Tensor:
    """The first MoE layer's output rows (global token order) of the first step's forwards."""
    rows: list[torch.Tensor] = []

    def hook(trainer) -> None:
        layer = trainer.engine.moe[0]
        layer.register_forward_hook(lambda _m, _i, y: rows.append(y.detach().clone()))

    trainer = Trainer(micro_config(out, "train.steps=1", *OPTIONS, "moe.capacity_factor=null",
                                   *overrides))  # fmt: skip
    hook(trainer)
    trainer.train_step()
    trainer.close()
    return torch.cat(rows).flatten(0, 1)


def test_replaying_another_routing_changes_exactly_its_tokens(tmp_path: Path) -> None:
    ref = _layer0_outputs(str(tmp_path / "a"), "train.record_routing=true")
    trace = torch.load(step_file(tmp_path / "a" / "routing" / "train", 1), weights_only=True)
    ids = {k: v.view(-1, 2).to(torch.int64).clone() for k, v in trace["ids"].items()}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randperm(ids[0].shape[0], generator=gen)[:20]
    for t in tokens.tolist():  # a different pair of experts for these tokens of layer 0
        old = set(ids[0][t].tolist())
        ids[0][t] = torch.tensor(sorted(set(range(4)) - old))
    replay = tmp_path / "replay"
    save_record(replay, 1, {"input_ids": trace["input_ids"][0],
                            "ids": {k: v.view(8, 32, 2) for k, v in ids.items()}}, 4, 2, 0.0)
    got = _layer0_outputs(str(tmp_path / "b"), f"train.routing_replay={replay}")
    differs = (got != ref).any(-1)
    assert sorted(torch.nonzero(differs).flatten().tolist()) == sorted(tokens.tolist())


def test_the_router_learns_under_replay_and_the_losses_count_replayed_choices(
    tmp_path: Path,
) -> None:
    grads: dict[str, list[torch.Tensor]] = {}
    stats: dict[str, dict] = {}

    def run(name: str, *overrides: str) -> None:
        trainer = Trainer(micro_config(str(tmp_path / name), "train.steps=1", *OPTIONS,
                                       *overrides))  # fmt: skip
        trainer.engine.grad_hook = lambda e: grads.setdefault(name, []).append(
            e.full_grad_dict()["layers.0.ffn.router.gate.weight"])
        stats[name] = trainer.train_step().moe
        trainer.close()

    run("own", "train.record_routing=true")
    run("replay", f"train.routing_replay={tmp_path / 'own' / 'routing' / 'train'}")
    assert grads["own"][0].abs().max() > 0
    assert torch.equal(grads["replay"][0], grads["own"][0])
    # Tokens per expert (and so the switch loss's f and the bias update) are the replayed
    # choices: every token of layer 0 on experts 0 and 1.
    trace = torch.load(step_file(tmp_path / "own" / "routing" / "train", 1), weights_only=True)
    forced = {k: torch.tensor([0, 1]).expand_as(v.view(-1, 2)).reshape(8, 32, 2)
              for k, v in trace["ids"].items()}  # fmt: skip
    save_record(tmp_path / "forced", 1, {"input_ids": trace["input_ids"][0], "ids": forced},
                4, 2, 0.0)  # fmt: skip
    run("forced", f"train.routing_replay={tmp_path / 'forced'}")
    assert stats["forced"][0]["tokens_per_expert"].tolist() == [256.0, 256.0, 0.0, 0.0]
    assert grads["forced"][0].abs().max() > 0


def test_a_replay_that_does_not_fit_the_step_is_refused(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(micro_config(out, "train.steps=1", "train.record_routing=true"))
        trainer.train_step()
        trainer.close()
        good = torch.load(step_file(Path(out) / "routing" / "train", 1), weights_only=True)
    inputs, ids = good["input_ids"][0], {k: v.view(8, 32, 2) for k, v in good["ids"].items()}

    def refused(name: str, record: dict, pattern: str, **kw) -> None:
        d = tmp_path / name
        save_record(d, 1, record, 4, 2, 0.0)
        with pytest.raises(ConfigError, match=f"train.routing_replay: .*{pattern}"):
            load_replay_step(d, 1, [0, 1, 2, 3], kw.get("gbs", 8), 32, 4, kw.get("k", 2))

    refused("k", {"input_ids": inputs, "ids": ids}, r"expected \(1, 256, 3\)", k=3)
    refused("range", {"input_ids": inputs, "ids": {**ids, 2: ids[2] + 4}}, "outside")
    refused("layer", {"input_ids": inputs, "ids": {0: ids[0]}}, "no routing for MoE layer 1")
    refused("batch", {"input_ids": inputs, "ids": ids}, "holds 8 sequences", gbs=16)
    with pytest.raises(ConfigError, match="train.routing_replay: no routing for step 2"):
        load_replay_step(tmp_path / "k", 2, [0], 8, 32, 4, 2)
    # Another step's file for step 1: its input_ids are not step 1's batch.
    trainer = Trainer(micro_config(str(tmp_path / "run"), "train.steps=2",
                                   "train.record_routing=true"))  # fmt: skip
    trainer.train_step()
    trainer.train_step()
    trainer.close()
    shifted = tmp_path / "shifted"
    shifted.mkdir()
    step_file(tmp_path / "run" / "routing" / "train", 2).rename(step_file(shifted, 1))
    trainer = Trainer(micro_config(str(tmp_path / "r2"), "train.steps=1",
                                   f"train.routing_replay={shifted}"))  # fmt: skip
    with pytest.raises(ConfigError, match="not the step's global batch"):
        trainer.train_step()
    trainer.close()
    with pytest.raises(ConfigError, match="train.routing_replay: .* is not a directory"):
        micro_config(str(tmp_path / "r3"), f"train.routing_replay={tmp_path / 'missing'}")
