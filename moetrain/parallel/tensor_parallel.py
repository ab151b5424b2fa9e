"""Tensor + sequence parallelism with DTensor parallel styles (Megatron-style layout).

Attention: wq/wk/wv column-wise (each rank holds whole heads), wo row-wise. Dense SwiGLU:
w1/w3 column-wise, w2 row-wise. Embedding row-wise over the vocabulary, output column-wise
with its logits left vocabulary-sharded for ``loss_parallel``. With sequence parallelism the
norms and the residual stream hold 1/tp of the sequence and every projection input is
all-gathered first (``PrepareModuleInput(Shard(1) -> Replicate())``), every row-wise output
reduce-scattered back (``RowwiseParallel(output_layouts=Shard(1))``).

MoE layers stay whole on every tensor-parallel rank: router, routed and shared experts are
replicated (plain tensors), the layer input is gathered to the full sequence and every rank
routes the same tokens identically; the output is cut back to this rank's sequence shard
(no communication). Their gradients are therefore identical on every tp rank and must not
be reduced over tp, and their statistics are counted once (the engine reduces over dp and
pp only). Splitting experts over tp is left to the expert-parallel work.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from moetrain.config import ParallelConfig
from moetrain.model.moe import MoELayer


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    """Shard ``model`` (a Transformer or a pipeline chunk of one) over ``tp_mesh`` in place."""
    if tp_mesh.size() == 1:
        return
    sp = cfg.sequence_parallel
    act = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks

    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    tied = emb is not None and out is not None and out.weight is emb.weight
    top: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if getattr(model, "norm", None) is not None and sp:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        # Vocabulary-sharded logits (a DTensor): the engine computes the loss under
        # torch.distributed.tensor.parallel.loss_parallel without gathering them.
        top["output"] = ColwiseParallel(
            input_layouts=act, output_layouts=Shard(-1), use_local_output=False
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    if tied:
        # Each style distributes its module's weight into a new Parameter, which unties a
        # shared embedding/output weight: each half would then get only its own gradient and
        # the two copies drift apart from the first optimizer step. Both are Shard(0) over
        # the vocabulary, so one DTensor serves both uses; their gradients add up in it.
        model.output.weight = model.tok_embeddings.weight

    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention": PrepareModuleInput(
                input_layouts=(act, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=act),
        }
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        if isinstance(block.ffn, MoELayer):
            if sp:
                plan["ffn"] = PrepareModuleInput(
                    input_layouts=(act,),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                )
            parallelize_module(block, tp_mesh, plan)
            if sp:
                # The replicated output, cut back to this rank's sequence shard.
                parallelize_module(
                    block.ffn,
                    tp_mesh,
                    PrepareModuleOutput(
                        output_layouts=(Replicate(),),
                        desired_output_layouts=(Shard(1),),
                        use_local_output=True,
                    ),
                )
            continue
        plan.update(
            {
                "ffn": PrepareModuleInput(
                    input_layouts=(act,), desired_input_layouts=(Replicate(),)
                ),
                "ffn.w1": ColwiseParallel(),
                "ffn.w3": ColwiseParallel(),
                "ffn.w2": RowwiseParallel(output_layouts=act),
            }
        )
        parallelize_module(block, tp_mesh, plan)
