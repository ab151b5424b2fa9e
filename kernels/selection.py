"""``moe.kernels: auto``: each MoE op on the implementation measured faster on this GPU.

    select_kernels("auto", x_TD, experts=E, top_k=K, ffn=F, score_func="softmax")
        -> KernelChoice (CUDA, triton importable) | "torch" (anywhere else)
    select_kernels("triton" | "torch", x_TD, ...) -> that name (``resolve_backend``'s checks)

The measurements are ``kernels/measured.py``'s ``CHOICES`` (generated from
docs/data/benchmarks.csv by tools/kernel_table.py): per op, GPU architecture and shape class (an
anchor model of the benchmarks: Mixtral, Qwen3-30B-A3B, DeepSeek-V3), Triton's speed-up
over torch and the implementation picked. A layer takes, per op, the pick of the measured
class nearest to its own shape: the smallest sum of |log(ratio)| over the op's features

    grouped GEMM fwd, dgrad, wgrad   experts, dim, ffn, rows per expert (tokens x K / E)
    router                           experts, tokens (same score function where measured)
    permute, unpermute               dim, top_k, tokens

and only in the dtype the class was measured in (bf16 GEMMs and copies; the router runs in
fp32 always): an op called in another dtype, an op with no row (the gathered GEMM), an
architecture with no row, all take ``DEFAULT`` (Triton on CUDA: what ``auto`` meant before
any measurement). The choice is made once per shape and logged once per distinct choice,
one line per op with the measured speed-up and its rows (``explain``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from moetrain.kernels import measured

log = logging.getLogger("moetrain.kernels")

DEFAULT = "triton"
"""What ``auto`` takes on CUDA for an op, architecture or dtype no row measured."""

# Fields of KernelChoice -> the op names of the measured table.
OPS = {
    "fwd": "grouped_mm_fwd",
    "dgrad": "grouped_mm_dgrad",
    "wgrad": "grouped_mm_wgrad",
    "gather": "gather_grouped_mm",
    "route": "route",
    "permute": "permute",
    "unpermute": "unpermute",
}


class MoEShape(NamedTuple):
    """What the MoE layer knows of its shape at a call (T tokens of this rank)."""

    tokens: int
    dim: int
    ffn: int
    experts: int
    top_k: int
    score_func: str = "softmax"

    def features(self, op: str) -> dict[str, float]:
        if op.startswith("grouped_mm") or op == "gather_grouped_mm":
            rows = max(self.tokens * self.top_k / max(self.experts, 1), 1.0)
            return {"experts": self.experts, "dim": self.dim, "ffn": self.ffn,
                    "rows_per_expert": rows}  # fmt: skip
        if op == "route":
            return {"experts": self.experts, "tokens": self.tokens}
        return {"dim": self.dim, "top_k": self.top_k, "tokens": self.tokens}


@dataclass(frozen=True)
class OpChoice:
    """One op's implementation, the dtype its measurement holds for (None: any, the
    default) and why (a log line)."""

    backend: str
    dtype: str | None = None
    why: str = field(default="", compare=False)


@dataclass(frozen=True)
class KernelChoice:
    """Per-op implementations of ``moe.kernels: auto`` (the ``backend=`` the kernels take).
    ``default`` serves an op called in a dtype other than the one it was measured in."""

    arch: str
    default: str
    fwd: OpChoice
    dgrad: OpChoice
    wgrad: OpChoice
    gather: OpChoice
    route: OpChoice
    permute: OpChoice
    unpermute: OpChoice

    def backend(self, op: str, dtype: torch.dtype) -> str:
        """The implementation of ``op`` (a field name) for operands of ``dtype``."""
        c: OpChoice = getattr(self, op)
        if c.dtype is not None and str(dtype).removeprefix("torch.") != c.dtype:
            return self.default
        return c.backend

    def explain(self) -> list[str]:
        """One line per op: what it takes and why."""
        return [f"{op}: {getattr(self, op).why}" for op in OPS]


def arch_of(device: torch.device) -> str:
    """A CUDA device's architecture as the measured table names it ("sm_90")."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _distance(a: dict[str, float], b: dict[str, float]) -> float:
    return sum(abs(math.log(max(a[k], 1e-9) / max(b[k], 1e-9))) for k in a)


