"""The engine's tensor helpers across ranks (``moetrain.train.tensors``)."""

from __future__ import annotations

import pytest
import torch
from multirank import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from moetrain.train.tensors import full_cpu, like_param, local


def _gather_a_local_gradient(rank: int, world_size: int, shape: tuple[int, ...]) -> list:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    full = torch.randn(shape)
    p = distribute_tensor(full, mesh, [Shard(0)])
    got = full_cpu(like_param(local(p) * 2, p))  # a "gradient" held as this rank's shard
    zero = full_cpu(like_param(torch.zeros_like(local(p)), p))  # a parameter without one
    return [tuple(local(p).shape), got, zero, torch.equal(got, 2 * full)]


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_local_gradient_gathers_to_its_parameters_shape_when_shards_are_uneven() -> None:
    """5 rows over 2 ranks: shards of 3 and 2. Built from the local piece alone, the global
    shape would be taken as 6 on rank 0 and 4 on rank 1, and the gather would mismatch (gloo
    aborts on it); ``like_param`` takes the parameter's shape."""
    out = run_ranks(_gather_a_local_gradient, 2, (5, 3), timeout=60)
    assert [o[0] for o in out] == [(3, 3), (2, 3)]
    for _, got, zero, same in out:
        assert same and got.shape == (5, 3) and torch.equal(zero, torch.zeros(5, 3))
