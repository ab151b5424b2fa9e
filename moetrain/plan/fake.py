"""A world of N ranks inside one process, seen from one rank: torch's fake process group.

``fake_world(world_size, rank)`` initialises the default process group with torch's "fake"
backend (``torch.testing._internal.distributed.fake_pg``: every collective returns at once
and moves nothing, as torchtitan's dry run and Megatron's ``--fake-process-group`` use it),
so that ``DeviceMesh``, DTensor, FSDP2 and ``torch.distributed.pipelining`` build exactly what
they would build on that rank of a real job, from meta tensors, without any process, network
or memory. The group is destroyed on exit. It refuses to run inside a process that already
has a process group (a training job): the plan never touches a real one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """The default process group as ``rank`` of a fake ``world_size``-rank world."""
    if dist.is_initialized():
        raise RuntimeError(
            "moetrain plan builds a fake process group of the planned world; this process "
            "already has one (plan before starting it, or in another process)"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
