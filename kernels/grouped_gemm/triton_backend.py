"""Triton grouped GEMM: forward, dgrad and wgrad, with an optional row gather (ScatterMoE-style).

Shapes: N permuted rows, T tokens, K input features, M output features, E experts.

- `_grouped_mm_kernel` computes y[n] = a[n] @ b[group(n)] where a[n] is x[n] or, with a
  gather, x[src[n]]. The tile -> group schedule is computed inside the kernel from offs, so
  no host sync is needed: the grid is an upper bound (cdiv(N, BLOCK_N) + E row tiles) and
  programs past the real tile count return at once. Rows past offs[-1] form one extra
  "tail" group that is written with zeros.
- dgrad reuses the same kernel with the weights read through transposed strides.
- `_grouped_wgrad_kernel` computes dw[e] = a[rows e]^T @ dy[rows e], one program per
  (expert, output tile), looping over the expert's rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from moetrain.kernels import common

_INTERPRET = common.interpreter_enabled()
# Under the interpreter: one large tile (small tiles are slow there, autotune pointless).
_INTERP_BLOCKS = {"BLOCK_N": 64, "BLOCK_M": 64, "BLOCK_K": 64}
_INTERP_WGRAD_BLOCKS = {"BLOCK_K": 64, "BLOCK_M": 64, "BLOCK_R": 64}


# Autotune configurations, (BLOCK_N|BLOCK_K, BLOCK_M, BLOCK_K|BLOCK_R, num_warps, num_stages).
# Tensor-core tiles serve bf16 and fp16 (warpgroup MMA on Hopper, tcgen05 on Blackwell).
_FWD_TC = [(128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
           (256, 128, 64, 8, 3), (64, 128, 64, 4, 5), (64, 256, 64, 8, 4),
           (128, 64, 64, 4, 5)]  # fmt: skip
_WGRAD_TC = [(128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
             (256, 128, 64, 8, 3), (64, 128, 128, 4, 4), (128, 128, 128, 8, 3),
             (64, 64, 128, 4, 5)]  # fmt: skip
# fp32 computes with input_precision="ieee", on the FMA units, where Triton's dot holds a
# BLOCK_K-deep slice of both operands in registers: the tensor-core tiles (64-deep, 3-5
# stages of 4-byte operands) spill to local memory and outgrow shared memory in fp32
# (docs/kernels_compiled.md). Shallow K tiles instead, none spilling on sm_90 or sm_100
# under the oldest and the newest supported Triton. Every dot is at least 16 deep: Triton
# 3.6's tl.dot refuses K < 16 for 16- and 32-bit operands (3.9 allows 8 for fp32), and the
# 128x128 and 8-warp 16-deep tiles that would fit spill under 3.6's register allocation.
_FWD_FMA = [(128, 64, 32, 8, 3), (64, 128, 32, 8, 3), (64, 64, 32, 4, 4), (64, 64, 16, 4, 4),
            (64, 64, 32, 4, 3)]  # fmt: skip
_WGRAD_FMA = [(128, 128, 16, 8, 3), (128, 128, 32, 8, 3), (64, 128, 16, 4, 3),
              (128, 64, 16, 4, 3), (64, 64, 32, 4, 3)]  # fmt: skip
_FMA_CONFIGS: set[int] = set()  # ids of the fp32 configurations


def _configs(names: tuple[str, str, str], tc: list, fma: list) -> list[triton.Config]:
    def make(shapes):
        return [triton.Config(dict(zip(names, (a, b, c), strict=True)), num_warps=w,
                              num_stages=st) for a, b, c, w, st in shapes]  # fmt: skip

    fma_configs = make(fma)
    _FMA_CONFIGS.update(id(c) for c in fma_configs)
    return make(tc) + fma_configs


def _fwd_configs() -> list[triton.Config]:
    return _configs(("BLOCK_N", "BLOCK_M", "BLOCK_K"), _FWD_TC, _FWD_FMA)


def _wgrad_configs() -> list[triton.Config]:
    return _configs(("BLOCK_K", "BLOCK_M", "BLOCK_R"), _WGRAD_TC, _WGRAD_FMA)


def _prune_by_dtype(configs: list, named_args: dict, **kwargs) -> list:
    """The autotuner tries the FMA tiles for fp32 inputs, the tensor-core tiles otherwise."""
    fp32 = named_args["x_ptr"].dtype == torch.float32
    return [c for c in configs if (id(c) in _FMA_CONFIGS) == fp32]


def first_configs(configs: list) -> list:
    """The first tensor-core and the first FMA configuration (one per dtype class: what
    MOETRAIN_TEST_AUTOTUNE=first keeps)."""
    return [next(c for c in configs if id(c) not in _FMA_CONFIGS),
            next(c for c in configs if id(c) in _FMA_CONFIGS)]  # fmt: skip


@triton.jit
def _grouped_mm_kernel(
    x_ptr,
    src_ptr,
    w_ptr,
    y_ptr,
    offs_ptr,
    N,
    K,
    M,
    E,
    stride_xn,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wm,
    stride_yn,
    stride_ym,
    HAS_SRC: tl.constexpr,
    E_POW2: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_col_tiles = tl.cdiv(M, BLOCK_M)
    max_row_tiles = tl.cdiv(N, BLOCK_N) + E
    # Swizzle so that consecutive programs share row tiles (x in L2) and expert weights.
    per_band = GROUP_N * num_col_tiles
    band = pid // per_band
    first_row_tile = band * GROUP_N
    band_rows = tl.minimum(max_row_tiles - first_row_tile, GROUP_N)
    row_tile = first_row_tile + (pid % per_band) % band_rows
    col_tile = (pid % per_band) // band_rows

    # Schedule: groups 0..E-1 are experts, group E is the tail [offs[-1], N) (zero rows),
    # groups > E are empty padding. Offsets are clamped to N so bad offs cannot write OOB.
    g = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + g, mask=g < E, other=N)
    ends = tl.minimum(tl.where(g <= E, ends, N), N)
    starts = tl.load(offs_ptr + g - 1, mask=(g >= 1) & (g <= E), other=0)
    starts = tl.minimum(tl.where(g <= E, starts, N), N)
    tiles = tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_N)
    cum = tl.cumsum(tiles, 0)
    if row_tile >= tl.sum(tiles, 0):
        return
    group = tl.sum((cum <= row_tile).to(tl.int32), 0)
    is_g = g == group
    tile_in_group = row_tile - tl.sum(tl.where(is_g, cum - tiles, 0), 0)
    row_start = tl.sum(tl.where(is_g, starts, 0), 0) + tile_in_group * BLOCK_N
    row_end = tl.sum(tl.where(is_g, ends, 0), 0)

    rows = row_start + tl.arange(0, BLOCK_N)
    row_mask = rows < row_end
    cols = col_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    col_mask = cols < M
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_yn + cols[None, :] * stride_ym
    out_mask = row_mask[:, None] & col_mask[None, :]
    if group == E:
        tl.store(y_ptrs, tl.zeros((BLOCK_N, BLOCK_M), dtype=y_ptr.dtype.element_ty), out_mask)
    else:
        if HAS_SRC:
            src = tl.load(src_ptr + rows, mask=row_mask, other=-1)
            a_mask = row_mask & (src >= 0)
            a_rows = tl.where(src >= 0, src, 0)
        else:
            a_mask = row_mask
            a_rows = rows.to(tl.int64)
        a_ptrs = x_ptr + a_rows[:, None] * stride_xn
        w_base = w_ptr + group.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            # All anchor shapes have K % BLOCK_K == 0: drop the K mask from the hot loop then.
            k_mask = (ks < K) if not EVEN_K else tl.full((BLOCK_K,), True, tl.int1)
            a = tl.load(
                a_ptrs + ks[None, :] * stride_xk, mask=a_mask[:, None] & k_mask[None, :], other=0.0
            )
            b = tl.load(
                w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wm,
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), out_mask)


@triton.jit
def _grouped_wgrad_kernel(
    x_ptr,
    src_ptr,
    dy_ptr,
    dw_ptr,
    offs_ptr,
    N,
    K,
    M,
    stride_xn,
    stride_xk,
    stride_dyn,
    stride_dym,
    stride_dwe,
    stride_dwk,
    stride_dwm,
    HAS_SRC: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_col_tiles = tl.cdiv(M, BLOCK_M)
    k_tile = pid // num_col_tiles
    col_tile = pid % num_col_tiles
    end = tl.minimum(tl.load(offs_ptr + e), N)
    start = tl.minimum(tl.load(offs_ptr + e - 1, mask=e > 0, other=0), N)

    ks = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = ks < K
    cols = col_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    col_mask = cols < M
    acc = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < end
        if HAS_SRC:
            src = tl.load(src_ptr + rows, mask=row_mask, other=-1)
            a_mask = row_mask & (src >= 0)
            a_rows = tl.where(src >= 0, src, 0)
        else:
            a_mask = row_mask
            a_rows = rows.to(tl.int64)
        a = tl.load(  # (BLOCK_K, BLOCK_R): x^T tile
            x_ptr + a_rows[None, :] * stride_xn + ks[:, None] * stride_xk,
            mask=k_mask[:, None] & a_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            dy_ptr + rows.to(tl.int64)[:, None] * stride_dyn + cols[None, :] * stride_dym,
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    dw_ptrs = dw_ptr + e.to(tl.int64) * stride_dwe + ks[:, None] * stride_dwk
    tl.store(
        dw_ptrs + cols[None, :] * stride_dwm,
        acc.to(dw_ptr.dtype.element_ty),
        mask=k_mask[:, None] & col_mask[None, :],
    )


if _INTERPRET:
    _fwd_launch = _grouped_mm_kernel
    _wgrad_launch = _grouped_wgrad_kernel
else:
    # Keyed on the layer's feature sizes (and, by Triton, the dtypes), not the row count.
    _prune = {"early_config_prune": _prune_by_dtype}
    _fwd_launch = triton.autotune(
        configs=_fwd_configs(), key=["K", "M", "HAS_SRC"], prune_configs_by=_prune
    )(
        triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(
            _grouped_mm_kernel
        )
    )
    _wgrad_launch = triton.autotune(
        configs=_wgrad_configs(), key=["K", "M", "HAS_SRC"], prune_configs_by=_prune
    )(_grouped_wgrad_kernel)


def _dot_flags(dtype: torch.dtype) -> dict:
    # The interpreter's tl.dot mis-handles bf16/fp16 tiles, so it multiplies in fp32; on GPU
    # fp32 inputs use full-precision ("ieee") products to match torch's fp32 matmul.
    return {
        "DOT_FP32": _INTERPRET or dtype == torch.float32,
        "INPUT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def launch_grouped_mm(
    x: torch.Tensor,
    src_N: torch.Tensor | None,
    w_EKM: torch.Tensor,
    offs_E: torch.Tensor,
    num_rows: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y (num_rows, M) = x[src or row] @ w[group]; w may be any strided view (dgrad)."""
    common.check_triton_device("grouped_mm", x)
    assert offs_E.dtype == torch.int32 and offs_E.is_contiguous(), "offs must be int32, contiguous"
    assert src_N is None or (src_N.dtype == torch.int64 and src_N.shape == (num_rows,))
    num_experts, k_dim, m_dim = w_EKM.shape
    assert x.shape[1] == k_dim, f"x has {x.shape[1]} features, w expects {k_dim}"
    y = torch.empty(num_rows, m_dim, dtype=out_dtype or x.dtype, device=x.device)
    if num_rows == 0 or m_dim == 0:
        return y
    src_arg = src_N if src_N is not None else offs_E  # unused pointer when HAS_SRC is False
    args = (
        x, src_arg, w_EKM, y, offs_E, num_rows, k_dim, m_dim, num_experts,
        x.stride(0), x.stride(1), w_EKM.stride(0), w_EKM.stride(1), w_EKM.stride(2),
        y.stride(0), y.stride(1),
    )  # fmt: skip
    consts = {
        "HAS_SRC": src_N is not None,
        "E_POW2": triton.next_power_of_2(num_experts + 1),
        "GROUP_N": 8,
        **_dot_flags(x.dtype),
    }

    def grid(meta: dict) -> tuple[int]:
        row_tiles = triton.cdiv(num_rows, meta["BLOCK_N"]) + num_experts
        return (row_tiles * triton.cdiv(m_dim, meta["BLOCK_M"]),)

    if _INTERPRET:
        even_k = k_dim % _INTERP_BLOCKS["BLOCK_K"] == 0
        _fwd_launch[grid(_INTERP_BLOCKS)](*args, **consts, **_INTERP_BLOCKS, EVEN_K=even_k)
    else:
        _fwd_launch[grid](*args, **consts)
    return y


