"""Shared numerics of the model tests: one tolerance table and one comparison helper.

The helper is handed out as a fixture so that it works whatever pytest import mode runs
these files (a conftest is never imported by name).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

# Tolerance for a result of the given dtype compared with a float64 (or same-dtype) reference.
# Stated once per dtype; never loosened to make a test pass.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-9},
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
}


def _assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor | float | list,
    dtype: torch.dtype | None = None,
    what: str = "",
) -> None:
    """Compare in float64 with the tolerance of ``dtype`` (default: the dtype of ``actual``);
    on failure report the max and mean absolute error."""
    dtype = dtype or actual.dtype
    tol = TOLERANCES[dtype]
    actual64 = actual.detach().double()
    if isinstance(expected, torch.Tensor):
        expected64 = expected.detach().double().to(actual64.device)
    else:  # Python numbers and lists: straight to float64, never through float32
        expected64 = torch.tensor(expected, dtype=torch.float64, device=actual64.device)
    assert actual64.shape == expected64.shape, (
        f"{what}: shape {tuple(actual64.shape)} != expected {tuple(expected64.shape)}"
    )
    if torch.allclose(actual64, expected64, **tol):
        return
    err = (actual64 - expected64).abs()
    worst = int(err.argmax()) if err.numel() else 0
    raise AssertionError(
        f"{what or 'tensors'} differ beyond {dtype} tolerance {tol}: "
        f"max abs err {err.max().item():.3e}, mean abs err {err.mean().item():.3e} "
        f"(worst at flat index {worst}: {actual64.flatten()[worst].item():.6g} vs "
        f"{expected64.flatten()[worst].item():.6g})"
    )


@pytest.fixture
def assert_close() -> Callable[..., None]:
    return _assert_close
