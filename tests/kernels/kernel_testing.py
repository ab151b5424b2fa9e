"""Shared helpers for the kernel tests: the ONE tolerance table, assert_close, gradients.

Tolerances are per dtype and are never loosened to make a test pass. bf16/fp16 figures
allow about two roundings of the output (the fast paths and the references accumulate in
fp32 in different orders, then round once).
"""

from __future__ import annotations

import pytest
import torch

TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1.6e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
BACKENDS = ["torch", "triton"]

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    name: str,
    slack: torch.Tensor | None = None,
) -> None:
    """Compare with the tolerance of expected's dtype; on failure print max/mean abs error.
    ``slack``: an elementwise bound added to it, which the caller derives from the operation
    (``accumulation_slack``), where rounding scales with more than the result's magnitude."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    tol = TOLERANCES[expected.dtype]
    a, e = actual.detach().float(), expected.detach().float()
    if slack is None:
        if a.numel() == 0 or torch.allclose(a, e, **tol):
            return
        bound = tol["atol"] + tol["rtol"] * e.abs()
    else:
        bound = tol["atol"] + tol["rtol"] * e.abs() + slack.float()
        if a.numel() == 0 or bool(((a - e).abs() <= bound).all()):  # NaN fails here too
            return
    err = (a - e).abs()
    worst = int((err - bound).nan_to_num(float("inf")).argmax())  # the furthest out of bounds
    extra = "" if slack is None else f" plus a slack of {slack.flatten()[worst].item():.3e} there"
    raise AssertionError(
        f"{name} ({expected.dtype}): max abs err {err.max().item():.3e}, worst at flat index "
        f"{worst} (got {a.flatten()[worst].item():.6g}, want {e.flatten()[worst].item():.6g}), "
        f"mean abs err {err.mean().item():.3e}, tolerance {tol}{extra}"
    )


def accumulation_slack(terms: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor | None:
    """How far two sums of ``terms`` rows into ``size`` rows by ``index`` (an ``index_add``)
    may differ when each is accumulated in ``terms``' dtype in its own order: every addition
    rounds by at most u x |partial sum| <= u x S (S: the sum of the terms' magnitudes), so a
    row of m terms lies within m u S of the exact sum (rounding of each term included) and two
    orders within 2 m u S (Higham, recursive summation). None in fp32, whose tolerance covers
    it; in fp16 a gradient of 0.24 made of terms near 4 can differ by one ulp of 4, 0.004."""
    if terms.dtype == torch.float32:
        return None
    u = torch.finfo(terms.dtype).eps / 2
    mags = torch.zeros(size, *terms.shape[1:]).index_add_(
        0, index.cpu(), terms.detach().float().abs().cpu()
    )
    count = torch.zeros(size).index_add_(0, index.cpu(), torch.ones(len(index)))
    return (2 * u * count.view(-1, *([1] * (terms.dim() - 1))) * mags).to(terms.device)


def grads(
    outputs: torch.Tensor | list[torch.Tensor],
    inputs: list[torch.Tensor],
    grad_outputs: torch.Tensor | list[torch.Tensor],
) -> list[torch.Tensor]:
    """torch.autograd.grad, with zeros for inputs the graph does not reach (a reference
    whose output is all constant zeros, e.g. every slot dropped, has no graph at all)."""
    outs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    if not any(o.requires_grad for o in outs):
        return [torch.zeros_like(i) for i in inputs]
    got = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for g, i in zip(got, inputs, strict=True)]


def offsets(sizes: list[int], device: torch.device = DEVICE) -> torch.Tensor:
    """int32 cumulative end offsets from per-group row counts."""
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
