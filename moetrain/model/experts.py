"""Routed experts stored as grouped weights, computed with one grouped GEMM per projection.

Shape legend: E experts, D model dim, F expert FFN dim, N permuted rows (expert-contiguous).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.kernels import grouped_mm
from moetrain.kernels.fp8 import Recipe, Reduce, fp8_grouped_mm


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


class GroupedExperts(nn.Module):
    """E SwiGLU experts: y = (silu(x W1[e]) * (x W3[e])) W2[e] for the rows of expert e."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, top_k: int):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k  # only for active-parameter accounting
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=1.0 / math.sqrt(w.shape[1]))
        # FP8 grouped GEMMs (``train.fp8``, set by ``moetrain.model.fp8.convert_to_fp8``):
        # (recipe, backend), or None for the compute dtype.
        self.fp8: tuple[Recipe, str] | None = None
        # Expert tensor parallelism (installed from outside): the max over the ranks holding
        # the other slices of the FFN width, so that an FP8 scale over F covers all of it.
        self.amax_reduce: Reduce | None = None

    def forward(self, x_ND: torch.Tensor, offs_E: torch.Tensor, backend: str) -> torch.Tensor:
        """offs_E: int32 cumulative end row of each expert; rows past offs_E[-1] give zeros.

        Under expert tensor parallelism the weights are DTensors sharded over the FFN width
        (``moetrain.parallel.tensor_parallel``): this rank computes with its slice, and the
        dispatcher sums the partial outputs (``ExpertTPDispatcher``)."""
        if self.fp8 is not None:
            return self._forward_fp8(x_ND, offs_E)
        w1, w3, w2 = (_local(w).to(x_ND.dtype) for w in (self.w1, self.w3, self.w2))
        h_NF = F.silu(grouped_mm(x_ND, w1, offs_E, backend=backend)) * grouped_mm(
            x_ND, w3, offs_E, backend=backend
        )
        return grouped_mm(h_NF, w2, offs_E, backend=backend)

    def _forward_fp8(self, x_ND: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        """The same SwiGLU with FP8 grouped GEMMs, cast from the master weights; F is split
        over expert-TP ranks: the M of w1/w3's GEMMs and the K of w2's (``amax_reduce``)."""
        recipe, backend = self.fp8
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        r = self.amax_reduce

        def up(w: torch.Tensor) -> torch.Tensor:
            return fp8_grouped_mm(x_ND, w, offs_E, recipe, backend, reduce_m=r)

        h_NF = F.silu(up(w1)) * up(w3)
        return fp8_grouped_mm(h_NF, w2, offs_E, recipe, backend, reduce_k=r)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x). The dense FFN, and the shared experts of an MoE
    layer (fused into one SwiGLU every token goes through)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