def launch_grouped_wgrad(
    x: torch.Tensor,
    src_N: torch.Tensor | None,
    dy_NM: torch.Tensor,
    offs_E: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """dw (E, K, M): dw[e] = x[src or row of e]^T @ dy[rows of e]; zero for empty groups."""
    num_experts = offs_E.shape[0]
    num_rows, m_dim = dy_NM.shape
    k_dim = x.shape[1]
    dw = torch.empty(num_experts, k_dim, m_dim, dtype=out_dtype, device=x.device)
    if k_dim == 0 or m_dim == 0:
        return dw
    src_arg = src_N if src_N is not None else offs_E
    args = (
        x, src_arg, dy_NM, dw, offs_E, num_rows, k_dim, m_dim,
        x.stride(0), x.stride(1), dy_NM.stride(0), dy_NM.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
    )  # fmt: skip
    consts = {"HAS_SRC": src_N is not None, **_dot_flags(x.dtype)}

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(k_dim, meta["BLOCK_K"]) * triton.cdiv(m_dim, meta["BLOCK_M"]),
                num_experts)  # fmt: skip

    if _INTERPRET:
        _wgrad_launch[grid(_INTERP_WGRAD_BLOCKS)](*args, **consts, **_INTERP_WGRAD_BLOCKS)
    else:
        _wgrad_launch[grid](*args, **consts)
    return dw


