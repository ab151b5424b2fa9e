"""Newton-Schulz once per matrix (``moetrain.train.muon_owners``): each sharded matrix goes to
one owner and comes back in slices, bit for bit what every holder gathering it computes, with
the FLOPs shared out and the bytes counted exactly.

The layouts the trainer builds are proven in tests/parallel/test_muon_layouts.py (ZeRO-3,
TP + SP, expert TP, HSDP, ZeRO-3 x TP) and the equivalence matrix; here every kind of split
the router handles meets on one 2 x 2 mesh: FSDP2's row shards, TP's column blocks,
ZeRO-3 over TP (``_StridedShard``: interleaved rows), replicas, uneven chunks and empty
slices, a 3-D expert weight whose expert dim is kept, and a plain matrix.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

from moetrain.train.muon_owners import assign_owners

STEPS = 3


def test_owners_balance_the_flops_largest_first() -> None:
    # LPT: 8 to rank 0, 7 to rank 1, 5 and 4 to rank 1 then 0 ... every rank the same answer
    assert assign_owners([5, 8, 4, 7], 2) == [1, 0, 0, 1]
    assert assign_owners([3, 3, 3], 4) == [0, 1, 2]
    flops = [64, 64, 64, 8, 8, 8, 8, 8, 8, 8, 8]
    owners = assign_owners(flops, 4)
    loads = [sum(f for f, o in zip(flops, owners, strict=True) if o == r) for r in range(4)]
    assert max(loads) - min(loads) <= 8, loads  # within the smallest share


def _cases():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return [  # (name, full shape, placements over (dp, tp))
        ("zero3 rows, tp columns, uneven", (7, 10), (Shard(0), Shard(1))),
        ("zero3 over a tp column-parallel block", (12, 6), (_StridedShard(0, split_factor=2),
                                                            Shard(0))),
        ("replicas over dp, tp rows", (9, 5), (Replicate(), Shard(0))),
        ("zero3 rows only", (16, 24), (Shard(0), Replicate())),
        ("one row: empty slices", (1, 12), (Shard(0), Replicate())),
        ("experts kept over dp, their width over tp", (4, 6, 10), (Shard(0), Shard(2))),
        ("experts kept, whole", (4, 6, 10), (Shard(0), Replicate())),
    ]  # fmt: skip


def _worker(rank: int, world: int, dtype_name: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from moetrain.parallel.accounting import CommCounter
    from moetrain.train.muon import WholeMatrices
    from moetrain.train.muon_owners import OwnerMatrices

    dtype = getattr(torch, dtype_name)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(0)
    params, updates = [], []
    for _, shape, placements in _cases():
        full = torch.randn(shape, generator=gen)
        params.append(distribute_tensor(torch.zeros(shape), mesh, placements, src_data_rank=None))
        updates.append(distribute_tensor(full, mesh, placements, src_data_rank=None))
    plain = torch.randn(8, 3, generator=gen)
    params.append(plain.clone())
    updates.append(plain)
    want = WholeMatrices()(params, updates, STEPS, dtype)
    owners = OwnerMatrices()
    with CommCounter() as comm:
        got = owners(params, updates, STEPS, dtype)
    sent, flops = owners.costs(params, STEPS, dtype)
    gather_sent, gather_flops = WholeMatrices().costs(params, STEPS, dtype)
    return {
        "equal": [torch.equal(g, w.to_local() if hasattr(w, "to_local") else w)
                  for g, w in zip(got, want, strict=True)],  # fmt: skip
        "sent": sent, "measured": round(sum(comm.sent_by_kind().values())),
        "kinds": sorted(comm.sent_by_kind()),
        "flops": flops, "gather_sent": gather_sent, "gather_flops": gather_flops,
    }  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_owners_give_every_holder_the_bits_of_the_gathered_iteration(dtype: str) -> None:
    from moetrain.train.muon import ns_flops

    results = run_ranks(_worker, 4, dtype)
    names = [name for name, _, _ in _cases()] + ["plain"]
    for rank, r in enumerate(results):
        assert all(r["equal"]), (rank, [n for n, ok in zip(names, r["equal"], strict=True)
                                        if not ok])  # fmt: skip
        assert r["sent"] == r["measured"] > 0, (rank, r)
        assert r["kinds"] == ["all_to_all"], r["kinds"]
    # each matrix orthogonalized once by the ranks that split it: once over the four for a
    # dp x tp split, once per replica group for a split over one dim; the kept experts (two
    # of four on each dp rank) once per tp group when their width is split, by every rank
    # holding them when it is not, and the plain matrix everywhere
    f = lambda *shape: ns_flops(shape, STEPS)  # noqa: E731
    want = (f(7, 10) + f(12, 6) + 2 * (f(9, 5) + f(16, 24) + f(1, 12) + f(2, 6, 10))
            + 4 * (f(2, 6, 10) + f(8, 3)))  # fmt: skip
    assert sum(r["flops"] for r in results) == want
    # and every rank does less than when each holder repeats every matrix
    assert all(r["flops"] < r["gather_flops"] for r in results), results
