"""The precision policy: the one place that says what a run computes in which dtype.

``Precision`` is chosen once from ``train.dtype`` and the device (``Precision.choose``: the
trainer and the planner both call it), enters autocast around the model parts' forwards
(``autocast``, ``wrap_forward``: the engine), and builds FSDP2's mixed-precision policies
(``fsdp_policies``: ``moetrain.parallel.data_parallel``). The model reads it through the
autocast state it entered: ``as_compute`` rounds a tensor to the compute dtype, and the
fp32 regions -- named once, in ``FP32_REGIONS`` -- are entered through ``fp32_region``.
docs/kernels.md, "The compute dtype", says why each rule is what it is.

One process and every layout apply the same rules, so that a layout reproduces one bf16
process as an fp32 layout reproduces one fp32 process, up to the order of its reductions:

- **bf16, rounded from the fp32 master weights once per micro-batch**: every parameter of
  the transformer blocks but the routers' gates -- attention, dense and shared-expert
  projections and their biases, the routed experts' weights and biases, the shared-expert
  gate, attention sinks, multi-token prediction's projections, every norm weight -- and the
  final norm's and the output head's weights. Under ``torch.autocast`` the linears' weights
  are cast by autocast (its cache: once per forward); the others by ``as_compute``. Under
  FSDP2 (ZeRO-2/3) the blocks are all-gathered in bf16 and ``as_compute`` finds them cast.
- **bf16 GEMM operands**: every matmul's activations are cast at the GEMM (autocast), the
  routed tokens once, before the dispatch (``MoELayer``, with ``as_compute``), so the
  expert-parallel all-to-all carries bf16 and the routed experts compute in their rows'
  dtype; every GEMM's output is bf16.
- **fp32**: the regions of ``FP32_REGIONS`` (the routers' gates, forward and backward, norms'
  arithmetic, RoPE's rotations, every loss); and, by construction, the token embeddings
  (looked up exactly: the residual stream starts and stays fp32), the router's scores and
  top-k (from the gate's fp32 logits), the combine's weighted sum (``unpermute``: fp32
  weights, fp32 accumulation), the gradients once cast back, the optimizer.
- **where**: autocast wraps each model part's forward (``Precision.wrap_forward``), never
  the backward, which then runs each op in its forward's dtype.

``as_compute`` and ``fp32_region`` read the autocast state: outside autocast (an fp32 run)
they change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``train.dtype``'s explicit values; ``auto`` is bf16 on CUDA, fp32 elsewhere."""

FP32_REGIONS: dict[str, str] = {
    "router_gate": "the routers' gates and their biases, forward and backward "
    "(moetrain.model.moe.Router): routing decisions hang on small logit differences",
    "norm": "RMSNorm's arithmetic (moetrain.model.norm): bf16 sums of squares lose too much",
    "rope": "RoPE's rotations of queries and keys (moetrain.model.rope.apply_rope), "
    "against the fp32 cos/sin tables",
    "loss": "the language-model cross-entropy (moetrain.train.engine, Engine._ce), "
    "over fp32 logits",
    "mtp": "multi-token prediction's cross-entropies (moetrain.model.mtp.mtp_loss)",
}
"""The fp32 regions of a bf16 run, by name: what each covers and why. A region the policy
names computes in fp32; a name left out computes in the compute dtype (``fp32_region``),
which is what dropping one plants (tests/faults.py)."""


