"""Triton kernels and their pure-torch references (imported as moetrain.kernels).

Public API (T tokens, D model dim, E experts, K top-k, N permuted rows):

    resolve_backend(name, device) -> "torch" | "triton"
    select_kernels(name, x_TD, experts=, top_k=, ffn=, score_func=) -> backend
        (``moe.kernels: auto``: a per-op KernelChoice from the measured table on CUDA)
    grouped_mm(x_NK, w_EKM, offs_E, backend=...) -> y_NM
    gather_grouped_mm(x_TK, src_N, w_EKM, offs_E, backend=...) -> y_NM
    route(logits_TE, top_k, score_func=..., expert_bias_E=..., renormalize=..., backend=...,
          n_groups=1, topk_groups=1, group_score="top2")
        -> RouteResult(weights_TK, ids_TK, scores_TE, lse_T, counts_E)
    combine_weights(scores_TE, ids_TK, renormalize, score_func) -> weights_TK  (torch)
    permute(x_TD, dest_TK, num_rows, backend=...) -> x_ND
    unpermute(y_ND, dest_TK, weights_TK, backend=...) -> out_TD

FP8 GEMMs (``train.fp8``) live in ``moetrain.kernels.fp8``: ``fp8_linear`` and
``fp8_grouped_mm`` with the quantization recipe and its emulated and ``torch._scaled_mm``
backends (docs/fp8.md).

One stem per op: ``grouped_gemm/``, ``router/``, ``permutation/`` each hold the op's
``reference.py`` (the pure-torch oracle), ``torch_backend.py`` and ``triton_backend.py``
(kernels, launchers, autograd Function); its tests are tests/kernels/test_kernels_<stem>.py
and its benchmark tools/bench_<stem>.py. ``fp8.py`` is one module (torch only). This file
checks the arguments once (``common.py``) and dispatches to a backend.

Every ``backend=`` takes a name ("torch", "triton", "auto") or a ``KernelChoice`` (what
``select_kernels`` gives ``auto`` on CUDA: each op on the implementation measured faster
there, ``kernels/selection.py``).

The Triton modules are imported lazily, so this package imports without triton.
See docs/kernels.md for the exact contracts.
"""

from __future__ import annotations

import functools

import torch
from moetrain.kernels import common
from moetrain.kernels.common import RouteResult, interpreter_enabled
from moetrain.kernels.grouped_gemm import torch_backend as gemm_torch
from moetrain.kernels.permutation import torch_backend as permutation_torch
from moetrain.kernels.router import torch_backend as router_torch
from moetrain.kernels.router.torch_backend import combine_weights
from moetrain.kernels.selection import KernelChoice, backend_of, select_kernels

Backend = str | KernelChoice

BACKENDS = ("auto", "triton", "torch")

__all__ = [
    "BACKENDS",
    "Backend",
    "KernelChoice",
    "RouteResult",
    "combine_weights",
    "gather_grouped_mm",
    "grouped_mm",
    "permute",
    "resolve_backend",
    "route",
    "select_kernels",
    "unpermute",
]


@functools.cache
def _triton_available() -> bool:
    """Whether triton imports (not only whether it is on the path: a broken installation
    counts as missing). Triton is an optional dependency: moetrain's ``[gpu]`` and ``[test]``
    extras install it; without it the torch backend runs everything."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


MISSING_TRITON = (
    "kernel backend 'triton' requested but triton is not installed (it is optional: "
    "pip install triton, or moetrain's extra: pip install -e '.[gpu]'); the 'torch' and "
    "'auto' backends run without it"
)


def resolve_backend(name: str, device: torch.device | str) -> str:
    """Map a configured backend name to the one that will run on `device`.

    "auto" picks "triton" on CUDA when triton is importable, else "torch" (the default an
    MoE layer's ``select_kernels`` refines per op from measurements). "triton" off CUDA is
    only possible under the Triton CPU interpreter (TRITON_INTERPRET=1).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; allowed values: {', '.join(BACKENDS)}")
    device = torch.device(device)
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if not _triton_available():
        raise RuntimeError(MISSING_TRITON)
    if device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            f"kernel backend 'triton' on device {device} needs the Triton CPU interpreter: "
            "set TRITON_INTERPRET=1 before importing moetrain.kernels, or use backend "
            "'torch' / 'auto'"
        )
    return "triton"


