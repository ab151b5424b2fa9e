"""What an expert-parallel step waits for on the host, and what it sends, under ep=2 and ep=4.

On a GPU every host read stalls the launch queue, so nothing else can be in flight across it.
``StepCensus`` (``moetrain.plan.census``) counts them on the bf16 native path (the grouped
GEMMs as CUDA runs them: ``gemm_torch.cuda_rules``). Each rank runs one forward and backward
of the micro MoE (4 MoE layers) through the real trainer's model and dispatcher:

- with a capacity factor, padded or not, the all-to-all's split sizes are static (every
  expert's segment travels in as many slots as it can hold): no host sync at all;
- dropless, the split sizes are the routing's: the host reads them once per MoE layer in the
  forward (``AllToAllDispatcher._dropless_route``), none in the backward, which reuses them.
  docs/expert_parallel.md says why, and what DeepEP and symmetric memory do instead;
- dropless with ``parallel.ep_dropless_transport=slots`` (every expert's segment in one
  slot per token): none.

With a capacity factor (or dropless slots) the bytes on the wire do not follow the routing,
so the plan's ``ep`` traffic (``moetrain.plan.traffic``) equals what the dispatchers sent,
exactly, on unbalanced routing too: the forward's dispatch and combine bytes, twice (the
backward), per micro-batch. "capacity 4.0" is a capacity above one row a token: its slots
are the tokens.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from multirank import micro_config, run_ranks

MODES = {
    "capacity": ("moe.capacity_factor=1.0",),
    "capacity 4.0": ("moe.capacity_factor=4.0",),
    "padded": ("moe.capacity_factor=1.0", "moe.pad_to_capacity=true"),
    "dropless": ("moe.capacity_factor=null",),
    "dropless, slots": ("moe.capacity_factor=null", "parallel.ep_dropless_transport=slots"),
}


def _options(mode: str, ep: int) -> tuple[str, ...]:
    return (*MODES[mode], f"parallel.ep={ep}", "train.dtype=bf16", "moe.kernels=torch",
            "log.histogram_every=0")  # fmt: skip


def _syncs(rank: int, world: int) -> dict[str, dict[str, int]]:
    from moetrain.kernels.grouped_gemm import torch_backend as gemm_torch

    from moetrain.plan.census import StepCensus
    from moetrain.train.trainer import Trainer

    out = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(micro_config(tmp, *_options(mode, world)))
            engine = trainer.engine
            model = engine.parts[0]
            inputs, labels, kwargs = engine._batch_inputs(trainer.train_data.next_step()[0])
            with gemm_torch.cuda_rules(), StepCensus() as census:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(inputs, **kwargs)
                engine._ce(logits, labels).backward()
            out[mode] = {**census.syncs, "moe_layers": len(engine.moe),
                         "grouped_mm": census.matmul_calls[("_grouped_mm", torch.bfloat16)],
                         "bytes": sum(layer.dispatcher.pop_comm_bytes() for layer in
                                      engine.moe.values())}  # fmt: skip
            trainer.close()
    return out


def _planned_ep_bytes(mode: str, ep: int) -> float:
    """The plan's ``ep`` traffic of one micro-batch (forward and backward) of a rank."""
    from moetrain.plan import activations as act
    from moetrain.plan.build import build_rank
    from moetrain.plan.planner import check_layout
    from moetrain.plan.traffic import traffic
    from moetrain.train.engine import build_optimizers

    with tempfile.TemporaryDirectory() as tmp:
        cfg = micro_config(tmp, *_options(mode, ep))
    cfg.model.vocab_size = 4096  # the default tokenizer's, as the trainer reads it
    dims = check_layout(cfg, ep, "cpu")
    state = build_rank(cfg, dims, 0, build_optimizers, "cpu")
    sh = act.shapes(cfg, dims, torch.bfloat16, "cpu")
    axes = {a.name: a.bytes for a in traffic(cfg, dims, state, sh, torch.bfloat16, 8)}
    return axes["ep"] / dims.microbatches(cfg)


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_layers_wait_on_the_host_only_when_dropless(ep: int) -> None:
    planned = {mode: _planned_ep_bytes(mode, ep) for mode in MODES if mode != "dropless"}
    for rank, syncs in enumerate(run_ranks(_syncs, ep, timeout=280)):
        for mode, counted in syncs.items():
            layers = counted.pop("moe_layers")
            sent = 2 * counted.pop("bytes")  # forward and backward
            if mode in planned:
                assert sent == planned[mode], f"ep={ep} rank {rank} {mode}: {sent} {planned}"
            # every routed expert ran torch._grouped_mm, forward (3) and backward (6)
            assert counted.pop("grouped_mm") == 9 * layers, (ep, rank, mode, counted)
            want = {"tolist": layers} if mode == "dropless" else {}
            assert counted == want, f"ep={ep} rank {rank} {mode}: {counted}"
