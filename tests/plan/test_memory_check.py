"""Training asks the plan first: a start whose planned peak exceeds the memory a rank has is
refused before anything is allocated, with both figures; ``train.memory_check=false`` skips
the check."""

from __future__ import annotations

import pytest
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
