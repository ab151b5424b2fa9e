"""Nothing moetrain loads executes code: checkpoint metadata and items, YAML, datasets."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from moetrain.train.checkpoint import CheckpointError, CheckpointManager, SafeFileSystemReader


class _Boom:
    """Unpickling this runs a function: exactly what a loader must refuse."""

    def __reduce__(self):
        return (Path.touch, (Path(self.target),))

    def __init__(self, target: Path):
        self.target = str(target)


def _save(tmp_path: Path, model: nn.Module | None = None) -> Path:
    model = nn.Linear(4, 3) if model is None else model
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    return mgr.save(1, {"model": model.state_dict()}, {"step": 1})


def test_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path)
    marker = tmp_path / "executed"
    meta = path / ".metadata"
    meta.write_bytes(pickle.dumps(_Boom(marker)))
    with pytest.raises(Exception, match="refusing to load it"):
        SafeFileSystemReader(path).read_metadata()
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    with pytest.raises(CheckpointError):
        mgr.load(path, {"model": nn.Linear(4, 3).state_dict()})
    assert not marker.exists(), "unpickling the checkpoint executed code"


def test_genuine_metadata_still_loads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = nn.Linear(4, 3)
    path = _save(tmp_path, saved)
    metadata = SafeFileSystemReader(path).read_metadata()
    assert "model.weight" in metadata.state_dict_metadata
    torch.manual_seed(1)
    target = nn.Linear(4, 3)
    assert not torch.equal(target.weight, saved.weight), "the target must start different"
    sd = target.state_dict()
    extra = CheckpointManager(tmp_path / "ckpt", keep_last=2).load(path, {"model": sd})
    assert extra["step"] == 1
    # The weights came back through the safe readers, bit for bit, into the target's tensors.
    for name, want in saved.state_dict().items():
        assert torch.equal(sd[name], want), f"{name} was not loaded"
        assert torch.equal(target.state_dict()[name], want), f"{name} not in the model"


def test_non_tensor_items_load_with_weights_only(tmp_path: Path) -> None:
    """Optimizer param groups (floats, lists, bools) are DCP byte items: they come back
    through torch.load(weights_only=True)."""
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.123)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    path = mgr.save(1, {"model": msd, "optim": osd}, {"step": 1})
    model2 = nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    mgr.load(path, state)
    assert state["optim"]["param_groups"][0]["lr"] == pytest.approx(0.123)
