"""FP8 training GEMMs: the quantization recipe and its two backends (imported as
``moetrain.kernels.fp8``; torch only).

The recipe (docs/fp8.md). A GEMM input is cast to FP8 as ``q = round(clamp(x * s, -max,
max))`` with ``s = max / amax`` (the format's largest finite value over the largest
magnitude of the values sharing the scale; ``amax`` floored at ``EPS`` so an all-zero slice
gives zeros) and round-to-nearest-even by torch's float8 dtypes; it is read back as
``q * (1 / s)``. Which values share a scale:

- weights: the whole tensor (``tensorwise``; per expert for grouped weights) or each row
  along the GEMM's contraction dim (``rowwise``; per expert and column for grouped
  weights). Both are reductions over the whole tensor: under tensor parallelism a DTensor's
  ``amax`` is reduced over its shards, and a local slice (expert tensor parallelism) is
  reduced over the ranks holding the rest by the ``reduce`` callable the caller passes;
- activations and output gradients: each token's row along the contraction dim, in both
  recipes, so that a scale never depends on which other tokens a rank holds (the
  micro-batch, the expert-parallel rank, the pipeline's micro-batching);
- formats: e4m3 for weights and activations; a linear's output gradients e5m2 under
  ``tensorwise`` (more range, as torchao's and Transformer Engine's defaults), e4m3 under
  ``rowwise`` (torchao's rowwise recipe, DeepSeek-V3); the grouped GEMMs' output gradients
  e4m3 under both, since ``torch._scaled_grouped_mm`` takes e4m3 operands only (torchao's MoE
  training quantizes them to e4m3 too); ``rowwise`` rounds scales down to a power of two.

Forward (``y = x w``) and dgrad (``dx = dy w^T``) are FP8 GEMMs. The weight gradient's
contraction runs over tokens, where per-token scales cannot be factored out of one scaled
GEMM: it takes the same per-token FP8 values (the forward's ``x``, the dgrad's ``dy``)
read back to high precision and accumulates in fp32 (emulated) or in a bf16 GEMM
(``scaled_mm`` backend). That keeps every scale layout-independent.

Backends, computing the scales the same way:

- ``emulated``: quantize -> read back -> fp32 matmul / grouped GEMM; any device.
- ``scaled_mm``: ``torch._scaled_mm`` (CUDA sm89+, and torch's CPU kernel) for linears;
  ``torch._scaled_grouped_mm`` (CUDA sm90+; its groups re-laid at 16-row boundaries) for
  expert GEMMs, else one ``_scaled_mm`` per expert.

Shape legend: T tokens, K contraction dim, N output features, E experts, M expert output
columns, R rows of a grouped buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from moetrain.kernels.grouped_gemm.torch_backend import _gmm, _gmm_wgrad
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
"""Largest finite value of each format (torch.finfo(dtype).max)."""
EPS = 1e-12
"""Floor of an amax: an all-zero slice gets a finite scale and quantizes to zeros."""
BACKENDS = ("emulated", "scaled_mm")

Reduce = Callable[[torch.Tensor], torch.Tensor]
"""``reduce(amax) -> amax``: the elementwise max over the ranks holding the other slices of
the reduced dim (expert tensor parallelism), in place or not; None when this rank holds it
whole."""


@dataclass(frozen=True)
class Recipe:
    """How one FP8 training recipe scales and formats its GEMM inputs."""

    name: str
    weight_rows: bool
    """True: a weight scale per row along the contraction dim; False: one per tensor
    (per expert for grouped weights)."""
    grad_dtype: torch.dtype
    """Format of a linear's output gradients (dgrad's input; ``torch._scaled_mm`` takes e5m2
    and e4m3)."""
    grouped_grad_dtype: torch.dtype
    """Format of the grouped GEMMs' output gradients: e4m3, what ``torch._scaled_grouped_mm``
    takes (its CUDA kernel and its meta kernel refuse e5m2)."""
    pow2_scales: bool
    """Round every scale down to a power of two (the read-back then only shifts exponents)."""


RECIPES = {
    "tensorwise": Recipe(
        "tensorwise", weight_rows=False, grad_dtype=E5M2, grouped_grad_dtype=E4M3, pow2_scales=False
    ),
    "rowwise": Recipe(
        "rowwise", weight_rows=True, grad_dtype=E4M3, grouped_grad_dtype=E4M3, pow2_scales=True
    ),
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}; allowed: {', '.join(RECIPES)}")
    return RECIPES[name]


# ----------------------------------------------------------------------------- scales


def amax(
    x: torch.Tensor, dims: tuple[int, ...] | None, reduce: Reduce | None = None
) -> torch.Tensor:
    """Largest magnitude over ``dims`` (None: all), kept as size-1 dims, fp32. On a DTensor
    the reduction covers every shard (DTensor reduces its ``Partial(max)``); ``reduce``
    covers a plain slice's other ranks."""
    with torch.no_grad():
        a = x.detach().abs()
        a = a.amax() if dims is None else a.amax(dim=dims, keepdim=True)
        a = a.float()
        if reduce is not None:
            a = reduce(a)
    return a


