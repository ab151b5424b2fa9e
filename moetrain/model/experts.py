"""Routed experts stored as grouped weights, computed with one grouped GEMM per projection.

Shape legend: E experts, D model dim, F expert FFN dim, N permuted rows (expert-contiguous),
T tokens, K top-k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.kernels import grouped_mm
from moetrain.kernels.fp8 import Recipe, Reduce, fp8_grouped_mm
from moetrain.model.precision import as_compute

EXPERT_FFN_DIMS = {"w1": 2, "w3": 2, "w2": 1, "b1": 1, "b3": 1}
"""Per-expert tensors (dim 0: the expert) and the dim of each that holds the FFN width, which
expert tensor parallelism splits. The down projection's bias ``b2`` (E, D) is not one: it is
added after the combine (``GroupedExperts.output_bias``), where every rank has every expert's
tokens, and stays whole on every rank."""


def local_part(w: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter split by tensor parallelism (a DTensor), or the
    parameter itself."""
    return w.to_local() if isinstance(w, DTensor) else w


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float):
    """gpt-oss's expert activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)
    with g = min(gate, limit)."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)


class GroupedExperts(nn.Module):
    """E SwiGLU experts: y = (act(x W1[e] + b1[e], x W3[e] + b3[e])) W2[e] (+ b2[e]) for the
    rows of expert e; act is silu(g) * u, or gpt-oss's ``clamped_swiglu``; the biases only
    with ``bias``."""

    BIASES = ("b1", "b3", "b2")
    """The per-expert biases, (E, F) and (E, D): biases whatever their number of dimensions
    (never weight-decayed, never Muon's, ``moetrain.train.optim``)."""

    def __init__(
        self,
        num_experts: int,
        dim: int,
        ffn_dim: int,
        top_k: int,
        bias: bool = False,
        activation: str = "swiglu",
        alpha: float = 1.702,
        limit: float = 7.0,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k  # only for active-parameter accounting
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=1.0 / math.sqrt(w.shape[1]))
        self.b1: nn.Parameter | None = None
        self.b3: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        if bias:
            self.b1 = nn.Parameter(torch.zeros(num_experts, ffn_dim))
            self.b3 = nn.Parameter(torch.zeros(num_experts, ffn_dim))
            self.b2 = nn.Parameter(torch.zeros(num_experts, dim))
        # FP8 grouped GEMMs (``train.fp8``, set by ``moetrain.model.fp8.convert_to_fp8``):
        # (recipe, backend), or None for the compute dtype.
        self.fp8: tuple[Recipe, str] | None = None
        # Expert tensor parallelism (installed from outside): the max over the ranks holding
        # the other slices of the FFN width, so that an FP8 scale over F covers all of it.
        self.amax_reduce: Reduce | None = None

    def ffn_dims(self) -> dict[str, int]:
        """This module's per-expert tensors and their FFN-width dims (``EXPERT_FFN_DIMS``)."""
        return {n: d for n, d in EXPERT_FFN_DIMS.items() if getattr(self, n) is not None}

    def forward(self, x_ND: torch.Tensor, offs_E: torch.Tensor, backend: str) -> torch.Tensor:
        """offs_E: int32 cumulative end row of each expert; rows past offs_E[-1] give zeros
        (before the output bias, which ``output_bias`` adds after the combine).

        Under expert tensor parallelism the weights are DTensors sharded over the FFN width
        (``moetrain.parallel.tensor_parallel``): this rank computes with its slice, and the
        dispatcher sums the partial outputs (``ExpertTPDispatcher``). The biases and the
        activation are element-wise torch ops between the grouped GEMMs, whichever kernel
        backend (or FP8 recipe, ``train.fp8``) runs those.

        The experts compute in their rows' dtype: ``MoELayer`` casts the routed tokens to
        the compute dtype once, before the dispatch (``moetrain.model.precision``), and the
        weights and biases are cast to it here, once per forward, whatever the backend:
        ``torch._grouped_mm`` has no autocast kernel, the per-expert fallback writes through
        ``out=`` (which autocast never touches) and the Triton and FP8 Functions take what
        they are given."""
        dtype = x_ND.dtype
        w1, w3, w2 = (local_part(w) for w in (self.w1, self.w3, self.w2))
        if self.fp8 is not None:
            # FP8 grouped GEMMs quantize from the weights in the compute dtype themselves (and
            # keep the parameters, not a copy, for backward); F is split over expert-TP
            # ranks: the M of w1/w3's GEMMs and the K of w2's (``amax_reduce``).
            recipe, fp8_backend = self.fp8
            r = self.amax_reduce

            def up(w: torch.Tensor) -> torch.Tensor:
                return fp8_grouped_mm(x_ND, w, offs_E, recipe, fp8_backend, reduce_m=r)

            def down(h: torch.Tensor) -> torch.Tensor:
                return fp8_grouped_mm(h, w2, offs_E, recipe, fp8_backend, reduce_k=r)
        else:
            w1, w3, w2 = (w.to(dtype) for w in (w1, w3, w2))

            def up(w: torch.Tensor) -> torch.Tensor:
                return grouped_mm(x_ND, w, offs_E, backend=backend)

            def down(h: torch.Tensor) -> torch.Tensor:
                return grouped_mm(h, w2, offs_E, backend=backend)

        g_NF, u_NF = up(w1), up(w3)
        if self.b1 is not None and self.b3 is not None:
            rows_N = _expert_of_rows(offs_E, x_ND.shape[0])
            g_NF = g_NF + _with_zero_row(local_part(self.b1).to(dtype))[rows_N]
            u_NF = u_NF + _with_zero_row(local_part(self.b3).to(dtype))[rows_N]
        if self.activation == "clamped_swiglu":
            h_NF = clamped_swiglu(g_NF, u_NF, self.alpha, self.limit)
        else:
            h_NF = F.silu(g_NF) * u_NF
        return down(h_NF)

    def output_bias(
        self, ids_TK: torch.Tensor, weights_TK: torch.Tensor, dest_TK: torch.Tensor
    ) -> torch.Tensor:
        """sum_k w_tk * b2[e_tk] over each token's kept assignments (``dest_TK`` >= 0): what
        the down projection's bias adds to the combined output, (T, D). Computed where the
        combine's result is whole (after any expert-parallel or expert-TP reduction), from
        the router's weights, once. ``b2`` is rounded to the compute dtype like every
        expert parameter."""
        assert self.b2 is not None
        kept_TK = (dest_TK >= 0).to(weights_TK.dtype)
        b2_TKD = as_compute(self.b2)[ids_TK].to(weights_TK.dtype)
        return torch.einsum("tk,tkd->td", weights_TK * kept_TK, b2_TKD)


def _expert_of_rows(offs_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 expert index of each of the buffer's rows; E for rows past the last expert."""
    rows = torch.arange(num_rows, device=offs_E.device, dtype=offs_E.dtype)
    return torch.searchsorted(offs_E, rows, right=True)


def _with_zero_row(b_EF: torch.Tensor) -> torch.Tensor:
    """(E + 1, F): the biases and a zero row for the rows past the last expert."""
    return F.pad(b_EF, (0, 0, 0, 1))


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
