"""Checkpoints stay high precision and independent of ``train.fp8`` and
``optim.moments_dtype``: an FP8 run resumes into a run without FP8 and back, across a change
of the moments' dtype and back (each loaded moment is the saved one, rounded to the new
dtype), and bf16 moments resume exactly (torch's optimizer loading casts them to the
parameters' fp32: ``BF16MomentsAdamW.load_state_dict`` casts them back).

One process on the micro MoE of tests/multirank.py (the layouts resume across each other in
tests/parallel/test_layouts.py; the keys here change no tensor's name or shape).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multirank import micro_config

from moetrain.train.trainer import Trainer

pytestmark = pytest.mark.timeout(300)

SMALL = ("model.dim=32", "model.ffn_dim=64", "moe.expert_ffn_dim=32", "data.seq_len=16",
         "model.n_layers=2")  # fmt: skip


def _trainer(out: Path, steps: int, *opts: str) -> Trainer:
    t = Trainer(micro_config(out, f"train.steps={steps}", *SMALL, *opts))
    t.maybe_resume()
    return t


def _state(t: Trainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return t.full_model_state_dict(), t.engine.full_optimizer_state()


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata()
    return {k: v for k, v in meta.state_dict_metadata.items() if hasattr(v, "properties")}


def test_fp8_and_moments_dtype_change_on_resume_and_back(tmp_path: Path) -> None:
    """FP8 tensorwise with fp32 moments -> no FP8 with bf16 moments -> FP8 rowwise with fp32
    moments, a step each, one checkpoint between each: every start loads exactly the saved
    parameters, and the saved moments in its own dtype (bf16: rounded to nearest)."""
    first = _trainer(tmp_path, 4, "train.fp8=tensorwise")
    first.train_step()
    params, moments = _state(first)
    path = first.save_checkpoint()
    first.close()
    # What the checkpoint holds: fp32 parameters and moments, no FP8 tensor, no scale.
    dtypes = {k: v.properties.dtype for k, v in _checkpoint_tensors(path).items()}
    assert dtypes and set(dtypes.values()) == {torch.float32}, set(dtypes.values())

    second = _trainer(tmp_path, 4, "train.fp8=none", "optim.moments_dtype=bf16")
    assert second.step == 1
    got_params, got_moments = _state(second)
    assert got_params.keys() == params.keys() and got_moments.keys() == moments.keys()
    for k, v in params.items():
        assert torch.equal(got_params[k], v), k
    live = second.engine.optimizers[0].state
    assert {v.dtype for st in live.values() for k, v in st.items() if k != "step"} == {
        torch.bfloat16
    }
    for k, v in moments.items():
        assert torch.equal(got_moments[k], v.to(torch.bfloat16).float()), k
    second.train_step()
    params, moments = _state(second)
    second.save_checkpoint()
    second.close()

    third = _trainer(tmp_path, 4, "train.fp8=rowwise")
    assert third.step == 2
    got_params, got_moments = _state(third)
    for k, v in params.items():
        assert torch.equal(got_params[k], v), k
    for k, v in moments.items():
        assert torch.equal(got_moments[k], v), k  # bf16 values, exact in fp32
    assert torch.isfinite(torch.tensor(third.train_step().loss))
    third.close()


def _resumes_exactly(tmp_path: Path, *opts: str) -> dict[str, torch.dtype]:
    """Two steps uninterrupted against one step, a checkpoint and a resumed second step:
    the same losses, parameters and optimizer state. Returns the checkpoint's tensors'
    dtypes."""
    whole = _trainer(tmp_path / "whole", 2, *opts)
    losses = [whole.train_step().loss for _ in range(2)]
    end = _state(whole)
    whole.close()
    first = _trainer(tmp_path / "cut", 2, *opts)
    cut = [first.train_step().loss]
    path = first.save_checkpoint()
    first.close()
    second = _trainer(tmp_path / "cut", 2, *opts)
    cut.append(second.train_step().loss)
    assert cut == losses
    for got, want in zip(_state(second), end, strict=True):
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
    second.close()
    return {k: v.properties.dtype for k, v in _checkpoint_tensors(path).items()}


@pytest.mark.thread_counts
def test_bf16_moments_resume_exactly(tmp_path: Path) -> None:
    saved = _resumes_exactly(tmp_path, "optim.moments_dtype=bf16", "train.fp8=rowwise")
    moments = {k: v for k, v in saved.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments and set(moments.values()) == {torch.bfloat16}


@pytest.mark.thread_counts
@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_muon_state_resumes_exactly(tmp_path: Path, moments: str) -> None:
    """``optim.name=muon``: a run cut after a step and resumed takes the next step exactly as
    the uninterrupted run does -- parameters, Muon's momentum buffers (in their dtype) and
    AdamW's moments -- and the checkpoint holds one buffer per Muon matrix."""
    saved = _resumes_exactly(tmp_path, "optim.name=muon", f"optim.moments_dtype={moments}")
    buffers = {k: v for k, v in saved.items() if k.endswith("momentum_buffer")}
    assert "optim.state.layers.0.ffn.experts.w1.momentum_buffer" in buffers, sorted(buffers)
    assert set(buffers.values()) == {torch.float32 if moments == "fp32" else torch.bfloat16}
    assert not any(k.endswith("layers.0.ffn.experts.w1.exp_avg") for k in saved)
