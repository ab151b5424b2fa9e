"""FP8 quantization (``moetrain.kernels.fp8``) against a hand reference, and the FP8 linear and
grouped GEMMs against it, against high precision and across backends.

The hand reference builds each format's values from its definition (sign, exponent bias,
mantissa bits, subnormals, no infinities in e4m3fn) and rounds by searching that grid:
nearest value, ties to the even code. Scales follow docs/fp8.md: ``max / amax`` per tensor
or per row, a power of two rounded down (exactly, with ``math.frexp``) under ``rowwise``.
None of it calls the code under test or torch's float8 casts.
"""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path

import pytest
import torch
from kernel_testing import gpu, requires_cuda
from moetrain.kernels import fp8 as F8
from moetrain.kernels import grouped_mm

E4M3, E5M2 = F8.E4M3, F8.E5M2
FORMATS = {E4M3: (4, 3, 7), E5M2: (5, 2, 15)}  # exponent bits, mantissa bits, bias

# Relative error (||got - want|| / ||want||) of an FP8 GEMM against the same GEMM in fp32, per
# recipe, on unit-normal inputs: stated once. e4m3 rounds to 2^-4 relative at worst (about 2%
# rms a value); tensorwise's e5m2 output gradients of a linear to 2^-3 (the grouped GEMMs'
# are e4m3 under both recipes). Measured on these shapes: forward 0.036 / 0.037, dgrad
# 0.057 / 0.037, wgrad 0.053 / 0.036 (tensorwise / rowwise linear).
LAYER_BOUND = {"tensorwise": 0.08, "rowwise": 0.06}
# scaled_mm against emulated: the same FP8 values and factors; the scaled GEMM rounds its
# output to bf16 (2^-9 relative) and the wgrad reads the operands back in bf16. Measured
# 0.0017 (outputs, dgrad), 0.0035 (wgrad).
BACKEND_BOUND = 0.01


# ----------------------------------------------------------------------------- the hand reference


def grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite non-negative value of the format, ascending; index = the value's code."""
    ebits, mbits, bias = FORMATS[dtype]
    values = [m / 2**mbits * 2.0 ** (1 - bias) for m in range(2**mbits)]  # zero, subnormals
    for e in range(1, 2**ebits):
        for m in range(2**mbits):
            if dtype == E5M2 and e == 2**ebits - 1:
                break  # e5m2: the top exponent is infinities and NaNs
            if dtype == E4M3 and e == 2**ebits - 1 and m == 2**mbits - 1:
                break  # e4m3fn: only S.1111.111 is NaN; no infinities
            values.append((1 + m / 2**mbits) * 2.0 ** (e - bias))
    return torch.tensor(values, dtype=torch.float64)


