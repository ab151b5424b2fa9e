"""The multi-rank harness itself: results come back in rank order, a failure is reported
with its traceback and kills the other ranks instead of hanging them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multirank import RankFailure, run_ranks


def _sum_ranks(rank: int, world_size: int, scale: int) -> float:
    t = torch.tensor(float(rank * scale))
    dist.all_reduce(t)
    return float(t)


def _rank1_fails(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one broke")
    dist.barrier()  # rank 0 would wait here forever without the harness


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_results_in_rank_order_and_failures_reported() -> None:
    assert run_ranks(_sum_ranks, 3, 2, timeout=60) == [6.0, 6.0, 6.0]
    with pytest.raises(RankFailure, match="(?s)rank 1 failed.*ValueError: rank one broke"):
        run_ranks(_rank1_fails, 2, timeout=60)