def grouped_mm(
    x_NK: torch.Tensor, w_EKM: torch.Tensor, offs_E: torch.Tensor, *, backend: Backend = "torch"
) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e], rows of e = [offs[e-1], offs[e]); rows past
    offs[-1] are zero. offs: int32 cumulative end offsets. Differentiable in x and w.
    A KernelChoice may put the forward, dgrad and wgrad on different implementations."""
    common.check_grouped_mm("grouped_mm", x_NK, w_EKM, offs_E)
    if isinstance(backend, KernelChoice):
        from moetrain.kernels.grouped_gemm.mixed import MixedGroupedMMFunction

        parts = tuple(
            resolve_backend(backend.backend(op, x_NK.dtype), x_NK.device)
            for op in ("fwd", "dgrad", "wgrad")
        )
        if len(set(parts)) > 1:
            return MixedGroupedMMFunction.apply(x_NK, w_EKM, offs_E, parts)
        backend = parts[0]
    if resolve_backend(backend, x_NK.device) == "triton":
        from moetrain.kernels.grouped_gemm import triton_backend

        return triton_backend.grouped_mm_triton(x_NK, w_EKM, offs_E)
    return gemm_torch.grouped_mm_torch(x_NK, w_EKM, offs_E)


def gather_grouped_mm(
    x_TK: torch.Tensor,
    src_N: torch.Tensor,
    w_EKM: torch.Tensor,
    offs_E: torch.Tensor,
    *,
    backend: Backend = "torch",
) -> torch.Tensor:
    """y[n] = x[src[n]] @ w[group(n)]; src int64, -1 = padding row (zero output).
    The triton backend never materialises x[src]. Differentiable in x and w."""
    common.check_grouped_mm("gather_grouped_mm", x_TK, w_EKM, offs_E)
    common.check_gather("gather_grouped_mm", x_TK, src_N)
    if resolve_backend(backend_of(backend, "gather", x_TK), x_TK.device) == "triton":
        from moetrain.kernels.grouped_gemm import triton_backend

        return triton_backend.gather_grouped_mm_triton(x_TK, src_N, w_EKM, offs_E)
    return gemm_torch.gather_grouped_mm_torch(x_TK, src_N, w_EKM, offs_E)


def route(
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    expert_bias_E: torch.Tensor | None = None,
    renormalize: bool = True,
    backend: Backend = "torch",
    n_groups: int = 1,
    topk_groups: int = 1,
    group_score: str = "top2",
) -> RouteResult:
    """Top-k routing: scores = softmax|sigmoid(logits); ids = topk(scores + bias) (the bias
    steers selection only); weights = scores[ids], renormalised to sum 1 if asked.
    Gradients from weights, scores and lse flow back to the logits.

    Group-limited routing (``n_groups > 1``, DeepSeek-V3): the E experts form ``n_groups``
    equal groups, each scored by the sum of its two highest biased scores (``group_score``
    "top2"; "max": its highest, DeepSeek-V2); a token selects among the experts of its
    ``topk_groups`` best groups only. The Triton router does not
    implement it and refuses (route such layers with backend "torch")."""
    common.check_route("route", logits_TE, top_k, score_func, expert_bias_E)
    common.check_groups("route", logits_TE.shape[1], top_k, n_groups, topk_groups, group_score)
    if resolve_backend(backend_of(backend, "route", logits_TE), logits_TE.device) == "triton":
        if n_groups > 1:
            raise ValueError(
                "route: group-limited routing (n_groups > 1) has no Triton kernel; "
                "use backend='torch' for the routing step"
            )
        from moetrain.kernels.router import triton_backend

        return triton_backend.route_triton(logits_TE, top_k, score_func, expert_bias_E, renormalize)
    return router_torch.route_torch(
        logits_TE, top_k, score_func, expert_bias_E, renormalize, n_groups, topk_groups,
        group_score,
    )


def permute(
    x_TD: torch.Tensor, dest_TK: torch.Tensor, num_rows: int, *, backend: Backend = "torch"
) -> torch.Tensor:
    """out = zeros(num_rows, D); out[dest[t, k]] = x[t] for dest >= 0 (-1 = dropped).
    Each row is written at most once. Backward sums the copies of each token."""
    common.check_permute("permute", x_TD, dest_TK, num_rows)
    if resolve_backend(backend_of(backend, "permute", x_TD), x_TD.device) == "triton":
        from moetrain.kernels.permutation import triton_backend

        return triton_backend.permute_triton(x_TD, dest_TK, num_rows)
    return permutation_torch.permute_torch(x_TD, dest_TK, num_rows)


def unpermute(
    y_ND: torch.Tensor,
    dest_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    *,
    backend: Backend = "torch",
) -> torch.Tensor:
    """out[t] = sum_{k: dest >= 0} weights[t, k] * y[dest[t, k]], fp32 accumulation, y's
    dtype out. Differentiable in y and weights."""
    common.check_unpermute("unpermute", y_ND, dest_TK, weights_TK)
    if resolve_backend(backend_of(backend, "unpermute", y_ND), y_ND.device) == "triton":
        from moetrain.kernels.permutation import triton_backend

        return triton_backend.unpermute_triton(y_ND, dest_TK, weights_TK)
    return permutation_torch.unpermute_torch(y_ND, dest_TK, weights_TK)