def round_by_hand(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturate to the format's largest value, then round to the nearest grid value, ties to
    the even code."""
    g = grid(dtype)
    a = x.double().abs().clamp(max=float(g[-1])).flatten()
    hi = torch.searchsorted(g, a).clamp(max=len(g) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - g[lo], g[hi] - a
    tie = torch.where(lo % 2 == 0, lo, hi)
    pick = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, tie))
    return (torch.sign(x.double()).flatten() * g[pick]).reshape(x.shape)


def scale_by_hand(amax: float, dtype: torch.dtype, pow2: bool) -> float:
    fmax = float(grid(dtype)[-1])
    f32 = torch.float32
    s = float(torch.tensor(fmax, dtype=f32) / torch.tensor(max(amax, 1e-12), dtype=f32))
    if pow2:
        _, e = math.frexp(s)  # s = m 2^e, 0.5 <= m < 1: the power of two at or below s
        s = 2.0 ** (e - 1)
    return s


def quantize_by_hand(x: torch.Tensor, dtype, rows: bool, pow2: bool) -> torch.Tensor:
    """The FP8 value read back: round(x * s) / s, s per tensor or per row (last dim)."""
    if rows:
        out = [quantize_by_hand(r, dtype, False, pow2) for r in x.reshape(-1, x.shape[-1])]
        return torch.stack(out).reshape(x.shape)
    s = torch.tensor(scale_by_hand(float(x.abs().max()), dtype, pow2), dtype=torch.float32)
    # Products in fp32, as a GEMM's prologue and epilogue compute them.
    q = round_by_hand(x.float() * s, dtype)
    return (q.float() * (1.0 / s)).double()


def test_hand_grid_is_the_formats_definition() -> None:
    g4, g5 = grid(E4M3), grid(E5M2)
    assert len(g4) == 127 and len(g5) == 124  # finite non-negative codes
    assert g4[-1] == 448.0 and g5[-1] == 57344.0
    assert g4[1] == 2.0**-9 and g5[1] == 2.0**-16  # smallest subnormals
    assert g4[8] == 2.0**-6 and g5[4] == 2.0**-14  # smallest normals
    assert F8.FP8_MAX[E4M3] == g4[-1] and F8.FP8_MAX[E5M2] == g5[-1]


# ----------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_rounds_to_nearest_even_and_saturates(dtype) -> None:
    g = grid(dtype)
    mids = ((g[1:] + g[:-1]) / 2).float()  # exact ties (all representable in fp32)
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([
        g.float(), -g.float(), mids, -mids,
        torch.randn(4000, generator=gen) * float(g[-1]) / 8,
        torch.tensor([g[-1] * 1.01, g[-1] * 10, -g[-1] * 3, 1e30, -1e30, 0.0, -0.0]).float(),
    ])  # fmt: skip
    got = F8.quantize(x, torch.tensor(1.0), dtype).double()
    torch.testing.assert_close(got, round_by_hand(x, dtype), rtol=0, atol=0)
    assert torch.isfinite(got).all()  # torch's cast alone gives inf past e5m2's max


@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_scales_per_tensor_and_per_row(dtype, pow2) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 40, generator=gen) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[2] = 0.0  # an all-zero row: finite scale, zeros out
    tensor = F8.cast(x, dtype, None, pow2)
    assert tensor.inv_scale.shape == ()
    want = 1.0 / torch.tensor(scale_by_hand(float(x.abs().max()), dtype, pow2), dtype=torch.float32)
    assert tensor.inv_scale == want
    rows = F8.cast(x, dtype, (1,), pow2)
    assert rows.inv_scale.shape == (6, 1)
    for i in range(6):
        s = scale_by_hand(float(x[i].abs().max()), dtype, pow2)
        want = 1.0 / torch.tensor(s, dtype=torch.float32)
        assert rows.inv_scale[i, 0] == want, i
    for cast, by_rows in ((tensor, False), (rows, True)):
        got = cast.dequantize().double()
        torch.testing.assert_close(got, quantize_by_hand(x, dtype, by_rows, pow2), rtol=0, atol=0)
    assert (rows.dequantize()[2] == 0).all()
    # The largest value of each slice lands on (or, rounded down to a power of two, below)
    # the format's max: never saturated, never NaN.
    top = (rows.data.float().abs().amax(1))[[0, 1, 3, 4, 5]]
    assert (top <= F8.FP8_MAX[dtype]).all() and (top > F8.FP8_MAX[dtype] / 2).all()


def test_power_of_two_scale_rounds_down_where_fp32_log2_rounds_up() -> None:
    """A scale just below 2^8: fp32's log2 rounds it to 8.0; the scale must still be 2^7."""
    s = torch.nextafter(torch.tensor(256.0), torch.tensor(0.0))
    amax = F8.FP8_MAX[E4M3] / s
    got = F8.amax_to_scale(amax, E4M3, pow2=True)
    assert float(got) == scale_by_hand(float(amax), E4M3, True) == 128.0
    assert float(amax * got) <= F8.FP8_MAX[E4M3]


def test_e4m3_and_e5m2_differ_as_the_formats_do() -> None:
    """Gradients get e5m2 under tensorwise: more range, one mantissa bit less."""
    x = torch.tensor([1.0 + 2**-3, 1.0 + 2**-2, 3e-5, 1e-3])
    one = torch.tensor(1.0)
    assert F8.quantize(x, one, E4M3).float().tolist() == [1.125, 1.25, 0.0, 2.0**-9]
    assert F8.quantize(x, one, E5M2).float().tolist() == [1.0, 1.25, 2.0**-15, 2.0**-10]


def test_the_hand_reference_catches_truncation_and_a_missing_clamp() -> None:
    """The oracle can fail: rounding toward zero, or a cast without saturation, differ."""
    x = torch.tensor([1.2, 500.0])
    truncated = torch.tensor([1.125, 448.0]).double()
    assert not torch.equal(truncated, round_by_hand(x, E4M3))
    big = torch.tensor([70000.0])
    assert torch.isinf(big.to(E5M2).float()).all()  # torch's cast alone: inf past the max
    assert round_by_hand(big, E5M2).item() == 57344.0


# ----------------------------------------------------------------------------- linear


def assert_fp32_gemm_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """The same FP8 values through two fp32 GEMMs: they differ by the order of the fp32
    sums only, within 1e-6 of the result's largest magnitude."""
    err = (got.double() - ref).abs().max().item()
    assert err <= 1e-6 * ref.abs().max().item(), err


def _linear_by_hand(x, w, dy, recipe: str, grad_dtype=None):
    """y, dx, dw of an FP8 linear written from the recipe with the hand quantizer: forward
    x (per row) @ w (per tensor, or per row along K); dgrad dy (per row, e5m2 under
    tensorwise unless ``grad_dtype`` says otherwise) @ w (per tensor, or per column along N);
    wgrad dy^T x of those FP8 values."""
    r = F8.get_recipe(recipe)
    p2 = r.pow2_scales
    xq = quantize_by_hand(x, E4M3, True, p2)
    wq = quantize_by_hand(w, E4M3, r.weight_rows, p2)
    grad_dtype = grad_dtype or {"tensorwise": E5M2, "rowwise": E4M3}[recipe]
    gq = quantize_by_hand(dy, grad_dtype, True, p2)
    wq_cols = quantize_by_hand(w.t(), E4M3, r.weight_rows, p2).t()
    x2, g2 = xq.reshape(-1, x.shape[-1]), gq.reshape(-1, w.shape[0])
    return xq @ wq.t(), gq @ wq_cols, g2.t() @ x2


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_linear_is_the_recipe_by_hand(recipe) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 32, generator=gen, requires_grad=True)
    w = torch.randn(48, 32, generator=gen) * torch.linspace(0.1, 3, 48).unsqueeze(1)
    w.requires_grad_()
    dy = torch.randn(3, 5, 48, generator=gen)
    y = F8.fp8_linear(x, w, None, F8.get_recipe(recipe), "emulated")
    y.backward(dy)
    want = _linear_by_hand(x.detach(), w.detach(), dy, recipe)
    for got, ref in zip((y, x.grad, w.grad), want, strict=True):
        assert_fp32_gemm_close(got, ref)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_within_the_bound_of_high_precision_forward_and_backward(recipe) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, 64, generator=gen, requires_grad=True)
    w = torch.randn(96, 64, generator=gen, requires_grad=True)
    b = torch.randn(96, generator=gen, requires_grad=True)
    dy = torch.randn(4, 16, 96, generator=gen)
    got = []
    for fn in (lambda: F8.fp8_linear(x, w, b, F8.get_recipe(recipe)),
               lambda: torch.nn.functional.linear(x, w, b)):  # fmt: skip
        x.grad = w.grad = b.grad = None
        y = fn()
        y.backward(dy)
        got.append((y.detach(), x.grad, w.grad, b.grad))
    for name, a, ref in zip(("y", "dx", "dw", "db"), *got, strict=True):
        err = _rel(a, ref)
        assert err <= LAYER_BOUND[recipe], (name, err)
        assert err > 0 or name == "db", (name, "no quantization at all")
    torch.testing.assert_close(got[0][3], got[1][3])  # the bias stays high precision


