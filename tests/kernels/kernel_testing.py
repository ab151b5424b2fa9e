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


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Compare with the tolerance of expected's dtype; on failure print max/mean abs error."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    tol = TOLERANCES[expected.dtype]
    a, e = actual.detach().float(), expected.detach().float()
    if a.numel() == 0 or torch.allclose(a, e, **tol):
        return
    err = (a - e).abs()
    worst = int((err - tol["rtol"] * e.abs()).argmax())  # the element furthest out of bounds
    raise AssertionError(
        f"{name} ({expected.dtype}): max abs err {err.max().item():.3e}, worst at flat index "
        f"{worst} (got {a.flatten()[worst].item():.6g}, want {e.flatten()[worst].item():.6g}), "
        f"mean abs err {err.mean().item():.3e}, tolerance {tol}"
    )


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
