"""The EP configs load, validate and describe a layout expert parallelism accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetrain.config import load_config
from moetrain.parallel.expert_parallel import check_ep_layout

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("tiny_ep*.yaml"))


def test_there_is_an_ep_config() -> None:
    assert CONFIGS, "configs/tiny_ep*.yaml is missing"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_ep_config_is_a_valid_layout(path: Path) -> None:
    cfg = load_config(path, [])
    p = cfg.parallel
    assert p.ep > 1
    assert p.dp_shard > 0, "the EP configs state dp_shard so the layout is explicit"
    dp = p.dp_replicate * p.dp_shard
    check_ep_layout(cfg.moe.num_experts, p.ep, dp)
    assert max(p.tp, p.pp) > 1 or dp > p.ep, "EP composed with another axis"
    assert dp * p.tp * p.pp == 8, "launched with torchrun --nproc-per-node 8"
    # Token groups fit the per-rank micro-batch: drops are layout-independent.
    assert cfg.train.micro_batch_size % cfg.moe.token_group_seqs == 0
