"""Asynchronous checkpoints (``train.checkpoint_async``): what is written is the state of the
step it was staged at, whatever training does meanwhile; one save in flight at a time; a
failure surfaces at the next wait with the previous checkpoint intact; the trainer's
checkpoints equal the synchronous ones, a preemption waits for the save in flight; the
staging memory is what the plan says. Kill -9 at points of an asynchronous save:
tests/train/test_resilience.py."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint import FINGERPRINT, _assert_tree_equal, _state, _trained

from moetrain.config import load_config
from moetrain.train.checkpoint import CheckpointError, CheckpointManager
from moetrain.train.checkpoint import manager as manager_mod
from moetrain.train.trainer import Trainer

pytestmark = pytest.mark.timeout(300)


def _held_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[int]]:
    """Make every DCP write wait until the returned event is set; the list records the
    order in which writes started (by the number of shards written before)."""
    release, started = threading.Event(), []
    write = manager_mod.write_dcp

    def held(app_state: Any, tmp: Path, *args: Any) -> None:
        started.append(int(tmp.name.rsplit("_", 1)[-1]))
        assert release.wait(60), "the test never released the write"
        write(app_state, tmp, *args)

    monkeypatch.setattr(manager_mod, "write_dcp", held)
    return release, started


def _load(mgr: CheckpointManager, path: Path, seed: int) -> tuple[dict[str, Any], Any, Any]:
    model, opt = _trained(seed, steps=1)
    state = _state(model, opt)
    extra = mgr.load(path, state, expected_fingerprint=FINGERPRINT)
    return state, extra, (model, opt)


def test_what_is_written_is_the_staged_state_whatever_training_does_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, _ = _held_writes(monkeypatch)
    model, opt = _trained(seed=0)
    expected = {k: v.clone() for k, v in _state(model, opt)["model"].items()}
    extra = {"step": 3, "data": {"offsets": [1, 2]}}
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save_async(3, _state(model, opt), extra, fingerprint=FINGERPRINT)
    assert mgr.in_flight == 3 and not (tmp_path / "step_00000003").exists()
    with torch.no_grad():  # training goes on: the live tensors change before the write
        for p in model.parameters():
            p.add_(1.0)
    extra["data"]["offsets"].append(3)
    release.set()
    path = mgr.wait()
    assert path == tmp_path / "step_00000003" and mgr.in_flight is None
    assert mgr.staging_bytes > 0
    state, loaded, _ = _load(mgr, path, seed=1)
    _assert_tree_equal(state["model"], expected)
    assert loaded == {"step": 3, "data": {"offsets": [1, 2]}}
    mgr.close()


def test_one_save_in_flight_the_next_waits_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    release, started = _held_writes(monkeypatch)
    model, opt = _trained(seed=0)
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save_async(2, _state(model, opt), {"step": 2}, fingerprint=FINGERPRINT)
    timer = threading.Timer(0.5, release.set)
    timer.start()
    with caplog.at_level(logging.INFO, logger=manager_mod.log.name):
        mgr.save_async(4, _state(model, opt), {"step": 4}, fingerprint=FINGERPRINT)
    assert "checkpoint step 4: waited" in caplog.text and "save of step 2" in caplog.text
    assert (tmp_path / "step_00000002").is_dir()  # published before step 4's write began
    assert mgr.wait() == tmp_path / "step_00000004"
    assert started == [2, 4]
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"
    mgr.close()


def test_a_failed_save_surfaces_at_the_next_wait_and_keeps_the_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    model, opt = _trained(seed=0)
    good = mgr.save(1, _state(model, opt), {"step": 1}, fingerprint=FINGERPRINT)

    def crash(*args: Any) -> None:
        raise OSError("simulated write error")

    monkeypatch.setattr(manager_mod, "write_dcp", crash)
    mgr.save_async(2, _state(model, opt), {"step": 2}, fingerprint=FINGERPRINT)
    with pytest.raises(CheckpointError, match=f"previous checkpoint {good} is intact"):
        mgr.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    mgr.close()


MICRO = [
    "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_dim=64",
    "model.max_seq_len=32", "moe.num_experts=4", "moe.expert_ffn_dim=32",
    "data.seq_len=16", "train.global_batch_size=4", "train.micro_batch_size=2",
    "train.eval_batches=1", "train.eval_every=0", "log.log_every=1", "log.progress_bar=false",
    "optim.warmup_steps=2", "train.steps=4", "train.checkpoint_every=2",
]  # fmt: skip


def _checkpoint_tensors(path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    extra = torch.load(path / "extra.pt", weights_only=True)
    del extra["config"]  # the runs' configs differ in train.output_dir and the key itself
    return torch.load(out, weights_only=False) | {"extra": extra}


def test_the_trainers_asynchronous_checkpoints_are_the_synchronous_ones(tmp_path: Path) -> None:
    runs = {}
    for mode in ("sync", "async"):
        cfg = load_config(None, [*MICRO, f"train.output_dir={tmp_path / mode}",
                                 f"train.checkpoint_async={mode == 'async'}"])  # fmt: skip
        trainer = Trainer(cfg)
        trainer.fit()
        runs[mode] = trainer
        trainer.close()
    for step in (2, 4):
        name = f"checkpoints/step_{step:08d}"
        _assert_tree_equal(_checkpoint_tensors(tmp_path / "async" / name),
                           _checkpoint_tensors(tmp_path / "sync" / name))  # fmt: skip
    # What the plan says the staging takes (exact), and nothing when saves are synchronous.
    from moetrain.plan.planner import plan
    from moetrain.train.engine import build_optimizers

    for mode, trainer in runs.items():
        planned = plan(trainer.cfg, 1, build_optimizers, device_type="cpu").ranks[0]
        assert planned.staging == trainer.ckpt.staging_bytes, mode
    assert runs["async"].ckpt.staging_bytes > 0


def test_a_preemption_waits_for_the_save_in_flight_then_writes_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moetrain.train import trainer as trainer_mod

    release, started = _held_writes(monkeypatch)

    def should_stop(self: Any, device: Any) -> bool:
        if trainer.step < 3:
            return False
        release.set()  # step 2's save is still held: the signal came while it was in flight
        return True

    monkeypatch.setattr(trainer_mod.PreemptionGuard, "should_stop", should_stop)
    cfg = load_config(None, [*MICRO, "train.steps=8", f"train.output_dir={tmp_path}",
                             "train.checkpoint_async=true"])  # fmt: skip
    trainer = Trainer(cfg)
    summary = trainer.fit()
    trainer.close()
    assert summary["step"] == 3 and trainer.step == 3
    assert started == [2, 3]  # step 2's save (in flight when the signal came), then step 3's
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000003"
    assert (ckpts / "step_00000002").is_dir()


def _layout_runs(rank: int, world_size: int, root: str, layouts: list[str]) -> None:
    for layout in layouts:
        for mode in ("sync", "async"):
            cfg = load_config(None, [*MICRO, layout, f"train.checkpoint_async={mode == 'async'}",
                                     f"train.output_dir={root}/{layout}/{mode}"])  # fmt: skip
            trainer = Trainer(cfg)
            trainer.fit()
            trainer.close()


@pytest.mark.slow
@pytest.mark.multirank
def test_sharded_states_stage_and_save_as_the_synchronous_save_does(tmp_path: Path) -> None:
    """Under ZeRO-3 (FSDP2's DTensor shards) and tensor parallelism (DTensor column and row
    blocks) each rank stages its local shards with their placements, and the background save
    runs over the trainer's own gloo group: the checkpoints are the synchronous ones."""
    from multirank import run_ranks

    layouts = ["parallel.zero_stage=3", "parallel.tp=2"]
    run_ranks(_layout_runs, 2, str(tmp_path), layouts, timeout=600)
    for layout in layouts:
        for step in (2, 4):
            name = f"checkpoints/step_{step:08d}"
            _assert_tree_equal(_checkpoint_tensors(tmp_path / layout / "async" / name),
                               _checkpoint_tensors(tmp_path / layout / "sync" / name))  # fmt: skip
