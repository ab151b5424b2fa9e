"""Tensor + sequence parallelism with DTensor parallel styles (Megatron-style layout).

Attention: wq/wk/wv column-wise (each rank holds whole heads, biases split with them), wo
row-wise; per-head q/k norms replicated with their gradient summed over tp, whole-projection
q/k norms (OLMoE) sharded by channel with the mean of squares reduced over tp; multi-head
latent attention splits its per-head up-projections and keeps the latent down-projections
replicated (``_mla_plan``). Dense SwiGLU:
w1/w3 column-wise, w2 row-wise. Embedding row-wise over the vocabulary, output column-wise
with its logits left vocabulary-sharded for ``loss_parallel``. With sequence parallelism the
norms and the residual stream hold 1/tp of the sequence and every projection input is
all-gathered first (``PrepareModuleInput(Shard(1) -> Replicate())``), every row-wise output
reduce-scattered back (``RowwiseParallel(output_layouts=Shard(1))``).

MoE layers: the layer input is gathered to the full sequence (on the layer's
``input_seam``, so that it happens however the layer runs, whole or in the phases of
``parallel.ep_overlap``) and every tp rank routes the same tokens identically (the router is
replicated; its gradient comes out whole and equal on every rank, and the statistics are
counted once: the engine reduces them over dp and pp only); the output is cut back to this
rank's sequence shard (on its ``output_seam``). With ``parallel.expert_tp`` (the default)
each rank computes 1/tp of every expert: routed experts' FFN width split over tp
(``_shard_experts``; under expert parallelism ``apply_ep`` slices them), partial outputs
summed once per layer (``ExpertTPDispatcher``), shared experts column/row-wise like the
dense FFN. ``parallel.expert_tp=false`` keeps the experts whole on every rank: tp x the
expert FLOPs, no expert communication.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from moetrain.config import ParallelConfig
from moetrain.model.attention import Attention, LatentAttention
from moetrain.model.ep_dispatch import AmaxOverGroup, ExpertTPDispatcher
from moetrain.model.moe import MoELayer
from moetrain.model.transformer import MTPBlock


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
        if isinstance(block.attention, LatentAttention):
            plan = _mla_plan(block.attention, act)
            _sum_grad_over_tp(block.attention.wk_rope, tp_mesh)
        else:
            plan = _gqa_plan(block.attention, act)
            if block.attention.qk_norm == "full":
                _shard_full_qk_norms(block.attention, tp_mesh)
            if block.attention.sinks is not None:  # one per head: split with the heads
                _shard_parameter(block.attention, "sinks", tp_mesh, 0)
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        if isinstance(block, MTPBlock):
            plan.update(_mtp_plan(act, sp))
        if isinstance(block.ffn, MoELayer):
            if sp:  # on the layer's input seam: it runs whole or in phases (ep_overlap)
                plan["ffn.input_seam"] = PrepareModuleInput(
                    input_layouts=(act,),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                )
            if cfg.expert_tp:
                plan.update(_shared_experts_plan(block.ffn))
            parallelize_module(block, tp_mesh, plan)
            if cfg.expert_tp and cfg.ep == 1:
                _shard_experts(block.ffn, tp_mesh)
            if sp:
                # The replicated output, cut back to this rank's sequence shard.
                parallelize_module(
                    block.ffn.output_seam,
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


def _mtp_plan(act: object, sp: bool) -> dict[str, object]:
    """A multi-token-prediction module's own parts (its block is split like every block):
    the projection ``eh_proj`` column-wise, its input (the two normed halves) gathered first
    and its output brought back to the residual stream's layout (all-gathered over the
    columns, or to this rank's sequence shard under sequence parallelism); the three norms
    sequence-parallel, or replicated plain modules without it."""
    plan: dict[str, object] = {
        "eh_proj": ColwiseParallel(input_layouts=act, output_layouts=act),
    }
    if sp:
        for name in ("enorm", "hnorm", "head_norm"):
            plan[name] = SequenceParallel()
    return plan


def _shared_experts_plan(moe: MoELayer) -> dict[str, object]:
    """The shared experts (a dense SwiGLU inside the MoE layer, whose input every tp rank
    holds whole): w1/w3 column-wise, w2 row-wise, like the dense FFN."""
    if moe.shared_experts is None:
        return {}
    return {
        # One replicated DTensor for w1 and w3: their input gradients add up as one
        # partial sum, all-reduced once.
        "ffn.shared_experts": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
        ),
        "ffn.shared_experts.w1": ColwiseParallel(),
        "ffn.shared_experts.w3": ColwiseParallel(),
        "ffn.shared_experts.w2": RowwiseParallel(output_layouts=Replicate()),
    }


def _shard_experts(moe: MoELayer, tp_mesh: DeviceMesh) -> None:
    """Expert tensor parallelism without expert parallelism: every routed expert's FFN
    width split over tp (w1/w3 along F = dim 2, w2 along F = dim 1, as DTensors, so FSDP,
    ZeRO-1, the gradient norm and checkpoints treat them like any tensor-parallel weight),
    and the dispatcher wrapped to sum the partial outputs (``ExpertTPDispatcher``). Every
    rank still routes every token (the router is replicated); each computes 1/tp of the
    expert FLOPs."""
    experts = moe.experts
    for name, dim in experts.ffn_dims().items():
        _shard_parameter(experts, name, tp_mesh, dim)
    moe.install_dispatcher(ExpertTPDispatcher(moe.dispatcher, tp_mesh.get_group()))
    experts.amax_reduce = AmaxOverGroup(tp_mesh.get_group())


def _shard_parameter(module: nn.Module, name: str, tp_mesh: DeviceMesh, dim: int) -> None:
    """Replace ``module.<name>`` by a DTensor parameter sharded along ``dim`` over tp; the
    module computes with its local part (``moetrain.model.experts.local_part``)."""
    from torch.distributed.tensor import distribute_tensor

    w = getattr(module, name)
    sharded = distribute_tensor(w.detach(), tp_mesh, [Shard(dim)])
    setattr(module, name, nn.Parameter(sharded, requires_grad=w.requires_grad))


def _gqa_plan(attn: Attention, act: object) -> dict[str, object]:
    """Grouped-query attention: q/k/v column-wise (whole heads per rank, their biases split
    with them), the output row-wise (its bias added once, after the reduction). Per-head
    q/k norms see this rank's heads: ``SequenceParallel`` over the head dim keeps their
    weight replicated and sums its gradient over tp. Whole-projection q/k norms (OLMoE)
    need every head's values and are refused under tp by ``ParallelDims.validate``."""
    plan: dict[str, object] = {
        "attention": PrepareModuleInput(
            input_layouts=(act, None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=act),
    }
    if attn.qk_norm == "head":
        # q/k arrive as this rank's heads (B, S, H/tp, Dh): the head dim is "sharded".
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _shard_full_qk_norms(attn: Attention, tp_mesh: DeviceMesh) -> None:
    """OLMoE's q/k norms over whole projections, split like the projections: the weight
    column-sharded, the input this rank's channels as a Shard(-1) DTensor, so that the mean
    of squares is reduced over tp (one all-reduce of (B, S, 1) per norm) and the output
    comes back as this rank's channels."""
    from torch.distributed.tensor import distribute_module, distribute_tensor

    def shard_weight(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]))
            module.register_parameter(pname, sharded)

    def input_fn(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(x, mesh, [Shard(-1)], run_check=False) for x in inputs)

    def output_fn(module: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return out.to_local()

    for norm in (attn.q_norm, attn.k_norm):
        distribute_module(norm, tp_mesh, shard_weight, input_fn, output_fn)


def _mla_plan(attn: LatentAttention, act: object) -> dict[str, object]:
    """Multi-head latent attention: the per-head up-projections (``wq`` or ``wq_b``,
    ``wkv_b``) column-wise, ``wo`` row-wise. The down-projections and latent norms stay
    replicated (plain tensors): their outputs feed column-wise layers, whose input gradient
    is all-reduced, so their gradients come out whole and identical on every rank. The
    shared RoPE key ``wk_rope`` is consumed by this rank's heads only; ``_sum_grad_over_tp``
    completes its gradient."""
    plan: dict[str, object] = {
        # Local tensors inside: the replicated down-projections cannot take a DTensor.
        "attention": PrepareModuleInput(
            input_layouts=(act, None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=act),
    }
    plan["attention.wq" if attn.wq is not None else "attention.wq_b"] = ColwiseParallel()
    return plan


def _sum_grad_over_tp(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron's "f" on ``module``'s output: identity forward; in backward the gradient,
    which each rank computed for its own heads only, is all-reduced over tp."""

    def hook(_module: nn.Module, _inputs: object, out: torch.Tensor) -> torch.Tensor:
        replicated = DTensor.from_local(out, tp_mesh, [Replicate()], run_check=False)
        return replicated.to_local(grad_placements=[Partial()])

    module.register_forward_hook(hook)
