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


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["parallel.ep_overlap=halves"], 2, "needs parallel.ep > 1"),
        (["parallel.ep=2", "parallel.ep_overlap=halves", "parallel.ep_dispatcher=all_gather"],
         2, "parallel.ep_dispatcher=all_gather"),
        (["parallel.ep=2", "parallel.ep_overlap=halves", "train.micro_batch_size=1",
          "train.global_batch_size=2"], 2, "make it even"),
        (["parallel.ep=2", "parallel.ep_overlap=halves", "moe.token_group_seqs=null"], 2,
         "moe.token_group_seqs: None"),
        (["parallel.ep=2", "parallel.ep_overlap=halves", "moe.token_group_seqs=1",
          "train.compile=true"], 2, "train.compile=true"),
        (["parallel.ep_dropless_transport=slots", "moe.capacity_factor=null"], 2,
         "needs parallel.ep > 1"),
        (["parallel.ep=2", "parallel.ep_dropless_transport=slots",
          "moe.capacity_factor=1.0"], 2, "slots is for dropless routing"),
    ],
    ids=["halves without ep", "halves with all_gather", "halves of an odd micro-batch",
         "halves without token groups", "halves compiled", "slots without ep",
         "slots with a capacity factor"],
)
def test_the_overlap_and_transport_keys_are_refused_where_they_cannot_work(
    overrides: list[str], world: int, message: str
) -> None:
    """Each refusal names its key and the reason (config validation, then the layout's)."""
    from moetrain.config import ConfigError
    from moetrain.parallel.dims import ParallelDims

    with pytest.raises(ConfigError, match=message):
        cfg = load_config(None, ["moe.num_experts=4", "train.global_batch_size=8",
                                 "train.micro_batch_size=2", *overrides])  # fmt: skip
        ParallelDims.from_config(cfg.parallel, world).validate(cfg)