def test_the_layer_bound_catches_a_scale_that_is_not_inverted() -> None:
    """A read-back multiplied by the scale instead of its inverse is far outside the bound."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(8, 64, generator=gen), torch.randn(32, 64, generator=gen)
    xq, wq = F8.cast(x, E4M3, (1,), False), F8.cast(w, E4M3, None, False)
    wrong = (xq.data.float() / xq.inv_scale) @ (wq.data.float() / wq.inv_scale).t()
    assert _rel(wrong, x @ w.t()) > 10 * LAYER_BOUND["tensorwise"]


def test_fp8_linear_saves_its_input_in_fp8() -> None:
    x = torch.randn(16, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        F8.fp8_linear(x, w, None, F8.get_recipe("rowwise"))
    assert any(t.dtype == E4M3 and t.shape == x.shape for t in saved)
    assert not any(t.dtype == torch.float32 and t.shape == x.shape for t in saved)


def test_fp8_linear_under_bf16_autocast_returns_bf16_and_fp32_gradients() -> None:
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F8.fp8_linear(x, w, None, F8.get_recipe("tensorwise"))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


# ----------------------------------------------------------------------------- grouped


def _grouped_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    offs = torch.tensor([10, 10, 25, 37], dtype=torch.int32)  # an empty expert, 3 rows past
    x = torch.randn(40, 32, generator=gen, requires_grad=True)
    w = torch.randn(4, 32, 48, generator=gen) * torch.tensor([0.1, 1, 3, 30]).view(4, 1, 1)
    w.requires_grad_()
    dy = torch.randn(40, 48, generator=gen)
    return x, w, offs, dy


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_grouped_mm_is_the_recipe_by_hand_per_expert(recipe) -> None:
    x, w, offs, dy = _grouped_case(5)
    y = F8.fp8_grouped_mm(x, w, offs, F8.get_recipe(recipe))
    y.backward(dy)
    r = F8.get_recipe(recipe)
    start = 0
    for e, end in enumerate(offs.tolist()):
        rows = slice(start, end)
        if end > start:
            # Expert e alone is a linear with weight w[e]^T (out x in), its output gradients
            # in e4m3 under both recipes: what torch._scaled_grouped_mm takes.
            want = _linear_by_hand(x.detach()[rows], w.detach()[e].t(), dy[rows], recipe, E4M3)
            for got, ref in zip((y[rows], x.grad[rows], w.grad[e].t()), want, strict=True):
                assert_fp32_gemm_close(got, ref)
        else:
            assert (w.grad[e] == 0).all()
        start = end
    assert (y[37:] == 0).all() and (x.grad[37:] == 0).all()
    assert r.name == recipe


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_grouped_mm_within_the_bound_of_high_precision(recipe) -> None:
    x, w, offs, dy = _grouped_case(6)
    got = []
    for fn in (lambda: F8.fp8_grouped_mm(x, w, offs, F8.get_recipe(recipe)),
               lambda: grouped_mm(x, w, offs)):  # fmt: skip
        x.grad = w.grad = None
        y = fn()
        y.backward(dy)
        got.append((y.detach(), x.grad, w.grad))
    for name, a, ref in zip(("y", "dx", "dw"), *got, strict=True):
        assert 0 < _rel(a, ref) <= LAYER_BOUND[recipe], (name, _rel(a, ref))


@pytest.mark.thread_counts
def test_grouped_reduce_completes_the_amax_of_a_split_dim() -> None:
    """Expert TP: a rank holding half of K computes the scales of the whole K when
    ``reduce_k`` brings the other half's amax; without it, its own (a bug)."""
    x, w, offs, _ = _grouped_case(7)
    x = x.detach()
    half = slice(0, 16)
    other = x[:, 16:].abs().amax(1, keepdim=True).float()
    whole = F8.cast(x, E4M3, (1,), False)
    split = F8.cast(x[:, half], E4M3, (1,), False, reduce=lambda a: torch.maximum(a, other))
    local = F8.cast(x[:, half], E4M3, (1,), False)
    torch.testing.assert_close(split.inv_scale, whole.inv_scale, rtol=0, atol=0)
    assert not torch.equal(local.inv_scale, whole.inv_scale)


