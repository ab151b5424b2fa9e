"""What a step computes, counted at torch's dispatcher: matmul FLOPs by dtype, host syncs,
dtype casts, and the bytes norms read.

A layout oracle compares layouts with one process; it cannot see a bug the one process
shares (the routed experts ran in fp32 under bf16 autocast everywhere, and only a GPU showed
it). ``StepCensus`` looks at the step itself: it is a ``TorchDispatchMode`` that sits below
autocast and autograd, so it sees the operands each matmul really receives, forward and
backward, the casts autocast and the model make, and every op that needs the host to read a
device value. It runs on real tensors (CPU tests) and on meta tensors (the planner).

    with StepCensus() as census:
        loss = model(x).sum()
        loss.backward()
    census.matmul_flops        # {("mm", torch.bfloat16): 1.2e9, ("_grouped_mm", ...): ...}
    census.flops_by_dtype()    # {torch.bfloat16: ..., torch.float32: ...}
    census.syncs               # {"_local_scalar_dense": 3, "nonzero": 1}
    census.cast_elements       # {(torch.float32, torch.bfloat16): 4.1e6, ...}

What counts:

- **matmuls**: ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``dot``, ``_grouped_mm`` (both
  its 2-D x 3-D and 2-D x 2-D forms), ``_scaled_mm`` / ``_scaled_grouped_mm`` (FP8) and the
  fused attention kernels (SDPA's CPU flash kernel, flash, efficient, cuDNN; forward 2
  matmuls, backward 4 (flash) of ``2 B H s L D`` each). The key is (op, the dtype of the
  first matrix operand); ``mismatched`` lists ops whose two matrix operands differ in dtype.
  Composite ops (``linear``, ``matmul``, ``einsum``, SDPA's math path) are counted as the mm /
  bmm they decompose into.
- **host syncs**: ops whose result the host must read before it can go on: ``.item()`` /
  ``bool(t)`` (``_local_scalar_dense``, ``is_nonzero``), ``.tolist()`` / ``.numpy()`` /
  ``.cpu()`` (seen at the Python level: on a CPU tensor they run no aten op), and ops whose
  output shape depends on tensor values (``nonzero``, ``masked_select``, ``unique``,
  ``repeat_interleave`` without ``output_size``, ``bincount``, boolean-mask indexing). On
  CPU they cost nothing; on a GPU each one stalls the launch queue.
- **casts**: ``_to_copy`` and ``copy_`` between floating dtypes, in elements per (from, to).
- **norm reads**: bytes read by ``linalg_vector_norm``, ``norm`` and ``_foreach_norm``.

Options, for tests that look closer:

- ``params`` (a module, or (name, tensor) pairs): ``weight_casts[(name, from, to)]`` counts
  the casts whose source is that parameter's storage (a DTensor's local shard, a view: the
  same storage) -- how often each weight is rounded to the compute dtype.
- ``contracts=True``: every ``_grouped_mm`` is replayed on meta tensors of the same shapes,
  strides and dtypes through torch's meta kernel, which checks what the CUDA kernel
  accepts (bf16 operands, 16-byte aligned strides, ...); ``contract_checks`` counts the
  replays, ``contract_failures`` holds (op, message) of those CUDA would refuse. So a CPU
  run proves CUDA eligibility (all but the base pointers' alignment, which the kernels'
  own ``_aligned`` checks at run time).
- ``triton=True``: the Triton grouped GEMM's launches
  (``moetrain.kernels.grouped_gemm.triton_backend``: forward, dgrad, wgrad), which run no
  aten op, are counted like matmuls, keyed ``("triton_grouped_mm", dtype)`` and
  ``("triton_grouped_wgrad", dtype)`` by the dtype of the operands they are handed.
- ``host_tensors``: tensors that stay on the host on every device (the step counts torch's
  AdamW keeps on the CPU unless fused or capturable): reading them is no sync, and is left
  out of ``syncs``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Ops whose output size depends on values, so that the host must wait for the device.
_SYNC_OPS = {
    "_local_scalar_dense",
    "is_nonzero",
    "nonzero",
    "nonzero_static",  # listed for completeness: it does NOT sync; filtered below
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "bincount",
    "equal",
}
_SYNC_OPS.discard("nonzero_static")

_NORM_OPS = {"linalg_vector_norm", "norm", "_foreach_norm", "frobenius_norm"}


def _numel(shape: Any) -> int:
    return math.prod(int(s) for s in shape)


def _mm(a: torch.Tensor, b: torch.Tensor) -> int:
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _bmm(a: torch.Tensor, b: torch.Tensor) -> int:
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def _grouped(a: torch.Tensor, b: torch.Tensor) -> int:
    """``_grouped_mm`` / ``_scaled_grouped_mm``: (N, K) x (E, K, M) -> every row through one
    expert's weight; (K, N) x (N, M) -> E (K, M) blocks, each over its own rows (the weight
    gradient form: the rows partition N, so the total is K N M); 3-D x 3-D -> batched."""
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 3 and b.dim() == 2:  # (E, N, K) x (K, M) is not a form torch has; be safe
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[1]
    return _bmm(a, b)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, matmuls: int) -> int:
    """Fused attention over (B, H, s, D) queries and (B, H, L, D) keys: ``matmuls`` products
    of 2 B H s L D each (forward: QK^T and PV; backward: 4 with flash's recompute folded)."""
    B, H, s, D = q.shape
    L, Dv = k.shape[-2], v.shape[-1]
    return matmuls * B * H * s * L * (D + Dv)


# op name -> (FLOPs from the args, index of the two matrix operands whose dtypes are compared)
_MATMULS: dict[str, tuple[Callable[..., int], tuple[int, int]]] = {
    "mm": (lambda a: _mm(a[0], a[1]), (0, 1)),
    "addmm": (lambda a: _mm(a[1], a[2]), (1, 2)),
    "bmm": (lambda a: _bmm(a[0], a[1]), (0, 1)),
    "baddbmm": (lambda a: _bmm(a[1], a[2]), (1, 2)),
    "mv": (lambda a: 2 * a[0].shape[0] * a[0].shape[1], (0, 1)),
    "dot": (lambda a: 2 * a[0].shape[0], (0, 1)),
    "_grouped_mm": (lambda a: _grouped(a[0], a[1]), (0, 1)),
    "_scaled_mm": (lambda a: _mm(a[0], a[1]), (0, 1)),
    "_scaled_grouped_mm": (lambda a: _grouped(a[0], a[1]), (0, 1)),
    "_scaled_dot_product_flash_attention_for_cpu": (lambda a: _attention(*a[:3], 1), (0, 1)),
    "_scaled_dot_product_flash_attention": (lambda a: _attention(*a[:3], 1), (0, 1)),
    "_scaled_dot_product_efficient_attention": (lambda a: _attention(*a[:3], 1), (0, 1)),
    "_scaled_dot_product_cudnn_attention": (lambda a: _attention(*a[:3], 1), (0, 1)),
    # backward: (grad_out, q, k, v, ...): dQ, dK, dV and the recomputed scores -> 2x forward
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        lambda a: _attention(*a[1:4], 2), (1, 2)),
    "_scaled_dot_product_flash_attention_backward": (lambda a: _attention(*a[1:4], 2), (1, 2)),
    "_scaled_dot_product_efficient_attention_backward": (
        lambda a: _attention(*a[1:4], 2), (1, 2)),
    "_scaled_dot_product_cudnn_attention_backward": (lambda a: _attention(*a[1:4], 2), (1, 2)),
}  # fmt: skip


