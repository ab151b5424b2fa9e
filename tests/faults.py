"""Realistic bugs that the oracle's own tests plant into moetrain, one at a time.

Each fault changes the code the way a plausible mistake would, and each once slipped past a
check that compared a layout with one process (the single process shared the bug, or the
layout facts read the configuration instead of the run). ``plant(name, setattr)`` installs
one: ``setattr`` is ``pytest``'s ``monkeypatch.setattr`` in the test process (undone after
the test), the builtin in a spawned rank (``Case.fault = ("plant", rank, name)`` in
tests/oracle.py).

- ``per_micro_batch_counts``: the global-batch balancing loss uses each micro-batch's own
  expert counts instead of the step's (in every layout, one process included). Caught by
  the hand computation of tests/train/test_global_aux_loss.py and the golden curves.
- ``breadth_first_ignored``: the engine's loop (outside pipelines) runs every micro-batch's
  backward right after its forward whatever ``parallel.breadth_first_micro_batches`` says;
  the engine's attribute still holds the configured value. Same numbers; caught by the
  observed order of forwards and backwards.
- ``fp8_local_amax``: FP8 scales from each rank's own slice of a tensor -- a tensor-parallel
  weight shard, a row-parallel input split by feature, an expert-TP slice of the FFN width --
  instead of the whole tensor (the single process has no slices). Caught by the first
  forward's logits, token by token (tests/parallel/test_fp8_layouts.py).
- ``cp_forced_to_1``: config validation sets ``parallel.cp`` to 1 (a cp2 job silently
  becomes dp2). Same numbers; caught by the positions and attention shapes each rank
  observed against the raw request.
- ``stage_layers_misassigned``: the pipeline split reads ``parallel.pp_stage_layers`` in
  reverse (the same layers in all, each stage the wrong count of them: 3 + 1 built as
  1 + 3). The model computes the same function, so the numbers equal one process's; caught
  by the layers each rank's chunks hold against the raw request.
- ``embedding_copies_unsynced``: under a pipeline with multi-token prediction, the first
  stage's embedding and the last stage's copy keep the gradients of their own uses (the
  engine never sums them): both copies step, apart. Caught by the embedding's gradient
  (tests/parallel/test_mtp_layouts.py).
- ``init_offsets_forgotten``: the materialisation of a rank's shards draws each shard as if
  it began the full tensor (every offset 0): each rank's rows and columns are the tensor's
  first ones. Rank 0's shards are right; the model is not the single process's. Caught by
  the first loss and gradients (tests/parallel/test_oracle.py) and by the initial state
  compared bit for bit (tests/parallel/test_init_layouts.py).
- ``fsdp_root_in_bf16``: FSDP2 gathers the root unit (token embeddings, final norm, output
  head) in bf16 like the blocks, as ZeRO-2/3 did before the compute-dtype policy
  (``moetrain.model.precision``): the embeddings are rounded and the residual stream of a
  bf16 ZeRO-2/3 run is bf16 where one process's is fp32. Losses 8e-5 apart, first-step
  gradients 1.3e-2 of their scale: inside the bf16 row before the policy (5e-3, 0.05),
  caught by the row of layouts that round as one process does
  (tests/parallel/test_bf16_layouts.py).
- ``expert_layouts_ignored``: the materialisation treats the expert slices of expert
  parallelism as whole tensors (they are plain tensors, not DTensors: where they sit is on
  the EP mesh, ``expert_layouts``): every EP rank draws the blocks of experts 0, 1, ...
  instead of its own. Caught as the one above (tests/parallel/test_oracle.py).
- ``router_gate_in_bf16``: the precision policy without its ``router_gate`` fp32 region
  (``drop_fp32_region``, through the registry ``moetrain.model.precision.FP32_REGIONS``): the
  routers' gates compute under autocast in bf16, in every layout and one process alike.
  Caught by what a bf16 step computes (tests/train/test_compute_dtype.py: bf16 matmul FLOPs
  where the policy names fp32 ones, the gate's weight rounded to bf16) and by the region's
  numbers against an fp32 reference (tests/model/test_precision.py, which drops every region
  in turn).
- ``routed_rows_in_fp32``: the routed tokens are not cast to the compute dtype before the
  dispatch (what the code did before the policy): the experts compute in their rows' dtype,
  fp32, and CUDA's ``torch._grouped_mm`` refuses fp32. Caught by the census's fp32 FLOPs and
  its CUDA-contract replay (tests/train/test_compute_dtype.py).
- ``muon_local_shard``: Muon orthogonalizes each rank's own slice of a sharded matrix (a
  ZeRO-2/3 or HSDP shard, a tensor-parallel column or row block, an expert-TP slice of the
  FFN width) instead of the whole matrix (the single process has no slices), whether every
  holder gathers the matrix or one owner does (``optim.muon_distributed``). Caught by the
  parameters after an optimizer step (tests/parallel/test_muon_layouts.py).
- ``ep_grad_norm_without_experts``: the gradient norm leaves out the expert parameters'
  term under expert parallelism (every binding of ``expert_grad_sq_norm`` in moetrain
  answers 0); the one process, whose experts are plain parameters, keeps it. Clipping then
  scales by a smaller norm. Caught by the norm against one process's and against the norm
  of the gathered gradients (tests/ep/test_ep_grad_norm.py).
- ``muon_plain_momentum``: Muon steps along its momentum buffer (heavy ball) instead of
  Nesterov's look-ahead (``moetrain.train.muon.momentum_update``). The first update is the
  same; caught by the small optimizer sweep's record from its third step
  (tests/train/test_muon.py).
- ``fp8_tensorwise_grads_e4m3``: the tensorwise recipe formats its linears' output
  gradients in e4m3 instead of e5m2 (``moetrain.kernels.fp8.RECIPES``). The forwards are
  the same; caught by the small FP8 sweep's record from its second step
  (tests/train/test_fp8_convergence.py).
- ``grouped_mm_never_native``: the torch backend's grouped GEMMs (forward and input
  gradient ``_gmm``, weight gradient ``_gmm_wgrad``, their source mutated) never take
  ``torch._grouped_mm``, though its eligibility check (``_native_ok``) still says they may:
  the per-expert loop computes the same numbers. Caught by the ``_grouped_mm`` calls
  observed at torch's dispatcher (tests/kernels/test_kernels_grouped_gemm.py).
- ``welch_pooled_df``: Welch's unpaired interval takes the pooled n_a + n_b - 2 degrees of
  freedom instead of Welch-Satterthwaite's (``moetrain.ablation.stats.difference_interval``,
  its source mutated). Caught by the hand computation of tests/tools/test_stats.py.
- ``quantile_counts_averaged``: the step's statistics reduction divides quantile balancing's
  histogram by the data-parallel ranks along with the expert bias beside it (a state, which
  it must average), so the counts are a mean where the target T*K/E counts every rank's
  tokens (``LayerStats.pop``, its source mutated). One process has nothing to average; caught
  by the expert bias and the histogram against one process's
  (tests/parallel/test_quantile_layouts.py, beside the matrix's cells).
- ``qk_clip_local_maxima``: QK-clip rescales from each rank's own attention maxima, the
  all-reduce over the ranks left out (``QKClip.gather``, its source mutated). One process
  sees every token; caught by the maxima and the query and key weights against one
  process's (tests/parallel/test_qk_clip_layouts.py).
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any


def _per_micro_batch_counts(setattr_: Callable[..., None]) -> None:
    from moetrain.model.losses import GlobalBalanceLoss

    # The engine's step-wide counts never reach the layers: each backward falls back to the
    # counts of its own forward (GlobalBalanceLoss.e_times_f).
    setattr_(GlobalBalanceLoss, "set_step_counts", lambda self, counts_E: None)


def _breadth_first_ignored(setattr_: Callable[..., None]) -> None:
    from moetrain.train.engine import Engine

    forward_backward = Engine.forward_backward

    def depth_first(self: Any, *args: Any, **kwargs: Any) -> float:
        if self.schedule is not None:
            return forward_backward(self, *args, **kwargs)
        configured, self.breadth = self.breadth, 1  # the loop's pass size, not the attribute
        try:
            return forward_backward(self, *args, **kwargs)
        finally:
            self.breadth = configured

    setattr_(Engine, "forward_backward", depth_first)


def _cp_forced_to_1(setattr_: Callable[..., None]) -> None:
    from moetrain.config import ParallelConfig

    validate = ParallelConfig.validate

    def forced(self: Any) -> None:
        validate(self)
        self.cp = 1

    setattr_(ParallelConfig, "validate", forced)


def _embedding_copies_unsynced(setattr_: Callable[..., None]) -> None:
    from moetrain.train.engine import Engine

    setattr_(Engine, "_sync_embedding_copies", lambda self: None)


def _fp8_local_amax(setattr_: Callable[..., None]) -> None:
    from moetrain.kernels import fp8
    from torch.distributed.tensor import DTensor, Replicate

    whole = fp8.amax

    def local(x: Any, dims: Any, reduce: Any = None) -> Any:
        # Each rank's own slice: the amax of a DTensor's local shard, with the placements the
        # whole-tensor amax has (so the rest of the cast runs), and no reduction over the
        # expert-TP ranks.
        if not isinstance(x, DTensor):
            return whole(x, dims)
        right = whole(x, dims)
        right = right.redistribute(
            right.device_mesh, [Replicate() if p.is_partial() else p for p in right.placements]
        )
        mine = whole(x.to_local(), dims)
        return DTensor.from_local(mine, right.device_mesh, right.placements, run_check=False,
                                  shape=right.shape, stride=right.stride())  # fmt: skip

    setattr_(fp8, "amax", local)


def _init_offsets_forgotten(setattr_: Callable[..., None]) -> None:
    from moetrain.parallel import materialize

    real = materialize.local_slice

    def from_the_start(name: str, p: Any, layouts: Any = None) -> Any:
        local, shape, offsets = real(name, p, layouts)
        return local, shape, (0,) * len(offsets)

    setattr_(materialize, "local_slice", from_the_start)


def _expert_layouts_ignored(setattr_: Callable[..., None]) -> None:
    from moetrain.parallel import materialize

    real = materialize.local_slice
    setattr_(materialize, "local_slice", lambda name, p, layouts=None: real(name, p, None))


def _stage_layers_misassigned(setattr_: Callable[..., None]) -> None:
    from moetrain.parallel import pipeline

    counts = pipeline.stage_layer_counts

    def reversed_counts(n_layers: int, num_stages: int, explicit: Any = None) -> list[int]:
        return counts(n_layers, num_stages, explicit)[::-1]

    setattr_(pipeline, "stage_layer_counts", reversed_counts)


def _fsdp_root_in_bf16(setattr_: Callable[..., None]) -> None:
    import dataclasses

    import torch
    import torch.distributed.fsdp as fsdp

    real = fsdp.fully_shard

    def fully_shard(module: Any, **kwargs: Any) -> Any:
        mp = kwargs.get("mp_policy")
        if hasattr(module, "tok_embeddings") and mp is not None and mp.param_dtype is not None:
            kwargs["mp_policy"] = dataclasses.replace(mp, param_dtype=torch.bfloat16)
        return real(module, **kwargs)

    # apply_fsdp imports fully_shard when it runs: the module attribute is what it finds.
    setattr_(fsdp, "fully_shard", fully_shard)


def drop_fp32_region(name: str, setattr_: Callable[..., None]) -> None:
    """The precision policy without the fp32 region ``name``: its ops compute in the compute
    dtype (``moetrain.model.precision.fp32_region`` reads the registry at every call)."""
    from moetrain.model import precision

    assert name in precision.FP32_REGIONS, (name, list(precision.FP32_REGIONS))
    kept = {k: v for k, v in precision.FP32_REGIONS.items() if k != name}
    setattr_(precision, "FP32_REGIONS", kept)


def _router_gate_in_bf16(setattr_: Callable[..., None]) -> None:
    drop_fp32_region("router_gate", setattr_)


def _routed_rows_in_fp32(setattr_: Callable[..., None]) -> None:
    from moetrain.model import moe

    # MoELayer's one cast of the routed tokens (``as_compute``) leaves them as they are.
    setattr_(moe, "as_compute", lambda t: t)


def _muon_local_shard(setattr_: Callable[..., None]) -> None:
    from torch.distributed.tensor import DTensor

    from moetrain.train import muon, muon_owners, zero1_state

    def mine(u: Any, layout: Any, dtype: Any) -> tuple[Any, Callable[[Any], Any]]:
        local = u.to_local() if isinstance(u, DTensor) else u
        return local.to(dtype), lambda o: o

    def owned(route: Any, slices: dict, steps: int, dtype: Any) -> dict:
        return {i: muon.newton_schulz(t, steps, dtype) for i, t in slices.items()}

    setattr_(muon, "whole", mine)
    setattr_(zero1_state, "whole", mine)
    setattr_(muon_owners, "orthogonalize_owned", owned)


def _stage_inputs_uninitialised(setattr_: Callable[..., None]) -> None:
    from moetrain.model import transformer

    real = transformer.Transformer.forward

    def forward(self: Any, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = self.step_context
        if ctx.zero_stage_input and not self.embeds_input:
            # What torch.empty hands a stage is whatever its memory held (often zeros from a
            # fresh page, not always): here each rank's own numbers, every time.
            import torch
            import torch.distributed as dist

            ctx.zero_stage_input = False
            g = torch.Generator().manual_seed(dist.get_rank())
            with torch.no_grad():
                tokens.copy_(torch.randn(tokens.shape, generator=g))
            try:
                return real(self, tokens, *args, **kwargs)
            finally:
                ctx.zero_stage_input = True
        return real(self, tokens, *args, **kwargs)

    setattr_(transformer.Transformer, "forward", forward)


def _everywhere(setattr_: Callable[..., None], name: str, value: Any) -> list[str]:
    """Replace every binding of moetrain's function ``name`` (where it is defined and every
    module that imported it by name: the engine's ``from ... import``) with ``value``;
    returns the modules patched. Raises when there is none: a plant that changes nothing
    must not pass for one that was caught."""
    import moetrain.train.trainer  # noqa: F401  (the trainer imports what a step runs)

    modules = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("moetrain")]  # fmt: skip
    real = {id(f): f for m in modules if callable(f := getattr(m, name, None))
            and getattr(f, "__module__", "").startswith("moetrain")}  # fmt: skip
    if not real:
        raise LookupError(f"tests/faults.py: no moetrain module binds {name!r}; update the plant")
    patched = []
    for module in modules:
        if id(getattr(module, name, None)) in real:
            setattr_(module, name, value)
            patched.append(module.__name__)
    return patched


def mutate(setattr_: Callable[..., None], owner: Any, name: str, old: str, new: str) -> None:
    """Replace function ``name`` of ``owner`` (a module or a class) by its own source with
    ``old`` replaced by ``new`` (exactly one occurrence), compiled in its module's globals:
    a mutation of the code as written. Raises when ``old`` is not in the source once."""
    import __future__

    func = getattr(owner, name)
    source = textwrap.dedent(inspect.getsource(func))
    if source.count(old) != 1:
        raise LookupError(f"tests/faults.py: {old!r} occurs {source.count(old)} times in "
                          f"{func.__module__}.{func.__qualname__}; update the plant")  # fmt: skip
    module = sys.modules[func.__module__]
    code = compile(source.replace(old, new), inspect.getsourcefile(func) or "<mutated>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)  # fmt: skip
    scope: dict[str, Any] = {}
    exec(code, vars(module), scope)
    setattr_(owner, name, scope[name])


def _ep_grad_norm_without_experts(setattr_: Callable[..., None]) -> None:
    import torch

    def nothing(params: Any, ep_mesh: Any = None, etp_mesh: Any = None) -> Any:
        return torch.zeros((), dtype=torch.float64)

    _everywhere(setattr_, "expert_grad_sq_norm", nothing)


def _muon_plain_momentum(setattr_: Callable[..., None]) -> None:
    from moetrain.train import muon

    def heavy_ball(buf: Any, grad: Any, momentum: float) -> Any:
        if buf.dtype == grad.dtype:
            return buf.lerp_(grad, 1 - momentum).clone()
        m = buf.float().lerp_(grad.float(), 1 - momentum)
        buf.copy_(m)
        return m

    setattr_(muon, "momentum_update", heavy_ball)


def _fp8_tensorwise_grads_e4m3(setattr_: Callable[..., None]) -> None:
    import dataclasses

    from moetrain.kernels import fp8

    e4m3 = fp8.RECIPES["rowwise"].grad_dtype
    changed = dataclasses.replace(fp8.RECIPES["tensorwise"], grad_dtype=e4m3)
    setattr_(fp8, "RECIPES", {**fp8.RECIPES, "tensorwise": changed})


def _grouped_mm_never_native(setattr_: Callable[..., None]) -> None:
    import moetrain.kernels  # noqa: F401

    found = [m for m in list(sys.modules.values())
             if getattr(m, "__name__", "").startswith("moetrain.kernels")
             and getattr(getattr(m, "_gmm", None), "__module__", None) == m.__name__]  # fmt: skip
    if not found:
        raise LookupError("tests/faults.py: no moetrain.kernels module defines _gmm; update "
                          "the plant")  # fmt: skip
    for module in found:
        for name in ("_gmm", "_gmm_wgrad"):
            mutate(setattr_, module, name, "if _native_ok(", "if False and _native_ok(")


def _welch_pooled_df(setattr_: Callable[..., None]) -> None:
    from moetrain.ablation import stats

    mutate(setattr_, stats, "difference_interval",
           "df = (va + vb) ** 2 / (va**2 / (ia.n - 1) + vb**2 / (ib.n - 1))",
           "df = ia.n + ib.n - 2")  # fmt: skip


def _quantile_counts_averaged(setattr_: Callable[..., None]) -> None:
    from moetrain.train.layer_stats import LayerStats

    mutate(setattr_, LayerStats, "pop", "packed[:, -E:] /= g.dp_cp_size",
           "packed[:, -E * (bins + 1) :] /= g.dp_cp_size")  # fmt: skip


def _qk_clip_local_maxima(setattr_: Callable[..., None]) -> None:
    from moetrain.train.qk_clip import QKClip

    mutate(setattr_, QKClip, "gather", "dist.all_reduce(table, op=dist.ReduceOp.MAX)", "pass")


FAULTS: dict[str, Callable[[Callable[..., None]], None]] = {
    "stage_layers_misassigned": _stage_layers_misassigned,
    "embedding_copies_unsynced": _embedding_copies_unsynced,
    "per_micro_batch_counts": _per_micro_batch_counts,
    "breadth_first_ignored": _breadth_first_ignored,
    "cp_forced_to_1": _cp_forced_to_1,
    "fp8_local_amax": _fp8_local_amax,
    "init_offsets_forgotten": _init_offsets_forgotten,
    "expert_layouts_ignored": _expert_layouts_ignored,
    "fsdp_root_in_bf16": _fsdp_root_in_bf16,
    "muon_local_shard": _muon_local_shard,
    "router_gate_in_bf16": _router_gate_in_bf16,
    "routed_rows_in_fp32": _routed_rows_in_fp32,
    "stage_inputs_uninitialised": _stage_inputs_uninitialised,
    "ep_grad_norm_without_experts": _ep_grad_norm_without_experts,
    "muon_plain_momentum": _muon_plain_momentum,
    "fp8_tensorwise_grads_e4m3": _fp8_tensorwise_grads_e4m3,
    "grouped_mm_never_native": _grouped_mm_never_native,
    "quantile_counts_averaged": _quantile_counts_averaged,
    "qk_clip_local_maxima": _qk_clip_local_maxima,
    "welch_pooled_df": _welch_pooled_df,
}


def plant(name: str, setattr_: Callable[..., None] = setattr) -> None:
    """Install the fault ``name`` (a key of ``FAULTS``)."""
    FAULTS[name](setattr_)