# ----------------------------------------------------------------------------- backends


def _cpu_scaled_mm_missing() -> str | None:
    """Why this torch's CPU ``_scaled_mm`` cannot run the calls the ``scaled_mm`` backend
    makes (e4m3 or e5m2 rows times e4m3 columns, row-wise fp32 scales, bf16 out), or None.
    torch 2.13's CPU kernel runs them; 2.11's, the supported floor, does not."""
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no _scaled_mm"
    b = torch.ones(16, 16).to(E4M3).t()
    for a_dtype in (E4M3, E5M2):
        try:
            torch._scaled_mm(torch.ones(16, 16).to(a_dtype), b, scale_a=torch.ones(16, 1),
                             scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)  # fmt: skip
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return (f"torch {torch.__version__}'s CPU _scaled_mm does not take "
                    f"{str(a_dtype)[6:]} x e4m3 with row-wise scales: {first}")  # fmt: skip
    return None


def test_a_cpu_scaled_mm_without_the_kernel_gives_a_reason(monkeypatch) -> None:
    """torch 2.11's CPU ``_scaled_mm`` refuses what 2.13's runs: the tests that need it skip
    with the reason instead of failing (the H100 run under torch 2.11 failed them)."""
    assert _cpu_scaled_mm_missing() is None  # this torch (2.13) has the kernel

    def refuse(a, b, **kwargs):
        if a.dtype == E5M2:
            raise RuntimeError("\"scaled_mm_cpu\" not implemented for 'Float8_e5m2'")
        return torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16)

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    why = _cpu_scaled_mm_missing()
    assert why and "e5m2 x e4m3" in why and "not implemented" in why, why
    monkeypatch.delattr(torch, "_scaled_mm")
    assert "has no _scaled_mm" in _cpu_scaled_mm_missing()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_backend_matches_emulated(recipe) -> None:
    """``torch._scaled_mm`` (its CPU kernel here; CUDA in the gpu tests) on the same FP8
    values: linear and the per-expert path of the grouped GEMM."""
    if why := _cpu_scaled_mm_missing():
        pytest.skip(why)
    r = F8.get_recipe(recipe)
    x, w, offs, dy = _grouped_case(8)
    runs = {}
    for backend in ("emulated", "scaled_mm"):
        x.grad = w.grad = None
        y = F8.fp8_grouped_mm(x, w, offs, r, backend)
        y.backward(dy)
        lin_x = x.detach()[:16].clone().requires_grad_()
        lin_w = w.detach()[2].t().contiguous().requires_grad_()
        z = F8.fp8_linear(lin_x, lin_w, None, r, backend)
        z.backward(dy[:16])
        runs[backend] = (y.detach(), x.grad, w.grad, z.detach(), lin_x.grad, lin_w.grad)
    for name, a, b in zip(("y", "dx", "dw", "linear y", "linear dx", "linear dw"),
                          runs["scaled_mm"], runs["emulated"], strict=True):  # fmt: skip
        assert _rel(a, b) <= BACKEND_BOUND, (name, _rel(a, b))