def _features_text(f: dict[str, float]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in f.items())


def _op_choice(table_op: str, arch: str, shape: MoEShape, table: list[dict]) -> OpChoice:
    cases = [c for c in table if c["op"] == table_op and c["arch"] == arch]
    if table_op == "route":  # the same score function, where one was measured
        same = [c for c in cases if c["score_func"] == shape.score_func]
        cases = same or cases
    if not cases:
        return OpChoice(DEFAULT, None, f"{DEFAULT} (default: no measurement of {table_op} on "
                                       f"{arch} in kernels/measured.py)")  # fmt: skip
    mine = shape.features(table_op)
    best = min(cases, key=lambda c: _distance(mine, c["features"]))
    peer = "torch._grouped_mm" if table_op.startswith("grouped_mm") else "torch"
    why = (f"{best['pick']} in {best['dtype']}: Triton {best['speedup']:.2f}x {peer} on the "
           f"{best['case']} class ({_features_text(best['features'])}; this layer: "
           f"{_features_text(mine)}); {best['rows']}")  # fmt: skip
    return OpChoice(best["pick"], best["dtype"], why)


def choose(arch: str, shape: MoEShape, table: list[dict] | None = None) -> KernelChoice:
    """``auto``'s per-op choice on a GPU of ``arch`` for a layer of ``shape``, from ``table``
    (default: the measured ``CHOICES``). Pure: no device is touched."""
    table = measured.CHOICES if table is None else table
    ops = {name: _op_choice(op, arch, shape, table) for name, op in OPS.items()}
    return KernelChoice(arch=arch, default=DEFAULT, **ops)


# Choices made so far, and those already logged (each logged once).
_MEMO: dict[tuple, KernelChoice] = {}
_LOGGED: set[tuple[str, KernelChoice]] = set()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the layer's GEMMs are meant to run in: autocast's where it is on."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def select_kernels(
    name: str,
    x_TD: torch.Tensor,
    *,
    experts: int,
    top_k: int,
    ffn: int,
    score_func: str = "softmax",
) -> str | KernelChoice:
    """The ``backend=`` of an MoE layer's kernel calls for ``moe.kernels = name`` and the
    layer's input ``x_TD`` (``choose_kernels`` for its shape and compute dtype)."""
    shape = MoEShape(x_TD.shape[0], x_TD.shape[1], ffn, experts, top_k, score_func)
    return choose_kernels(name, x_TD.device, shape, _compute_dtype(x_TD))


def choose_kernels(
    name: str, device: torch.device, shape: MoEShape, dtype: torch.dtype
) -> str | KernelChoice:
    """A name ("torch", "triton") as ``resolve_backend`` gives it; for "auto" on CUDA with
    triton importable, the measured per-op ``KernelChoice`` of ``shape`` on ``device``'s
    architecture, logged (one line per op) the first time it is made."""
    from moetrain.kernels import _triton_available, resolve_backend

    if name != "auto" or device.type != "cuda" or not _triton_available():
        return resolve_backend(name, device)
    key = (device, shape, dtype)
    choice = _MEMO.get(key)
    if choice is None:
        choice = _MEMO[key] = choose(arch_of(device), shape)
        if (str(device), choice) not in _LOGGED:
            _LOGGED.add((str(device), choice))
            gpu = torch.cuda.get_device_name(device)
            feats = shape.features("grouped_mm_fwd") | {"tokens": shape.tokens}
            log.info("moe.kernels auto on %s (%s, %s): %s", device, gpu, choice.arch,
                     _features_text(feats))  # fmt: skip
            for line in choice.explain():
                log.info("  %s", line)
    return choice


def backend_of(backend: str | KernelChoice, op: str, x: torch.Tensor) -> str:
    """The implementation name an op runs with: ``backend`` itself when it is a name,
    else the choice's entry for ``op`` in ``x``'s dtype."""
    if isinstance(backend, KernelChoice):
        return backend.backend(op, x.dtype)
    return backend


__all__ = [
    "DEFAULT",
    "KernelChoice",
    "MoEShape",
    "OpChoice",
    "backend_of",
    "choose",
    "choose_kernels",
    "select_kernels",
]
