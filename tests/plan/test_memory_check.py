"""Training asks the plan first: a start whose planned peak exceeds the memory a rank has is
refused before anything is allocated, with both figures; ``train.memory_check=false`` skips
the check."""

from __future__ import annotations

import pytest
import torch
from multirank import micro_config

from moetrain.config import ConfigError


def test_a_start_that_cannot_fit_is_refused_before_it_allocates(tmp_path, monkeypatch) -> None:
    from moetrain.train import trainer as T

    def no_build(*args, **kwargs):  # reaching the model build means the check came too late
        raise AssertionError("the model was built before the memory check refused the start")

    monkeypatch.setattr(T, "meta_model", no_build)
    cfg = micro_config(tmp_path / "run", "train.memory_per_rank_gb=0.001")
    with pytest.raises(ConfigError) as info:
        T.Trainer(cfg)
    msg = str(info.value)
    assert msg.startswith("train.memory_check: rank 0 needs about "), msg
    assert "but has 0.001 GB (train.memory_per_rank_gb)" in msg
    assert "moetrain plan --config" in msg and "train.memory_check=false" in msg
    assert not (tmp_path / "run").exists()  # a refused start writes nothing


def test_the_check_can_be_skipped_and_passes_when_it_fits(tmp_path) -> None:
    from moetrain.train.trainer import Trainer

    tight = micro_config(
        tmp_path / "a", "train.memory_per_rank_gb=0.001", "train.memory_check=false"
    )
    Trainer(tight).close()
    Trainer(micro_config(tmp_path / "b")).close()  # a few MB against the machine's memory


def _dropless_ep2(tmp_path, *extra: str):
    return micro_config(tmp_path / "run", "parallel.ep=2", "moe.capacity_factor=null", *extra)


def test_dropless_ep_prices_the_step_that_sends_one_layer_every_token(tmp_path) -> None:
    """Dropless all-to-all sizes each layer's receive buffer by the routing. The plan adds
    what one MoE layer needs when every token of the EP group picks this rank, by hand:
    ep=2 ranks x T = 2 x 32 tokens x min(K=2, E/ep=2) rows instead of T K, each row 4 bytes
    x (2 D + 4 F) (the row in and out, the experts' SwiGLU, fp32). A capacity factor bounds
    it: nothing added."""
    from moetrain.plan.planner import plan
    from moetrain.train.engine import build_optimizers

    rank = plan(_dropless_ep2(tmp_path), 2, build_optimizers, device_type="cpu").ranks[0]
    T, K, D, F = 2 * 32, 2, 64, 64
    assert rank.dropless_worst == (2 * T * 2 - T * K) * 4 * (2 * D + 4 * F)
    capped = micro_config(tmp_path / "cap", "parallel.ep=2")
    assert plan(capped, 2, build_optimizers, device_type="cpu").ranks[0].dropless_worst == 0


def test_a_dropless_start_that_fits_only_balanced_routing_is_warned(tmp_path, caplog) -> None:
    """Memory between the balanced peak and the unlucky step's: the start goes ahead, with
    both figures in a warning (a refusal would stop runs whose routing never gets there)."""
    from moetrain.parallel.dims import ParallelDims
    from moetrain.plan.planner import plan
    from moetrain.train.engine import build_optimizers
    from moetrain.train.memory_check import check_memory

    planned = plan(_dropless_ep2(tmp_path), 2, build_optimizers, device_type="cpu")
    need, worst = planned.peak(), planned.ranks[0].dropless_worst
    warnings = {}
    for gb in ((need + worst / 2) / 1e9, 2 * (need + worst) / 1e9):
        cfg = _dropless_ep2(tmp_path, f"train.memory_per_rank_gb={gb}")
        caplog.clear()
        check_memory(cfg, ParallelDims.from_config(cfg.parallel, 2), torch.device("cpu"))
        warnings[gb] = [r.getMessage() for r in caplog.records if "dropless" in r.getMessage()]
    tight, ample = warnings.values()
    assert len(tight) == 1 and not ample, warnings
    assert f"needs {worst / 1e9:.3g} GB more, {(need + worst) / 1e9:.3g} GB in all" in tight[0]
