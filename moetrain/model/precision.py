"""The compute dtype of a bf16 run (``train.dtype=bf16``): which tensors are rounded to bf16
for compute, and where. docs/kernels.md, "One bf16 for every layout", says why.

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
  routed tokens once, before the dispatch (``MoELayer``), so the expert-parallel all-to-all
  carries bf16; every GEMM's output is bf16.
- **fp32**: the token embeddings (looked up exactly: the residual stream starts and stays
  fp32), the routers' gates and their biases, forward and backward, the router's scores
  and top-k, norms' arithmetic, the combine's weighted sum (``unpermute``: fp32 weights,
  fp32 accumulation), every loss, the gradients once cast back, the optimizer.
- **where**: autocast wraps each model part's forward (``moetrain.train.engine``), never
  the backward, which then runs each op in its forward's dtype.

``compute_dtype`` and ``as_compute`` read the autocast state: outside autocast (an fp32
run) they change nothing.
"""

from __future__ import annotations

import torch


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """autocast's dtype on ``device_type`` when it is on there, else None (meta tensors,
    which the planner builds, have no autocast)."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype GEMMs on ``t``'s device compute in: autocast's, or ``t``'s own."""
    return _autocast_dtype(t.device.type) or t.dtype


def as_compute(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to the compute dtype (a differentiable cast; its gradient comes back in
    ``t``'s dtype), or ``t`` itself outside autocast or when it is in that dtype already
    (a parameter FSDP2 gathered in bf16)."""
    dtype = _autocast_dtype(t.device.type)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)