def _fake_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype):
    """What ``torch._scaled_grouped_mm`` computes, per group, with NaN past the last group
    (the real one leaves those rows unwritten) and a check of its alignment demand."""
    assert (offs % F8.GROUP_ALIGN == 0).all(), offs
    y = torch.full((a.shape[0], b.shape[2]), float("nan"))
    start = 0
    for g, end in enumerate(offs.tolist()):
        a_g = a[start:end].float() * scale_a[start:end, None]
        y[start:end] = a_g @ (b[g].float() * scale_b[g][None, :])
        start = end
    return y.to(out_dtype)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_native_grouped_path_realigns_groups_of_any_size(recipe, monkeypatch) -> None:
    """The CUDA grouped path's padding to 16-row groups (and back), on the CPU: torch's
    grouped kernel replaced by what it computes, the same numbers as the emulated path."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        pytest.skip("torch has no _scaled_grouped_mm")
    r = F8.get_recipe(recipe)
    x, w, offs, dy = _grouped_case(9)
    runs = {}
    for backend in ("emulated", "scaled_mm"):
        if backend == "scaled_mm":
            monkeypatch.setattr(F8, "_native_grouped_ok", lambda a, b: True)
            monkeypatch.setattr(torch, "_scaled_grouped_mm", _fake_scaled_grouped_mm)
        x.grad = w.grad = None
        y = F8.fp8_grouped_mm(x, w, offs, r, backend)
        y.backward(dy)
        runs[backend] = (y.detach(), x.grad, w.grad)
    assert torch.isfinite(runs["scaled_mm"][0]).all() and (runs["scaled_mm"][0][37:] == 0).all()
    for a, b in zip(runs["scaled_mm"], runs["emulated"], strict=True):
        assert _rel(a, b) <= BACKEND_BOUND


def test_rowwise_recipe_is_torchaos_rowwise_float8_linear() -> None:
    """torchao's Float8Linear with its "rowwise" recipe (axiswise scales along the
    contraction dim, e4m3 throughout, power-of-two scales) is an independent implementation
    of the same recipe: output, input and weight gradients equal ours on torch's CPU
    ``_scaled_mm``. Its weight gradient scales the operands per column over the tokens
    instead of per token; with power-of-two scales both read back the same FP8 values
    (a scale only shifts exponents), except values 2^-14 below their slice's largest."""
    float8 = pytest.importorskip("torchao.float8")
    if why := _cpu_scaled_mm_missing():
        pytest.skip(why)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 96, generator=gen)
    w = torch.randn(48, 96, generator=gen) * torch.linspace(0.1, 4, 48).unsqueeze(1)
    dy = torch.randn(64, 48, generator=gen)
    ref = torch.nn.Sequential(torch.nn.Linear(96, 48, bias=False))
    with torch.no_grad():
        ref[0].weight.copy_(w)
    config = float8.Float8LinearConfig.from_recipe_name("rowwise")
    float8.convert_to_float8_training(ref, config=config)
    xa = x.clone().requires_grad_()
    ya = ref(xa)
    ya.backward(dy)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    yb = F8.fp8_linear(xb, wb, None, F8.get_recipe("rowwise"), "scaled_mm")
    yb.backward(dy)
    for a, b in ((ya, yb), (xa.grad, xb.grad), (ref[0].weight.grad, wb.grad)):
        assert _rel(b, a) <= 1e-6, _rel(b, a)