class GroupedMMFunction(torch.autograd.Function):
    """y = gather?(x) @ w[group]. src=None: plain grouped GEMM; src: rows x[src[n]], -1 = pad.

    Backward: dgrad is the forward kernel on dy with w read transposed; with a gather the
    per-row dgrad is scatter-added back to tokens in fp32. wgrad is the K-grouped kernel.
    """

    @staticmethod
    def forward(ctx, x, src_N, w_EKM, offs_E):  # type: ignore[override]
        offs_E = offs_E.contiguous()
        num_rows = x.shape[0] if src_N is None else src_N.shape[0]
        y = launch_grouped_mm(x, src_N, w_EKM, offs_E, num_rows)
        ctx.save_for_backward(
            x if ctx.needs_input_grad[2] else None,
            src_N,
            w_EKM if ctx.needs_input_grad[0] else None,
            offs_E,
        )
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.w_dtype = w_EKM.dtype
        return y

    @staticmethod
    def backward(ctx, dy_NM):  # type: ignore[override]
        x, src_N, w_EKM, offs_E = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_EMK = w_EKM.transpose(1, 2)  # a view: the kernel reads it through strides
            if src_N is None:
                dx = launch_grouped_mm(dy_NM, None, w_EMK, offs_E, dy_NM.shape[0])
            else:
                # fp32 per-row dgrad, then one fp32 scatter-add per token (k copies each).
                num_tokens = ctx.x_shape[0]
                dx_NK = launch_grouped_mm(
                    dy_NM, None, w_EMK, offs_E, dy_NM.shape[0], out_dtype=torch.float32
                )
                sink_N = torch.where(src_N >= 0, src_N, num_tokens)
                dx = dx_NK.new_zeros(num_tokens + 1, ctx.x_shape[1])
                dx.index_add_(0, sink_N, dx_NK)
                dx = dx[:num_tokens].to(ctx.x_dtype)
        if ctx.needs_input_grad[2]:
            dw = launch_grouped_wgrad(x, src_N, dy_NM, offs_E, ctx.w_dtype)
        return dx, None, dw, None


def grouped_mm_triton(
    x_NK: torch.Tensor, w_EKM: torch.Tensor, offs_E: torch.Tensor
) -> torch.Tensor:
    """Triton grouped GEMM; same contract as moetrain.kernels.grouped_mm."""
    common.check_grouped_mm("grouped_mm", x_NK, w_EKM, offs_E)
    return GroupedMMFunction.apply(x_NK, None, w_EKM, offs_E)


def gather_grouped_mm_triton(
    x_TK: torch.Tensor, src_N: torch.Tensor, w_EKM: torch.Tensor, offs_E: torch.Tensor
) -> torch.Tensor:
    """Triton gather + grouped GEMM without materialising x[src]."""
    common.check_grouped_mm("gather_grouped_mm", x_TK, w_EKM, offs_E)
    common.check_gather("gather_grouped_mm", x_TK, src_N)
    return GroupedMMFunction.apply(x_TK, src_N.contiguous(), w_EKM, offs_E)
