"""permute / unpermute, every backend, against the per-token loop reference."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import BACKENDS, DEVICE, HAS_CUDA, assert_close, grads
from moetrain.kernels import permute, unpermute
from moetrain.kernels.permutation.reference import permute_reference, unpermute_reference

# name: (T, K, D, num_rows, fraction of slots dropped)
CASES = {
    "T1": (1, 1, 5, 1, 0.0),
    "T7_dropless": (7, 2, 40, 14, 0.0),
    "T33_padding_rows_and_drops": (33, 3, 130, 120, 0.2),
    "T33_half_dropped": (33, 2, 16, 80, 0.5),
    "all_dropped": (7, 2, 8, 4, 1.0),
}
# Permute kernels use no tl.dot, so the interpreter handles bf16 correctly here.
DTYPES = [torch.float32, torch.bfloat16]


def _dest(num_tokens, top_k, num_rows, drop, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = num_tokens * top_k
    rows = torch.randperm(max(num_rows, slots), generator=gen)[:slots]
    rows[rows >= num_rows] = -1
    rows[torch.rand(slots, generator=gen) < drop] = -1
    return rows.view(num_tokens, top_k).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_permute_matches_reference(backend, dtype, case):
    num_tokens, top_k, d_dim, num_rows, drop = CASES[case]
    _check_permute(backend, dtype, _dest(num_tokens, top_k, num_rows, drop), d_dim, num_rows)


def _check_permute(backend, dtype, dest_TK, d_dim, num_rows):
    x_TD = torch.randn(dest_TK.shape[0], d_dim).to(DEVICE, dtype).requires_grad_()
    out = permute(x_TD, dest_TK, num_rows, backend=backend)
    ref = permute_reference(x_TD, dest_TK, num_rows)
    assert torch.equal(out, ref), "permute is a copy: it must be exact"
    dout = torch.randn_like(ref)
    assert_close(grads(out, [x_TD], dout)[0], grads(ref, [x_TD], dout)[0], "dx")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_unpermute_matches_reference(backend, dtype, case):
    num_tokens, top_k, d_dim, num_rows, drop = CASES[case]
    dest_TK = _dest(num_tokens, top_k, num_rows, drop, seed=1)
    _check_unpermute(backend, dtype, dest_TK, d_dim, num_rows)


def _check_unpermute(backend, dtype, dest_TK, d_dim, num_rows):
    y_ND = torch.randn(num_rows, d_dim).to(DEVICE, dtype).requires_grad_()
    w_TK = torch.rand(*dest_TK.shape).to(DEVICE).requires_grad_()
    out = unpermute(y_ND, dest_TK, w_TK, backend=backend)
    ref = unpermute_reference(y_ND, dest_TK, w_TK)
    assert_close(out, ref, "out")
    dout = torch.randn_like(ref)
    dy, dw = grads(out, [y_ND, w_TK], dout)
    dy_ref, dw_ref = grads(ref, [y_ND, w_TK], dout)
    assert_close(dy, dy_ref, "dy")
    assert_close(dw, dw_ref, "dweights")


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpermute_of_permute_is_weighted_identity(backend):
    """Round trip: unpermute(permute(x)) = x * sum of the kept weights of each token."""
    dest_TK = _dest(33, 3, 99, 0.3)
    x_TD = torch.randn(33, 24, device=DEVICE)
    w_TK = torch.rand(33, 3, device=DEVICE)
    out = unpermute(permute(x_TD, dest_TK, 99, backend=backend), dest_TK, w_TK, backend=backend)
    kept_T = (w_TK * (dest_TK >= 0)).sum(1, keepdim=True)
    assert_close(out, x_TD * kept_T, "round trip")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_permute_large_rows_gpu(backend):
    """Several programs per row on GPU (D above one column block), bf16."""
    dest_TK = _dest(300, 4, 1300, 0.1)
    x_TD = torch.randn(300, 2100, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    out = permute(x_TD, dest_TK, 1300, backend=backend)
    ref = permute_reference(x_TD, dest_TK, 1300)
    assert torch.equal(out, ref)
    w_TK = torch.rand(300, 4, device=DEVICE, requires_grad=True)
    y = unpermute(out, dest_TK, w_TK, backend=backend)
    assert_close(y, unpermute_reference(ref, dest_TK, w_TK), "unpermute")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_gpu_block_sizes_match_reference(dtype, monkeypatch):
    """The block sizes the launchers pick on a GPU (rows 1024 wide, row-dot tiles of 16
    tokens x 512 bf16 / 256 fp32 columns), run under the interpreter, at K=8 and a D that
    is no multiple of them: permute and unpermute, forward and backward."""
    from moetrain.kernels.permutation import triton_backend

    monkeypatch.setattr(triton_backend, "_INTERPRET", False)
    num_tokens, top_k, d_dim, num_rows = 40, 8, 600, 330
    dest_TK = _dest(num_tokens, top_k, num_rows, 0.1, seed=2)
    _check_permute("triton", dtype, dest_TK, d_dim, num_rows)
    _check_unpermute("triton", dtype, dest_TK, d_dim, num_rows)
