"""CheckpointManager: round trips, atomic publish, pruning, damage detection, errors, 2 ranks."""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moetrain.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    read_manifest,
    step_dir_name,
    verify_checkpoint,
)
from moetrain.train.checkpoint import write as write_mod

pytestmark = pytest.mark.timeout(60)

FINGERPRINT = {"dim": 4, "n_layers": 2, "num_experts": 3}


class Tiny(nn.Module):
    def __init__(self, out: int = 3) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.experts = nn.Parameter(torch.randn(2, 8, 8) * 0.1)
        self.down = nn.Linear(8, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.up(x)))
        return self.down(h + torch.einsum("bd,edf->bf", h, self.experts))


def _trained(seed: int, steps: int = 3, out: int = 3) -> tuple[Tiny, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Tiny(out)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _save(mgr: CheckpointManager, step: int, seed: int = 0, **kw: Any) -> Path:
    model, opt = _trained(seed)
    return mgr.save(step, _state(model, opt), {"step": step}, fingerprint=FINGERPRINT, **kw)


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _assert_tree_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_tree_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_tree_equal(x, y)
    else:
        assert a == b


# ----------------------------------------------------------------------------- round trip


def test_round_trip_restores_params_optimizer_and_extra(tmp_path: Path) -> None:
    model, opt = _trained(seed=0)
    np_state = np.random.get_state()
    extra = {
        "step": 3,
        "rng": {
            "torch": torch.get_rng_state(),
            "python": list(random.getstate()[1]),
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        },
        "data": {"epoch": 1, "offsets": [0, 17, 34], "name": "default", "frac": 0.25},
        "nested": ({"a": None}, [True, 2.5]),
    }
    mgr = CheckpointManager(tmp_path, keep_last=2)
    path = mgr.save(3, _state(model, opt), extra, fingerprint=FINGERPRINT)
    assert path == tmp_path / "step_00000003"
    assert _entries(path) == [".metadata", "__0_0.distcp", "extra.pt", "manifest.json"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    assert mgr.latest() == path
    verify_checkpoint(path)

    fresh, fresh_opt = _trained(seed=1, steps=1)  # other values, same shapes
    state = _state(fresh, fresh_opt)
    loaded = mgr.load(path, state, expected_fingerprint=FINGERPRINT)
    set_state_dict(
        fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )

    _assert_tree_equal(loaded, extra | {"nested": loaded["nested"]})
    assert loaded["nested"][0] == {"a": None} and list(loaded["nested"][1]) == [True, 2.5]
    _assert_tree_equal(fresh.state_dict(), model.state_dict())
    _assert_tree_equal(fresh_opt.state_dict(), opt.state_dict())

    # The proof that optimizer state came back whole: the next step is bit-identical.
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x).square().mean().backward()
        o.step()
    _assert_tree_equal(fresh.state_dict(), model.state_dict())


def test_extra_file_loads_under_weights_only(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=1)
    path = mgr.save(
        1,
        {"model": Tiny().state_dict()},
        {"rng": torch.get_rng_state(), "cfg": {"lr": 1e-3}, "step": 1},
    )
    extra = torch.load(path / "extra.pt", weights_only=True)
    assert extra["cfg"] == {"lr": 1e-3} and extra["rng"].dtype == torch.uint8
    assert "sha256" in read_manifest(path)["files"]["extra.pt"]


def test_non_plain_extra_refused_before_writing(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    good = _save(mgr, 1)
    with pytest.raises(CheckpointError, match=r"extra\['data'\]\['order'\] is a numpy.ndarray"):
        mgr.save(2, {"model": Tiny().state_dict()}, {"data": {"order": np.arange(3)}})
    assert _entries(tmp_path) == ["latest", "step_00000001"]
    assert mgr.latest() == good


def test_stateful_objects_and_per_rank_extra(tmp_path: Path) -> None:
    model, opt = _trained(seed=0)
    mgr = CheckpointManager(tmp_path, keep_last=1)
    path = mgr.save(4, {"model": model}, {"who": "rank0"}, per_rank=True)
    assert (path / "extra_rank0.pt").is_file() and not (path / "extra.pt").exists()
    fresh = Tiny()
    assert mgr.load(path, {"model": fresh}) == {"who": "rank0"}
    _assert_tree_equal(fresh.state_dict(), model.state_dict())


def test_load_accepts_a_checkpoint_root(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1)
    _save(mgr, 2, seed=5)
    model, opt = _trained(seed=9)
    assert mgr.load(tmp_path, _state(model, opt))["step"] == 2
    _assert_tree_equal(model.state_dict(), _trained(seed=5)[0].state_dict())


# ----------------------------------------------------------------------------- keep_last


def test_keep_last_keeps_newest(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        _save(mgr, step)
    assert _entries(tmp_path) == ["latest", "step_00000030", "step_00000040"]
    assert mgr.latest() == tmp_path / "step_00000040"

    one = CheckpointManager(tmp_path / "one", keep_last=1)
    for step in (1, 2):
        _save(one, step)
    assert _entries(tmp_path / "one") == ["latest", "step_00000002"]


def test_keep_last_counts_only_verified_checkpoints(tmp_path: Path) -> None:
    # keep_last=2 with the second-newest damaged: the older good one stays as the spare.
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        _save(mgr, step)
    os.truncate(tmp_path / "step_00000003" / "__0_0.distcp", 10)
    _save(mgr, 4)
    assert _entries(tmp_path) == ["latest", "step_00000002", "step_00000003", "step_00000004"]
    _save(mgr, 5)
    assert _entries(tmp_path) == ["latest", "step_00000004", "step_00000005"]


def test_resaving_an_existing_step_replaces_it(tmp_path: Path) -> None:
    # A run resumed from an older checkpoint saves steps that exist already.
    mgr = CheckpointManager(tmp_path, keep_last=5)
    _save(mgr, 1, seed=0)
    _save(mgr, 2, seed=0)
    _save(mgr, 1, seed=7)
    assert mgr.latest() == tmp_path / "step_00000001"
    assert _entries(tmp_path) == ["latest", "step_00000001", "step_00000002"]
    model, opt = _trained(seed=3)
    mgr.load(tmp_path / "step_00000001", _state(model, opt))
    _assert_tree_equal(model.state_dict(), _trained(seed=7)[0].state_dict())


# ----------------------------------------------------------------------------- crashes


def test_crash_inside_dcp_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    good = _save(mgr, 1)

    def crash(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("simulated crash in the shard writer")

    monkeypatch.setattr(dcp_fs, "_write_item", crash)
    with pytest.raises(CheckpointError) as info:
        _save(mgr, 2)
    msg = str(info.value)
    assert "step 2" in msg and "simulated crash in the shard writer" in msg
    assert f"previous checkpoint {good} is intact" in msg
    assert _entries(tmp_path) == ["latest", "step_00000001"]
    monkeypatch.undo()
    assert mgr.latest() == good
    model, opt = _trained(seed=4)
    assert mgr.load(mgr.latest(), _state(model, opt))["step"] == 1


def test_crash_before_publish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    good = _save(mgr, 1)
    real_replace = os.replace

    def failing_rename(src: Any, dst: Any) -> None:
        if Path(dst).name.startswith("step_"):
            raise OSError(errno.EIO, "simulated I/O error", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_rename)
    with pytest.raises(CheckpointError, match="simulated I/O error"):
        _save(mgr, 2)
    monkeypatch.undo()
    assert _entries(tmp_path) == ["latest", "step_00000001"]
    assert mgr.latest() == good


def test_leftovers_of_a_killed_process_are_never_used(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    good = _save(mgr, 1)
    # A save killed after writing everything but before the rename: complete, yet unpublished.
    shutil.copytree(good, tmp_path / ".tmp-step_00000002")
    assert mgr.latest() == good
    # The next save clears it away.
    _save(mgr, 3)
    assert _entries(tmp_path) == ["latest", "step_00000001", "step_00000003"]


def test_crash_between_rename_and_pointer(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1)
    second = _save(mgr, 2)
    (tmp_path / "latest").unlink()  # the first save died before writing the pointer
    assert mgr.latest() == second
    (tmp_path / "latest").write_text("step_00000009\n")  # names a directory that is gone
    assert mgr.latest() == second
    (tmp_path / "latest").write_text("../../etc\n")  # not a checkpoint name at all
    assert mgr.latest() == second
    assert CheckpointManager(tmp_path / "nothing", keep_last=1).latest() is None


# ----------------------------------------------------------------------------- damage


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("truncate_shard", r"__0_0\.distcp is \d+ bytes but manifest\.json records \d+"),
        ("delete_extra", r"extra\.pt is missing"),
        ("delete_manifest", r"manifest\.json is missing"),
        ("garble_metadata", r"\.metadata is unreadable"),
        ("flip_extra_byte", r"extra\.pt does not match its sha256"),
        ("shard_shorter_than_metadata", r"__0_0\.distcp is \d+ bytes but \.metadata needs \d+"),
    ],
)
def test_damaged_checkpoint_skipped_and_refused(tmp_path: Path, damage: str, expected: str) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    good = _save(mgr, 1)
    bad = _save(mgr, 2)
    shard, extra, meta = bad / "__0_0.distcp", bad / "extra.pt", bad / ".metadata"
    if damage == "truncate_shard":
        os.truncate(shard, shard.stat().st_size // 2)
    elif damage == "delete_extra":
        extra.unlink()
    elif damage == "delete_manifest":
        (bad / "manifest.json").unlink()
    elif damage == "garble_metadata":
        meta.write_bytes(b"\0" * meta.stat().st_size)
    elif damage == "flip_extra_byte":
        data = bytearray(extra.read_bytes())
        data[len(data) // 2] ^= 0xFF
        extra.write_bytes(bytes(data))
    else:  # truncated, and the manifest "fixed" to match: DCP's own index still knows
        os.truncate(shard, shard.stat().st_size - 100)
        manifest_path = bad / "manifest.json"
        text = manifest_path.read_text()
        size = shard.stat().st_size
        manifest_path.write_text(text.replace(f'"size": {size + 100}', f'"size": {size}'))

    assert mgr.latest() == good
    with pytest.raises(CheckpointError, match=expected) as info:
        verify_checkpoint(bad)
    assert str(bad) in str(info.value)
    model, opt = _trained(seed=0)
    with pytest.raises(CheckpointError, match=expected) as info:
        mgr.load(bad, _state(model, opt))
    assert str(bad) in str(info.value)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        verify_checkpoint(tmp_path / "missing")
    (tmp_path / "step_00000001").mkdir()
    (tmp_path / "step_00000001" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is unreadable"):
        verify_checkpoint(tmp_path / "step_00000001")
    (tmp_path / "step_00000001" / "manifest.json").write_text(
        '{"format": "moetrain-checkpoint/1", "step": 1, "world_size": 1, "files": {"a": {}}}'
    )
    with pytest.raises(CheckpointError, match="manifest.json is malformed"):
        verify_checkpoint(tmp_path / "step_00000001")
    assert CheckpointManager(tmp_path, keep_last=1).latest() is None


def test_fingerprint_mismatch_names_the_keys(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=1)
    path = _save(mgr, 1)
    model, opt = _trained(seed=0)
    other = FINGERPRINT | {"n_layers": 4, "top_k": 2}
    del other["num_experts"]
    with pytest.raises(CheckpointError) as info:
        mgr.load(path, _state(model, opt), expected_fingerprint=other)
    msg = str(info.value)
    assert f"checkpoint {path} was saved for a different model" in msg
    assert "n_layers: checkpoint has 2, this run has 4" in msg
    assert "num_experts: only in the checkpoint" in msg and "top_k: not in the checkpoint" in msg
    assert "dim:" not in msg.replace("different model:", "")


def test_tensor_shape_mismatch_is_wrapped(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=1)
    path = _save(mgr, 1)
    model, opt = _trained(seed=0, out=5)  # down: 8 -> 5 instead of 8 -> 3
    with pytest.raises(CheckpointError, match=r"Size mismatch.*model\.down\.weight") as info:
        mgr.load(path, _state(model, opt))
    assert str(info.value).startswith(f"cannot load checkpoint {path}:")


# ----------------------------------------------------------------------------- full disk


def _enospc(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["shard_write", "fsync", "chunk_sync"])
def test_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    good = _save(mgr, 1)
    if where == "shard_write":
        monkeypatch.setattr(dcp_fs, "_write_item", _enospc)
    elif where == "fsync":
        monkeypatch.setattr(os, "fsync", _enospc)
    else:  # the error a delayed allocation reports when a shard's chunk is synced
        monkeypatch.setattr(write_mod, "_datasync", _enospc)
    with pytest.raises(CheckpointError) as info:
        _save(mgr, 2)
    monkeypatch.undo()
    msg = str(info.value)
    assert "the disk is full" in msg and "No space left on device" in msg
    assert f"The previous checkpoint {good} is intact" in msg
    assert _entries(tmp_path) == ["latest", "step_00000001"]
    assert mgr.latest() == good


def test_full_disk_on_first_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    monkeypatch.setattr(dcp_fs, "_write_item", _enospc)
    with pytest.raises(CheckpointError, match="disk is full.*No earlier checkpoint exists"):
        _save(mgr, 1)
    assert _entries(tmp_path) == []


def test_shards_are_synced_a_chunk_at_a_time_and_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard files reach the disk as they are written (every SYNC_CHUNK bytes, and their
    tail at close, which DCP's own fsync before close misses), and read back unchanged."""
    synced: list[int] = []  # the file's size at each sync

    def datasync(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)
        os.fdatasync(fd)

    monkeypatch.setattr(write_mod, "SYNC_CHUNK", 1024)
    monkeypatch.setattr(write_mod, "_datasync", datasync)
    mgr = CheckpointManager(tmp_path, keep_last=1)
    path = _save(mgr, 1)
    size = (path / "__0_0.distcp").stat().st_size
    assert len(synced) >= size // 2048 > 1 and size in synced  # chunks, and the tail
    model, opt = _trained(seed=0)
    fresh, fresh_opt = _trained(seed=1, steps=1)
    state = _state(fresh, fresh_opt)
    mgr.load(path, state, expected_fingerprint=FINGERPRINT)
    _assert_tree_equal(state, _state(model, opt))


def test_step_dir_name_and_arguments() -> None:
    assert step_dir_name(100) == "step_00000100"
    assert step_dir_name(123_456_789) == "step_123456789"
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager("x", keep_last=0)
    with pytest.raises(CheckpointError, match="needs torch.distributed"):
        CheckpointManager("x", keep_last=1, rank=1, world_size=2).save(1, {}, {})


# ----------------------------------------------------------------------------- two ranks


def _two_rank_worker(rank: int, root: str, rendezvous: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    try:
        root_path = Path(root)
        mgr = CheckpointManager(root_path, keep_last=2, rank=rank, world_size=2)
        model, opt = _trained(seed=0)  # the same replicated model on both ranks
        first = mgr.save(
            5, _state(model, opt), {"rank": rank}, per_rank=True, fingerprint=FINGERPRINT
        )
        model2, opt2 = _trained(seed=0, steps=4)
        second = mgr.save(6, _state(model2, opt2), {"step": 6}, fingerprint=FINGERPRINT)
        assert mgr.latest() == second == root_path / "step_00000006"

        # Rank 1 alone fails: both ranks raise, neither hangs, nothing is published.
        bad = {"x": np.zeros(2)} if rank == 1 else {"x": 0}
        try:
            mgr.save(7, _state(model2, opt2), bad, per_rank=True)
        except CheckpointError as exc:
            assert "rank 1: extra['x'] is a numpy.ndarray" in str(exc), str(exc)
            assert f"previous checkpoint {second} is intact" in str(exc), str(exc)
        else:
            raise AssertionError("the save with a bad extra on rank 1 went through")
        assert sorted(p.name for p in root_path.iterdir()) == [
            "latest",
            "step_00000005",
            "step_00000006",
        ]

        fresh, fresh_opt = _trained(seed=rank + 10, steps=1)
        state = _state(fresh, fresh_opt)
        assert mgr.load(first, state, expected_fingerprint=FINGERPRINT) == {"rank": rank}
        set_state_dict(
            fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        _assert_tree_equal(fresh.state_dict(), model.state_dict())
        _assert_tree_equal(fresh_opt.state_dict(), opt.state_dict())

        state = _state(fresh, fresh_opt)
        assert mgr.load(mgr.latest(), state) == {"step": 6}
        set_state_dict(
            fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        _assert_tree_equal(fresh.state_dict(), model2.state_dict())
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_two_ranks_gloo(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    mp.spawn(_two_rank_worker, args=(str(root), str(tmp_path / "rendezvous")), nprocs=2, join=True)
    manifest = read_manifest(root / "step_00000005")
    assert manifest["world_size"] == 2 and manifest["per_rank_extra"]
    assert {"extra_rank0.pt", "extra_rank1.pt", ".metadata"} <= set(manifest["files"])
    # Readable by a single process too (the model was replicated, so nothing is missing).
    model, opt = _trained(seed=3)
    extra = CheckpointManager(root, keep_last=2).load(root / "step_00000006", _state(model, opt))
    assert extra == {"step": 6}


def test_save_that_does_not_verify_is_not_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A writer that reports more bytes than it wrote (a lying filesystem, a silent short write):
    # the check before the rename catches it and the previous checkpoint stays current.
    mgr = CheckpointManager(tmp_path, keep_last=2)
    good = _save(mgr, 1)
    real_write_item = dcp_fs._write_item

    def short_write(*args: Any, **kwargs: Any) -> Any:
        result = real_write_item(*args, **kwargs)
        longer = dataclasses.replace(result.storage_data, length=result.storage_data.length + 1000)
        return dataclasses.replace(result, storage_data=longer)

    monkeypatch.setattr(dcp_fs, "_write_item", short_write)
    with pytest.raises(CheckpointError, match=r"does not verify: .*\.metadata needs"):
        _save(mgr, 2)
    monkeypatch.undo()
    assert _entries(tmp_path) == ["latest", "step_00000001"]
    assert mgr.latest() == good