def amax_to_scale(amax_: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """``max / max(amax, EPS)`` in fp32, rounded down to a power of two if asked (so the
    largest value still fits)."""
    amax_ = amax_.clamp(min=EPS)
    # A tensor divided, not a float: torch computes ``float / tensor`` as a reciprocal times
    # the float, one rounding more than the division the recipe states.
    scale = torch.full_like(amax_, FP8_MAX[dtype]) / amax_
    if pow2:
        # exp2(floor(log2(s))), corrected where fp32's log2 rounded up to the next integer
        # (s just below a power of two): a scale above s would push amax past the format's max.
        down = torch.exp2(torch.floor(torch.log2(scale)))
        scale = torch.where(down > scale, down / 2, down)
    return scale


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` saturated to the format's range, rounded to nearest (even) in ``dtype``.
    torch's cast alone does not saturate everywhere (e5m2 overflows to inf): the clamp does."""
    m = FP8_MAX[dtype]
    return (x.float() * scale).clamp(-m, m).to(dtype)


@dataclass
class Fp8:
    """An FP8 tensor and the factor that reads it back: ``value = data * inv_scale``."""

    data: torch.Tensor
    inv_scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * self.inv_scale


def cast(
    x: torch.Tensor,
    dtype: torch.dtype,
    dims: tuple[int, ...] | None,
    pow2: bool,
    reduce: Reduce | None = None,
) -> Fp8:
    """Cast ``x`` to FP8 with one scale per slice over ``dims`` (None: the whole tensor)."""
    scale = amax_to_scale(amax(x, dims, reduce), dtype, pow2)
    return Fp8(quantize(x, scale, dtype), scale.reciprocal())


# ----------------------------------------------------------------------------- backends


def resolve_backend(name: str, device: torch.device | str) -> str:
    """``auto``: ``scaled_mm`` on a CUDA device with FP8 tensor cores (sm89+), else
    ``emulated``."""
    if name in BACKENDS:
        return name
    if name != "auto":
        raise ValueError(f"unknown FP8 backend {name!r}; allowed: auto, {', '.join(BACKENDS)}")
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return "scaled_mm"
    return "emulated"


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same (K, N) matrix laid out column-major (``_scaled_mm``'s second operand)."""
    return t.t().contiguous().t()


def _scaled_mm(a: Fp8, b: Fp8, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (T, K) @ b (K, N)`` with a's per-row and b's per-column (or whole) factors:
    ``torch._scaled_mm`` with row-wise scale vectors, bf16 out, cast to ``out_dtype``."""
    T, N = a.data.shape[0], b.data.shape[1]
    sa = a.inv_scale.expand(T, 1).contiguous()
    sb = b.inv_scale.reshape(-1, b.inv_scale.shape[-1] if b.inv_scale.dim() else 1)
    sb = sb.expand(1, N).contiguous()
    y = torch._scaled_mm(
        a.data.contiguous(), _col_major(b.data), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16
    )
    return y.to(out_dtype)


def _matmul(a: Fp8, b: Fp8, backend: str, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (..., K) @ b (K, N)``: leading dims of ``a`` flattened for ``scaled_mm``."""
    if backend == "emulated":
        return torch.matmul(a.dequantize(), b.dequantize()).to(out_dtype)
    if isinstance(a.data, DTensor):
        return _scaled_mm_tp(a, b, out_dtype)
    lead, K = a.data.shape[:-1], a.data.shape[-1]
    flat = Fp8(a.data.reshape(-1, K), a.inv_scale.reshape(-1, 1))
    return _scaled_mm(flat, b, out_dtype).reshape(*lead, b.data.shape[1])


def _scaled_mm_tp(a: Fp8, b: Fp8, out_dtype: torch.dtype) -> torch.Tensor:
    """The scaled GEMM of tensor-parallel operands on each rank's shards: the scales were
    reduced over the whole tensors already, and FP8 shards never move (gloo cannot carry
    them, and a redistribution would gather a weight). Column-parallel (``a`` whole, ``b``
    split by output column) gives output columns, row-parallel (both split along K) partial
    sums, as the high-precision matmul does."""
    pa, pb = a.data.placements, b.data.placements
    mesh, last = a.data.device_mesh, a.data.ndim - 1
    if len(pa) != 1:
        raise NotImplementedError(f"FP8 scaled_mm on a {len(pa)}-D mesh of operands")
    if pa[0].is_replicate() and pb[0].is_replicate():
        out: Placement = Replicate()
    elif pa[0].is_replicate() and pb[0].is_shard(1):
        out = Shard(last)
    elif pa[0].is_shard(last) and pb[0].is_shard(0):
        out = Partial()
    else:
        raise NotImplementedError(f"FP8 scaled_mm of placements {pa[0]} x {pb[0]}")

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    a_local = Fp8(local(a.data), local(a.inv_scale))
    b_local = Fp8(local(b.data), local(b.inv_scale))
    y = _matmul(a_local, b_local, "scaled_mm", out_dtype)
    return DTensor.from_local(y, mesh, [out], run_check=False)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _wgrad_dtype(backend: str) -> torch.dtype:
    """The weight gradient's operands, read back: fp32 (emulated) or bf16 (a bf16 GEMM on
    the GPU; exact for power-of-two scales, whose read-back only shifts exponents)."""
    return torch.float32 if backend == "emulated" else torch.bfloat16


# ----------------------------------------------------------------------------- linear


class Fp8LinearFunction(torch.autograd.Function):
    """``y = x w^T`` (``F.linear`` without bias) with FP8 forward and dgrad GEMMs.

    Saves ``x`` as FP8 with its per-token factors (1 byte an element instead of 2 or 4) and
    the weight itself (a parameter: no copy); the dgrad's weight cast is redone in backward
    (along the other dim under ``rowwise``)."""

    @staticmethod
    def forward(ctx, x, w, recipe: Recipe, backend: str):  # type: ignore[override]
        out_dtype = _out_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xq = cast(x, E4M3, (-1,), recipe.pow2_scales)
            # The weight in the compute dtype (bf16 under autocast: what FSDP2 gathers), so
            # that one process and every layout quantize the same values; not saved.
            w_hp = w.to(out_dtype)
            wq = cast(w_hp, E4M3, (1,) if recipe.weight_rows else None, recipe.pow2_scales)
            wq_KN = Fp8(wq.data.t(), wq.inv_scale.t() if wq.inv_scale.dim() else wq.inv_scale)
            y = _matmul(xq, wq_KN, backend, out_dtype)
        ctx.recipe, ctx.backend, ctx.x_dtype, ctx.out_dtype = recipe, backend, x.dtype, out_dtype
        ctx.save_for_backward(xq.data, xq.inv_scale, w)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x_data, x_inv, w = ctx.saved_tensors
        recipe, backend = ctx.recipe, ctx.backend
        dx = dw = None
        with torch.autocast(dy.device.type, enabled=False):
            gq = cast(dy, recipe.grad_dtype, (-1,), recipe.pow2_scales)
            if ctx.needs_input_grad[0]:
                # dx = dy w: contraction over N, so the weight's scales run along N.
                w_hp = w.to(ctx.out_dtype)
                wq = cast(w_hp, E4M3, (0,) if recipe.weight_rows else None, recipe.pow2_scales)
                dx = _matmul(gq, wq, backend, ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                hp = _wgrad_dtype(backend)
                N, K = w.shape
                g_TN = gq.dequantize().to(hp).reshape(-1, N)
                x_TK = Fp8(x_data, x_inv).dequantize().to(hp).reshape(-1, K)
                # Rounded to the compute dtype, as the gradient of the weight's bf16 rounding
                # (what FSDP2 gathers under bf16) is: the same in one process and every layout.
                dw = torch.matmul(g_TN.t(), x_TK).to(ctx.out_dtype).to(w.dtype)
        return dx, dw, None, None


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe,
    backend: str = "emulated",
) -> torch.Tensor:
    """``F.linear(x, w, bias)`` with the FP8 GEMMs of ``recipe`` (the bias added in high
    precision)."""
    y = Fp8LinearFunction.apply(x, w, recipe, backend)
    return y if bias is None else y + bias.to(y.dtype)


# ----------------------------------------------------------------------------- grouped


def _grouped(
    a: Fp8, b: Fp8, offs_E: torch.Tensor, backend: str, out_dtype: torch.dtype
) -> torch.Tensor:
    """``a (R, K) @ b[e] (K, M)`` for the rows of each group; rows past offs[-1] zero.
    ``a``'s factors are per row (R, 1), ``b``'s per expert and column (E, 1, M) or per
    expert (E, 1, 1)."""
    if backend == "emulated":
        return _gmm(a.dequantize(), b.dequantize(), offs_E).to(out_dtype)
    R, (E, _, M) = a.data.shape[0], b.data.shape
    sb_EM = b.inv_scale.expand(E, 1, M).reshape(E, M).contiguous()
    if _native_grouped_ok(a.data, b.data):
        return _native_grouped(a, b.data, sb_EM, offs_E, out_dtype)
    y = torch.zeros(R, M, dtype=out_dtype, device=a.data.device)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            rows = Fp8(a.data[start:end], a.inv_scale[start:end])
            y[start:end] = _scaled_mm(rows, Fp8(b.data[e], sb_EM[e : e + 1]), out_dtype)
        start = end
    return y


GROUP_ALIGN = 16
"""``torch._scaled_grouped_mm`` wants every group to start at a multiple of 16 rows."""


def _padded_rows(offs_E: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row goes in a buffer whose groups start at multiples of ``GROUP_ALIGN``, and
    that buffer's group offsets; no host sync: the buffer has ``num_rows + 16 E`` rows, and
    rows past ``offs_E[-1]`` go past its last group (computed by nothing)."""
    E, align = offs_E.shape[0], GROUP_ALIGN
    ends = offs_E.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    padded = (ends - starts + align - 1) // align * align
    padded_ends = torch.cumsum(padded, 0)
    rows = torch.arange(num_rows, device=offs_E.device)
    group = torch.searchsorted(ends, rows, right=True).clamp(max=E - 1)
    dest = (padded_ends - padded)[group] + rows - starts[group]
    beyond = padded_ends[-1] + rows - ends[-1]  # rows past the last group
    return torch.where(rows < ends[-1], dest, beyond), padded_ends.to(torch.int32)


def _native_grouped(
    a: Fp8, b_EKM: torch.Tensor, sb_EM: torch.Tensor, offs_E: torch.Tensor, out_dtype
) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` on a copy of ``a`` whose groups are 16-row aligned (the
    dispatcher's groups have any size): rows moved as bytes, padding rows zero."""
    R, K = a.data.shape
    dest, padded_offs = _padded_rows(offs_E, R)
    rows = R + GROUP_ALIGN * offs_E.shape[0]
    data = torch.zeros(rows, K, dtype=torch.uint8, device=a.data.device)
    data[dest] = a.data.view(torch.uint8)
    scale = torch.ones(rows, dtype=torch.float32, device=a.data.device)
    scale[dest] = a.inv_scale.reshape(R)
    y = torch._scaled_grouped_mm(
        data.view(a.data.dtype),
        b_EKM.transpose(1, 2).contiguous().transpose(1, 2),  # column-major per expert
        scale,
        sb_EM,
        offs=padded_offs,
        out_dtype=torch.bfloat16,
    )[dest]
    keep = torch.arange(R, device=y.device).unsqueeze(1) < offs_E[-1]
    return y.masked_fill_(~keep, 0).to(out_dtype)


def _native_grouped_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch._scaled_grouped_mm``: CUDA sm90+, K and M multiples of 16."""
    if a.device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    if torch.cuda.get_device_capability(a.device) < (9, 0):
        return False
    return not (a.shape[1] % 16 or b.shape[2] % 16)


class Fp8GroupedMMFunction(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ w[e]`` with FP8 forward and dgrad grouped GEMMs, the
    weight gradient per expert from the same per-row FP8 values in high precision.

    ``reduce_k`` / ``reduce_m``: complete an amax over K / M when this rank holds a slice of
    that dim (expert tensor parallelism splits the FFN width: K of w2, M of w1 and w3)."""

    @staticmethod
    def forward(ctx, x_RK, w_EKM, offs_E, recipe, backend, reduce_k, reduce_m):  # type: ignore[override]
        out_dtype = _out_dtype(x_RK)
        with torch.autocast(x_RK.device.type, enabled=False):
            xq = cast(x_RK, E4M3, (1,), recipe.pow2_scales, reduce_k)
            w_hp = w_EKM.to(out_dtype)
            wq = _cast_grouped_weight(w_hp, recipe, along=1, reduce_k=reduce_k, reduce_m=reduce_m)
            y = _grouped(xq, wq, offs_E, backend, out_dtype)
        ctx.recipe, ctx.backend, ctx.x_dtype, ctx.out_dtype = recipe, backend, x_RK.dtype, out_dtype
        ctx.reduce = (reduce_k, reduce_m)
        ctx.save_for_backward(xq.data, xq.inv_scale, w_EKM, offs_E)
        return y

    @staticmethod
    def backward(ctx, dy_RM):  # type: ignore[override]
        x_data, x_inv, w_EKM, offs_E = ctx.saved_tensors
        recipe, backend = ctx.recipe, ctx.backend
        reduce_k, reduce_m = ctx.reduce
        dx = dw = None
        with torch.autocast(dy_RM.device.type, enabled=False):
            gq = cast(dy_RM, recipe.grouped_grad_dtype, (1,), recipe.pow2_scales, reduce_m)
            if ctx.needs_input_grad[0]:
                w_hp = w_EKM.to(ctx.out_dtype)
                wq = _cast_grouped_weight(w_hp, recipe, along=2, reduce_k=reduce_k,
                                          reduce_m=reduce_m)  # fmt: skip
                w_EMK = Fp8(wq.data.transpose(1, 2), wq.inv_scale.transpose(1, 2))
                dx = _grouped(gq, w_EMK, offs_E, backend, ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                hp = _wgrad_dtype(backend)
                x_RK = Fp8(x_data, x_inv).dequantize().to(hp)
                dw = _gmm_wgrad(x_RK, gq.dequantize().to(hp), offs_E)
                dw = dw.to(ctx.out_dtype).to(w_EKM.dtype)  # as the linear's
        return dx, dw, None, None, None, None, None


def _cast_grouped_weight(
    w_EKM: torch.Tensor, recipe: Recipe, along: int, reduce_k: Reduce | None,
    reduce_m: Reduce | None,
) -> Fp8:  # fmt: skip
    """A grouped weight in e4m3, scaled per expert (tensorwise) or per expert and row along
    the contraction dim ``along`` (1: K, the forward's; 2: M, the dgrad's)."""
    if recipe.weight_rows:
        dims: tuple[int, ...] = (along,)
        reduces = [reduce_k if along == 1 else reduce_m]
    else:
        dims = (1, 2)
        reduces = [reduce_k, reduce_m]

    def reduce(a: torch.Tensor) -> torch.Tensor:
        for r in reduces:
            if r is not None:
                a = r(a)
        return a

    return cast(w_EKM, E4M3, dims, recipe.pow2_scales, reduce)


def fp8_grouped_mm(
    x_RK: torch.Tensor,
    w_EKM: torch.Tensor,
    offs_E: torch.Tensor,
    recipe: Recipe,
    backend: str = "emulated",
    reduce_k: Reduce | None = None,
    reduce_m: Reduce | None = None,
) -> torch.Tensor:
    """``grouped_mm`` (``moetrain.kernels``) with the FP8 GEMMs of ``recipe``."""
    return Fp8GroupedMMFunction.apply(x_RK, w_EKM, offs_E, recipe, backend, reduce_k, reduce_m)
