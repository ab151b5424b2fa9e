"""resolve_backend, the argument checks every backend shares, and the package's layout: one
stem per op (docs/kernels.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_testing import BACKENDS, DEVICE, HAS_CUDA, offsets
from moetrain.kernels import (
    gather_grouped_mm,
    grouped_mm,
    permute,
    resolve_backend,
    route,
    unpermute,
)

from moetrain import kernels


def test_resolve_backend_names():
    assert resolve_backend("torch", torch.device("cpu")) == "torch"
    assert resolve_backend("torch", "cuda") == "torch"
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    # "auto" on CUDA picks triton whenever triton imports (it does in this environment).
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="allowed values: auto, triton, torch"):
        resolve_backend("cutlass", torch.device("cpu"))


@pytest.mark.skipif(HAS_CUDA, reason="exercises the CPU interpreter switch")
def test_resolve_backend_triton_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", torch.device("cpu")) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        grouped_mm(torch.randn(2, 4), torch.randn(1, 4, 4), offsets([2]), backend="triton")


def _gmm_args():
    return torch.randn(6, 16, device=DEVICE), torch.randn(2, 16, 8, device=DEVICE), offsets([2, 6])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda x, w, o: (x, w, o.long()), "offs must be int32"),
        (lambda x, w, o: (x[None], w, o), "x must be 2-D"),
        (lambda x, w, o: (x, w[0], o), "w must be 3-D"),
        (lambda x, w, o: (x[:, :15], w, o), "K=15 columns but w has K=16"),
        (lambda x, w, o: (x, w, o[:1]), "one end offset per expert"),
        (lambda x, w, o: (x.double(), w.double(), o), "float32, bfloat16 or float16"),
        (lambda x, w, o: (x.bfloat16(), w, o), "must share a dtype"),
    ],
    ids=["offs-int64", "x-3d", "w-2d", "K-mismatch", "offs-length", "fp64", "mixed-dtype"],
)
def test_grouped_mm_bad_args(backend, mutate, match):
    with pytest.raises(ValueError, match=match):
        grouped_mm(*mutate(*_gmm_args()), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_grouped_mm_bad_src(backend):
    x, w, o = _gmm_args()
    with pytest.raises(ValueError, match="src must be int64"):
        gather_grouped_mm(x, torch.zeros(6, dtype=torch.int32, device=DEVICE), w, o,
                          backend=backend)  # fmt: skip
    with pytest.raises(ValueError, match="src must be 1-D"):
        gather_grouped_mm(x, torch.zeros(6, 1, dtype=torch.int64, device=DEVICE), w, o,
                          backend=backend)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_route_bad_args(backend):
    logits = torch.randn(4, 6, device=DEVICE)
    with pytest.raises(ValueError, match="logits must be float32"):
        route(logits.bfloat16(), 2, backend=backend)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, E=6\]"):
        route(logits, 7, backend=backend)
    with pytest.raises(ValueError, match="score_func must be 'softmax' or 'sigmoid'"):
        route(logits, 2, score_func="relu", backend=backend)
    with pytest.raises(ValueError, match=r"expert_bias must have shape \(6,\)"):
        route(logits, 2, expert_bias_E=torch.zeros(5, device=DEVICE), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_permute_bad_args(backend):
    x = torch.randn(4, 8, device=DEVICE)
    dest = torch.arange(8, device=DEVICE).view(4, 2)
    with pytest.raises(ValueError, match="dest must be int64"):
        permute(x, dest.int(), 8, backend=backend)
    with pytest.raises(ValueError, match=r"dest must be 2-D \(T=4, K\)"):
        permute(x, dest.view(2, 4), 8, backend=backend)
    with pytest.raises(ValueError, match="weights .* and dest .* must have the same shape"):
        unpermute(x, dest, torch.ones(4, 3, device=DEVICE), backend=backend)
    with pytest.raises(ValueError, match="y must be 2-D"):
        unpermute(x[None], dest, torch.ones(4, 2, device=DEVICE), backend=backend)


def test_public_api_surface():
    assert set(kernels.__all__) >= {
        "resolve_backend", "grouped_mm", "gather_grouped_mm", "route", "permute", "unpermute",
        "RouteResult",
    }  # fmt: skip
    assert kernels.RouteResult._fields == ("weights_TK", "ids_TK", "scores_TE", "lse_T",
                                           "counts_E")  # fmt: skip


REPO = Path(__file__).resolve().parents[2]
STEM_FILES = ("reference.py", "torch_backend.py", "triton_backend.py")
"""What every op package under kernels/ holds: its oracle and its two backends."""


def stem_problems(repo: Path) -> list[str]:
    """What breaks docs/kernels.md's "one stem per op" in ``repo``: every package under
    kernels/ (an op's stem) holds STEM_FILES and has tests/kernels/test_kernels_<stem>.py
    and tools/bench_<stem>.py; a stem named like a public function of the package would
    replace that function with the module when imported."""
    out = []
    for init in sorted((repo / "kernels").glob("*/__init__.py")):
        stem = init.parent.name
        wanted = [f"kernels/{stem}/{name}" for name in STEM_FILES]
        wanted += [f"tests/kernels/test_kernels_{stem}.py", f"tools/bench_{stem}.py"]
        out += [f"{stem}: no {path}" for path in wanted if not (repo / path).is_file()]
        if stem in kernels.__all__:
            out.append(f"{stem}: shadows moetrain.kernels.{stem}")
    return out


def test_every_op_has_its_stem():
    stems = {p.parent.name for p in (REPO / "kernels").glob("*/__init__.py")}
    assert stems == {"grouped_gemm", "permutation", "router"}
    assert stem_problems(REPO) == []


def test_the_stem_check_can_fail(tmp_path):
    for path in ("kernels/router/__init__.py", "kernels/router/reference.py",
                 "kernels/router/torch_backend.py", "tools/bench_router.py",
                 "kernels/route/__init__.py"):  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    assert stem_problems(tmp_path) == [
        "route: no kernels/route/reference.py",
        "route: no kernels/route/torch_backend.py",
        "route: no kernels/route/triton_backend.py",
        "route: no tests/kernels/test_kernels_route.py",
        "route: no tools/bench_route.py",
        "route: shadows moetrain.kernels.route",
        "router: no kernels/router/triton_backend.py",
        "router: no tests/kernels/test_kernels_router.py",
    ]


def test_bin_counts_and_sorted_bin_ends_are_bincount_without_its_sync():
    """The sync-free counts equal torch.bincount (weighted by a mask too), and the ends of
    sorted ids its cumulative sum; empty bins at both ends included."""
    from moetrain.kernels.common import bin_counts, sorted_bin_ends

    ids = torch.tensor([[3, 1], [1, 4], [3, 3], [6, 1]])
    keep = torch.tensor([[True, False], [True, True], [False, True], [True, True]])
    assert bin_counts(ids, 8).tolist() == torch.bincount(ids.flatten(), minlength=8).tolist()
    want = torch.bincount(ids[keep], minlength=8)
    assert bin_counts(ids, 8, keep).tolist() == want.tolist()
    ends = sorted_bin_ends(ids.flatten().sort().values, 8)
    assert ends.tolist() == torch.bincount(ids.flatten(), minlength=8).cumsum(0).tolist()