@dataclass(frozen=True)
class Region:
    """One fp32 region where a model site enters it (``fp32_region``)."""

    name: str
    fp32: bool
    """True when ``FP32_REGIONS`` names the region."""
    device_type: str
    compute: torch.dtype | None
    """The compute dtype at the site (autocast's; None outside autocast)."""

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` for the region's ops: fp32 (``t`` itself when it is fp32 already), or, in a
        region the policy does not name, the compute dtype (``t`` outside autocast)."""
        if self.fp32:
            return t.float()
        return t if self.compute is None or t.dtype == self.compute else t.to(self.compute)

    def autocast_off(self) -> torch.autocast:
        """Around the region's ops where autocast would reach them (a GEMM; a loss, which
        autocast's own lists would run in fp32): autocast off, so that the region's casts
        alone decide their dtype."""
        return torch.autocast(device_type=self.device_type, enabled=False)


def fp32_region(name: str, device_type: str) -> Region:
    """The region ``name`` of ``FP32_REGIONS`` as the policy has it, at a site on
    ``device_type``: the site casts its operands (``Region.cast``) and, where autocast would
    reach its ops, turns autocast off around them (``Region.autocast_off``)."""
    return Region(name, name in FP32_REGIONS, device_type, _autocast_dtype(device_type))


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """autocast's dtype on ``device_type`` when it is on there, else None (meta tensors,
    which the planner builds, have no autocast)."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def as_compute(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to the compute dtype (a differentiable cast; its gradient comes back in
    ``t``'s dtype), or ``t`` itself outside autocast or when it is in that dtype already
    (a parameter FSDP2 gathered in bf16)."""
    dtype = _autocast_dtype(t.device.type)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


@dataclass(frozen=True)
class FSDPPolicies:
    """FSDP2's mixed-precision policy of each kind of unit (``Precision.fsdp_policies``)."""

    blocks: MixedPrecisionPolicy
    """Every transformer block: gathered in the compute dtype."""
    root: MixedPrecisionPolicy
    """The root unit (token embeddings, final norm, output head): gathered in fp32."""
    routers: MixedPrecisionPolicy | None
    """Each MoE router, a unit of its own gathered in fp32 (the ``router_gate`` region);
    None: the routers stay in their block's unit (an fp32 run)."""


@dataclass(frozen=True)
class Precision:
    """The compute dtype of a run, and everything that follows from it."""

    dtype: torch.dtype
    """The compute dtype: GEMMs' operands and outputs (bf16), or fp32 for everything."""
    device_type: str
    """The device the run computes on ("cuda", "cpu"; the planner's target device)."""

    @classmethod
    def choose(cls, name: str, device_type: str) -> Precision:
        """The policy of ``train.dtype`` = ``name`` on ``device_type``: ``auto`` is bf16
        (autocast) on CUDA and fp32 elsewhere; ``bf16`` and ``fp32`` are what they say."""
        if name == "auto":
            dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
        else:
            dtype = DTYPES[name]
        return cls(dtype, device_type)

    @property
    def mixed(self) -> bool:
        """True when the compute dtype is not fp32 (autocast, fp32 master weights)."""
        return self.dtype != torch.float32

    @property
    def fp32_regions(self) -> tuple[str, ...]:
        """The regions that stay fp32 under ``autocast`` (``FP32_REGIONS``)."""
        return tuple(FP32_REGIONS)

    def autocast(self) -> torch.autocast:
        """Autocast to the compute dtype on the run's device (disabled in an fp32 run)."""
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, enabled=self.mixed)

    def wrap_forward(self, module: nn.Module) -> None:
        """Run ``module``'s forward, and only its forward, under ``autocast()`` (nothing in
        an fp32 run): its backward then runs each op in the dtype its forward chose -- the
        fp32 router gate's gradients in fp32 -- whoever calls ``backward()``, the engine or
        a pipeline schedule, which calls the module and runs backwards of its micro-batches
        in between. Activation checkpointing's recompute restores the autocast state of
        the forward it repeats.

        Through torch's module hooks rather than a replaced ``forward``: autocast is entered
        after every pre-forward hook registered before (FSDP2's all-gather) and left before
        every forward hook (FSDP2's reshard), even when the forward raises, so it covers
        exactly what the module's ``forward`` runs."""
        if not self.mixed:
            return
        entered: list[torch.autocast] = []

        def enter(_module: nn.Module, _args: Any) -> None:
            ctx = self.autocast()
            ctx.__enter__()
            entered.append(ctx)

        def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
            if entered:  # empty when a pre-forward hook before ``enter`` raised
                entered.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, prepend=True, always_call=True)

    def fsdp_policies(self) -> FSDPPolicies:
        """FSDP2's mixed-precision policies (ZeRO-2/3): fp32 shards stay the master weights,
        gradients are reduced in fp32 (gloo and NCCL), inputs are not cast. A bf16 run
        gathers each block in bf16 -- the weights autocast and ``as_compute`` round to bf16
        in one process, norm weights included -- and each router and the root in fp32: the
        gates are an fp32 region, and the embeddings are looked up exactly (the residual
        stream is fp32 as in one process), while autocast rounds the head's weight and
        ``as_compute`` the final norm's after the gather, as in one process. An fp32 run
        gathers every unit as it is."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        def policy(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
            return MixedPrecisionPolicy(
                param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
            )

        if not self.mixed:
            whole = policy(None)
            return FSDPPolicies(blocks=whole, root=whole, routers=None)
        fp32 = policy(torch.float32)
        return FSDPPolicies(blocks=policy(self.dtype), root=fp32, routers=fp32)