def test_resolve_backend() -> None:
    assert F8.resolve_backend("auto", "cpu") == "emulated"
    assert F8.resolve_backend("scaled_mm", "cpu") == "scaled_mm"
    with pytest.raises(ValueError, match="unknown FP8 backend 'fast'"):
        F8.resolve_backend("fast", "cpu")


@gpu
@requires_cuda
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cuda_scaled_gemms_match_emulated(recipe) -> None:
    """On an FP8 GPU: ``torch._scaled_mm`` for linears and ``torch._scaled_grouped_mm`` for
    expert groups of any size (re-laid at 16-row boundaries) against the emulated path,
    forward and every gradient, within ``BACKEND_BOUND``."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    r = F8.get_recipe(recipe)
    gen = torch.Generator(device="cuda").manual_seed(0)
    offs = torch.tensor([100, 100, 377, 500], dtype=torch.int32, device="cuda")  # unaligned
    x = torch.randn(512, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(4, 256, 512, device="cuda", generator=gen)
    lw = torch.randn(384, 256, device="cuda", generator=gen)
    dy = torch.randn(512, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    dz = torch.randn(512, 384, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert F8._native_grouped_ok(x.to(E4M3), w.to(E4M3)) == (
        torch.cuda.get_device_capability() >= (9, 0)
    )
    runs = {}
    for backend in ("emulated", "scaled_mm"):
        xs, ws, lws = (t.detach().clone().requires_grad_() for t in (x, w, lw))
        y = F8.fp8_grouped_mm(xs, ws, offs, r, backend)
        y.backward(dy)
        x2 = x.detach().clone().requires_grad_()
        z = F8.fp8_linear(x2, lws, None, r, backend)
        z.backward(dz)
        runs[backend] = (y, xs.grad, ws.grad, z, x2.grad, lws.grad)
    for a, b in zip(runs["scaled_mm"], runs["emulated"], strict=True):
        assert _rel(a.float(), b.float()) <= BACKEND_BOUND


# ----------------------------------------------------------------------------- the error table

ERROR_TABLE = Path(__file__).resolve().parents[2] / "docs" / "data" / "fp8_error.csv"


def error_table() -> list[dict[str, str]]:
    """Relative error (||fp8 - fp32|| / ||fp32||) of each FP8 GEMM, emulated, on unit-normal
    inputs of one shape: a linear (4096 tokens, 1024 -> 1024) and a grouped GEMM (8 experts,
    4096 rows, 1024 -> 512), forward, input gradient and weight gradient, per recipe."""
    rows = []
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4096, 1024, generator=gen)
    w = torch.randn(1024, 1024, generator=gen) / 32
    dy = torch.randn(4096, 1024, generator=gen)
    wg = torch.randn(8, 1024, 512, generator=gen) / 32
    dyg = torch.randn(4096, 512, generator=gen)
    offs = torch.arange(1, 9, dtype=torch.int32) * 512
    cases = {
        "linear": (lambda a, b, r: F8.fp8_linear(a, b, None, r),
                   lambda a, b: torch.nn.functional.linear(a, b), w, dy),
        "grouped": (lambda a, b, r: F8.fp8_grouped_mm(a, b, offs, r),
                    lambda a, b: grouped_mm(a, b, offs), wg, dyg),
    }  # fmt: skip
    for name, (fp8_op, hp_op, weight, grad) in cases.items():
        for recipe in ("tensorwise", "rowwise"):
            got = []
            r = F8.get_recipe(recipe)
            for run in (lambda a, b, op=fp8_op, r=r: op(a, b, r), hp_op):
                a, b = x.clone().requires_grad_(), weight.clone().requires_grad_()
                y = run(a, b)
                y.backward(grad)
                got.append((y.detach(), a.grad, b.grad))
            for what, f, h in zip(("output", "input gradient", "weight gradient"), *got,
                                  strict=True):  # fmt: skip
                rows.append({"gemm": name, "recipe": recipe, "tensor": what,
                             "rel_err": f"{_rel(f, h):.4f}"})  # fmt: skip
    return rows


@pytest.mark.thread_counts
def test_error_table_is_current() -> None:
    """docs/data/fp8_error.csv (quoted by docs/fp8.md) holds what this measures, rounded to 4
    digits; ``MOETRAIN_UPDATE_DOCS=1`` rewrites it. Each figure within the layer bound."""
    rows = error_table()
    for r in rows:
        assert float(r["rel_err"]) <= LAYER_BOUND[r["recipe"]], r
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    if os.environ.get("MOETRAIN_UPDATE_DOCS") == "1":
        ERROR_TABLE.write_text(out.getvalue())
    assert ERROR_TABLE.exists() and ERROR_TABLE.read_text() == out.getvalue(), (
        "docs/data/fp8_error.csv is stale: MOETRAIN_UPDATE_DOCS=1 python -m pytest "
        "tests/kernels/test_kernels_fp8.py -k error_table\n" + out.getvalue()
    )