def _name(func: Any) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


# Tensor methods that read a tensor's values on the host without an aten op on a CPU tensor
# (on a GPU tensor they copy it to the host first, and wait for it).
_HOST_READS = {"tolist", "numpy", "__array__", "cpu"}


class _HostReads(TorchFunctionMode):
    """Counts ``Tensor.tolist()`` and ``.numpy()``: on a CPU tensor they read memory directly,
    so the dispatcher never sees them; on a GPU tensor each is a device-to-host copy and a
    wait."""

    def __init__(self, syncs: Counter[str], host: set[int]) -> None:
        super().__init__()
        self.syncs = syncs
        self.host = host

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = getattr(func, "__name__", "")
        if (
            name in _HOST_READS
            and args
            and isinstance(args[0], torch.Tensor)
            and id(args[0]) not in self.host
        ):
            self.syncs[name] += 1
        return func(*args, **(kwargs or {}))


def _storage(t: torch.Tensor) -> int | None:
    """The data pointer of the storage under ``t`` (a DTensor's local shard's); None for
    tensors without one (meta, fake)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    try:
        ptr = local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


# op name -> replay on meta tensors (raises what the CUDA kernel would refuse)
_CONTRACTS: dict[str, Callable[[tuple, dict], Any]] = {
    "_grouped_mm": lambda a, kw: aten._grouped_mm(
        *(_meta_like(t) if isinstance(t, torch.Tensor) else t for t in a),
        **{k: _meta_like(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()},
    ),
}


class _TritonLaunches:
    """Counts the Triton grouped GEMM's launches as matmuls (they run no aten op) by
    wrapping ``moetrain.kernels.grouped_gemm.triton_backend``'s launchers while the census is
    open; nothing when triton does not import."""

    def __init__(self, census: StepCensus) -> None:
        self.census = census
        self.saved: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> None:
        try:
            from moetrain.kernels.grouped_gemm import triton_backend
        except ImportError:
            return
        self.module = triton_backend
        c = self.census
        fwd, wgrad = triton_backend.launch_grouped_mm, triton_backend.launch_grouped_wgrad
        self.saved = {"launch_grouped_mm": fwd, "launch_grouped_wgrad": wgrad}

        def launch_grouped_mm(x, src_N, w_EKM, offs_E, num_rows, *args, **kwargs):
            flops = 2 * num_rows * x.shape[1] * w_EKM.shape[2]
            c._count("triton_grouped_mm", x, w_EKM, flops, (x, w_EKM))
            return fwd(x, src_N, w_EKM, offs_E, num_rows, *args, **kwargs)

        def launch_grouped_wgrad(x, src_N, dy_NM, offs_E, *args, **kwargs):
            flops = 2 * dy_NM.shape[0] * x.shape[1] * dy_NM.shape[1]
            c._count("triton_grouped_wgrad", x, dy_NM, flops, (x, dy_NM))
            return wgrad(x, src_N, dy_NM, offs_E, *args, **kwargs)

        triton_backend.launch_grouped_mm = launch_grouped_mm
        triton_backend.launch_grouped_wgrad = launch_grouped_wgrad

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self.saved.items():
            setattr(self.module, name, fn)
        self.saved = {}


class StepCensus(TorchDispatchMode):
    """Counts matmul FLOPs by (op, dtype), host syncs, casts and norm reads of whatever runs
    inside it (see the module docstring). Re-entrant counts add up: enter it around one step
    (forward, backward and optimizer) to census that step. ``params``, ``contracts``,
    ``triton`` and ``host_tensors``: the options of the module docstring."""

    def __init__(
        self,
        params: torch.nn.Module | Iterable[tuple[str, torch.Tensor]] | None = None,
        contracts: bool = False,
        triton: bool = False,
        host_tensors: Iterable[torch.Tensor] = (),
    ) -> None:
        super().__init__()
        self._host = {id(t) for t in host_tensors}
        named = params.named_parameters() if isinstance(params, torch.nn.Module) else params
        self._param_names: dict[int, str] = {}
        for name, p in named or ():
            ptr = _storage(p)
            if ptr is not None:
                self._param_names.setdefault(ptr, name)
        self.weight_casts: Counter[tuple[str, torch.dtype, torch.dtype]] = Counter()
        """(parameter name, from, to): casts of that parameter's storage (``params``)."""
        self.contracts = contracts
        self.contract_checks: Counter[str] = Counter()
        self.contract_failures: list[tuple[str, str]] = []
        """(op, torch's message) of every call CUDA's kernel would refuse (``contracts``)."""
        self._triton = _TritonLaunches(self) if triton else None
        self.matmul_flops: Counter[tuple[str, torch.dtype]] = Counter()
        self.matmul_calls: Counter[tuple[str, torch.dtype]] = Counter()
        self.mismatched: Counter[tuple[str, torch.dtype, torch.dtype]] = Counter()
        self.syncs: Counter[str] = Counter()
        self.cast_elements: Counter[tuple[torch.dtype, torch.dtype]] = Counter()
        self.norm_bytes: Counter[torch.dtype] = Counter()
        self.operands: list[tuple[str, tuple[torch.dtype, ...], tuple[tuple[int, ...], ...]]] = []
        """(op, operand dtypes, operand shapes) of every matmul, in call order."""
        self._host_reads = _HostReads(self.syncs, self._host)

    def __enter__(self) -> StepCensus:
        if self._triton is not None:
            self._triton.__enter__()
        self._host_reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._host_reads.__exit__(*exc)
            if self._triton is not None:
                self._triton.__exit__(*exc)

    # ------------------------------------------------------------------ the dispatcher hook

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = _name(func)
        if name in _MATMULS:
            self._matmul(name, args)
            if self.contracts and name in _CONTRACTS:
                self._check_contract(name, args, kwargs)
        elif name in _SYNC_OPS or self._value_shaped(name, args, kwargs):
            if not (args and id(args[0]) in self._host):
                self.syncs[name] += 1
        elif name in ("_to_copy", "to", "_to_copy_"):
            self._cast(args[0], kwargs.get("dtype"))
        elif name == "copy_":
            self._cast(args[1], args[0].dtype)
        elif name in _NORM_OPS:
            for t in tree_flatten(args[0])[0]:
                if isinstance(t, torch.Tensor):
                    self.norm_bytes[t.dtype] += t.numel() * t.element_size()
        elif name == "_foreach_copy_":
            for dst, src in zip(args[0], args[1], strict=True):
                self._cast(src, dst.dtype)
        return func(*args, **kwargs)

    def _matmul(self, name: str, args: tuple) -> None:
        flops, (i, j) = _MATMULS[name]
        tensors = [t for t in args if isinstance(t, torch.Tensor)]
        self._count(name, args[i], args[j], flops(args), tensors)

    def _count(self, name: str, a: torch.Tensor, b: torch.Tensor, flops: int, tensors) -> None:
        self.matmul_flops[(name, a.dtype)] += flops
        self.matmul_calls[(name, a.dtype)] += 1
        if a.dtype != b.dtype and not name.startswith("_scaled"):
            self.mismatched[(name, a.dtype, b.dtype)] += 1
        self.operands.append(
            (name, tuple(t.dtype for t in tensors), tuple(tuple(t.shape) for t in tensors))
        )

    def _check_contract(self, name: str, args: tuple, kwargs: dict) -> None:
        self.contract_checks[name] += 1
        try:
            _CONTRACTS[name](args, kwargs)
        except RuntimeError as e:
            self.contract_failures.append((name, str(e).splitlines()[0]))

    @staticmethod
    def _value_shaped(name: str, args: tuple, kwargs: dict) -> bool:
        """Ops that sync only in some forms: ``repeat_interleave`` with tensor repeats and no
        ``output_size``; indexing with a boolean mask (its output size is the mask's count)."""
        if name == "repeat_interleave":
            return (
                bool(args)
                and isinstance(args[0], torch.Tensor)
                and (len(args) < 2 or isinstance(args[1], torch.Tensor))
                and kwargs.get("output_size") is None
            )
        if name == "index":
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices or ())
        return False

    def _cast(self, src: Any, dtype: torch.dtype | None) -> None:
        if not isinstance(src, torch.Tensor) or dtype is None or dtype == src.dtype:
            return
        if src.is_floating_point() and dtype.is_floating_point:
            self.cast_elements[(src.dtype, dtype)] += src.numel()
            if self._param_names:
                name = self._param_names.get(_storage(src) or 0)
                if name is not None:
                    self.weight_casts[(name, src.dtype, dtype)] += 1

    # ---------------------------------------------------------------------------- summaries

    def flops_by_dtype(self) -> dict[torch.dtype, int]:
        out: Counter[torch.dtype] = Counter()
        for (_, dtype), f in self.matmul_flops.items():
            out[dtype] += f
        return dict(out)

    def total_flops(self) -> int:
        return sum(self.matmul_flops.values())

    def sync_count(self) -> int:
        return sum(self.syncs.values())

    def cast_bytes(self) -> int:
        """Bytes a cast moves: read at the source dtype plus written at the target's."""
        size = lambda d: torch.empty((), dtype=d).element_size()  # noqa: E731
        return sum(n * (size(a) + size(b)) for (a, b), n in self.cast_elements.items())

    def report(self) -> str:
        """A few lines for a failing test or a log."""
        total = self.total_flops() or 1
        lines = ["matmul FLOPs by (op, dtype):"]
        for (op, dt), f in sorted(self.matmul_flops.items(), key=lambda kv: -kv[1]):
            calls = self.matmul_calls[(op, dt)]
            lines.append(f"  {op:<50} {str(dt):<15} {f:>14,} ({f / total:6.1%}, {calls} calls)")
        if self.mismatched:
            lines.append(f"operands of two dtypes: {dict(self.mismatched)}")
        lines.append(f"host syncs: {self.sync_count()} {dict(self.syncs)}")
        casts = {f"{a} -> {b}": n for (a, b), n in self.cast_elements.items()}
        lines.append(f"cast elements: {casts}")
        if self.norm_bytes:
            lines.append(f"norm reads (bytes): { {str(k): v for k, v in self.norm_bytes.items()} }")
        if self.contract_checks:
            lines.append(
                f"CUDA contracts: {dict(self.contract_checks)} checked, "
                f"{len(self.contract_failures)} refused {self.contract_failures[:3]}"
            )
        return "\n".join(lines)
