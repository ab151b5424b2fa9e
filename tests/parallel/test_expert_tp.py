"""Expert tensor parallelism survives tp ranks that route differently -- the cause of the
old start-up hang of expert TP under pipeline parallelism.

torch.distributed.pipelining infers the shapes that travel between stages on its first step
by running every non-first stage's forward on tensors made from metadata alone
(``TensorMeta.to_tensor``: ``torch.empty``, uninitialised memory), with real collectives
inside (``test_pipeline_first_step_runs_stages_on_uninitialised_inputs`` shows it). Each
rank's garbage differs, so the ranks of one tp group route those tokens differently. When
expert TP reduced the experts' received rows over tp, the reduction's size was the number of
rows routed to this rank's experts: different on each tp rank, hence gloo's "Received data
size doesn't match expected size" or a deadlock (8 of 8 runs of pp2 x ep2 x tp2 on the old
code). Expert TP now reduces at the token level (T x D outputs, T x K combine weights,
``ExpertTPDispatcher``): sizes that do not depend on routing. These tests feed each tp rank
different tokens on purpose; they would hang or fail on the old design.
"""

from __future__ import annotations

import pytest
import torch
from multirank import run_ranks

from moetrain.config import MoEConfig

D, T = 16, 24


def _moe(tp_rank: int, mesh, ep_group=None):
    from moetrain.model.ep_dispatch import AllToAllDispatcher, ExpertTPDispatcher
    from moetrain.model.moe import MoELayer
    from moetrain.parallel.tensor_parallel import _shard_experts

    cfg = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, capacity_factor=None, kernels="torch")
    torch.manual_seed(0)
    layer = MoELayer(D, cfg).train()
    if ep_group is None:
        _shard_experts(layer, mesh["tp"])
    else:  # ep x tp: this rank's 2 experts, their FFN width split over tp
        import torch.distributed as dist

        r = dist.get_rank(ep_group)
        for name, f_dim in (("w1", 2), ("w3", 2), ("w2", 1)):
            w = getattr(layer.experts, name).detach()[2 * r : 2 * r + 2]
            w = w.narrow(f_dim, tp_rank * 4, 4).clone()
            setattr(layer.experts, name, torch.nn.Parameter(w))
        layer.experts.num_experts = 2
        layer.dispatcher = ExpertTPDispatcher(
            AllToAllDispatcher(ep_group, 4), mesh["tp"].get_group()
        )
    return layer


def _differently_routed_step(rank: int, world_size: int) -> list[float]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    ep = world_size // 2
    mesh = init_device_mesh("cpu", (ep, 2), mesh_dim_names=("ep", "tp"))
    tp_rank = mesh["tp"].get_local_rank()
    layer = _moe(tp_rank, mesh, mesh["ep"].get_group() if ep > 1 else None)
    counts = []
    for step in range(3):
        # What pipelining's shape inference does: each rank its own uninitialised-like input.
        x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(100 * rank + step))
        x = x * (1 + 10 * rank)
        layer(x.requires_grad_()).sum().backward()
        counts.append(float(layer.pop_stats()["tokens_per_expert"].max()))
    dist.barrier()
    return counts


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4], ids=["tp2", "ep2 x tp2"])
def test_expert_tp_collectives_do_not_depend_on_routing(world_size: int) -> None:
    results = run_ranks(_differently_routed_step, world_size, timeout=100)
    # The tp ranks really routed differently (else the test proves nothing).
    assert results[0] != results[1], results


def _record_stage_inputs(rank: int, world_size: int) -> dict | None:
    import tempfile

    from multirank import micro_config

    from moetrain.model import transformer
    from moetrain.train.trainer import Trainer

    handed: list[torch.Tensor] = []  # what pipelining hands stage 1
    seen: list[torch.Tensor] = []  # what its first block computes on
    stage, block = transformer.Transformer.forward, transformer.TransformerBlock.forward

    def stage_recording(self, tokens, *args, **kwargs):
        if not self.embeds_input:
            handed.append(tokens.detach().clone())
        return stage(self, tokens, *args, **kwargs)

    def block_recording(self, x, *args, **kwargs):
        if self.layer_id == 2:  # the first block of stage 1 (4 layers over 2 stages)
            seen.append(x.detach().clone())
        return block(self, x, *args, **kwargs)

    transformer.Transformer.forward = stage_recording
    transformer.TransformerBlock.forward = block_recording
    with tempfile.TemporaryDirectory() as out:
        # The engine's start-up steps (a dummy batch of zeros, 4 micro-batches, through the
        # training and the forward-only schedule) are each schedule's first step: they run
        # the metadata inference.
        Trainer(micro_config(out, "parallel.pp=2", "parallel.pp_schedule=gpipe"))
    return {"handed": handed, "seen": seen} if rank == 1 else None


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_pipeline_first_step_runs_stages_on_uninitialised_inputs() -> None:
    """The upstream behaviour behind the old hang, as a minimal reproduction: on its first
    step a stage's forward runs once more than the micro-batches, first, on a tensor that is
    not the activation the previous stage sends (materialised from metadata). The four real
    micro-batches of the start-up step are identical (zeros), so their activations are. The
    engine's start-up steps hand the blocks zeros instead of either
    (``StepContext.zero_stage_input``), so every rank computes on the same numbers."""
    got = run_ranks(_record_stage_inputs, 2, timeout=100)[1]
    handed = got["handed"]
    # The training schedule, then the forward-only one (evaluation): each 1 metadata
    # inference + 4 micro-batches.
    assert len(handed) == 10, len(handed)
    for start in (0, 5):
        first, real = handed[start], handed[start + 1 : start + 5]
        assert all(torch.equal(r, real[0]) for r in real)
        assert first.shape == real[0].shape and not torch.equal(first, real[0])
    assert len(got["seen"]) == 10 and all(not x.any() for x in got["seen"])
