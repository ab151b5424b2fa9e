"""What one training step of a planned model computes, censused, in the shares the plan
prices it by.

The plan's step time is built from what the code computes, not from the model's FLOP
formula: ``census_step`` runs one training step (forward and backward of one micro-batch
under the trainer's autocast, then the optimizer the trainer builds) of a **proxy** of the
planned model on the CPU inside ``moetrain.plan.census.StepCensus`` and reads off

- the matmul FLOPs by class and dtype: ``experts`` (the routed experts' GEMMs: every matmul
  the ``GroupedExperts`` modules run, forward and backward), ``attention`` (the fused
  attention kernels' products) and ``matmul`` (every other: projections, dense and shared
  FFNs, router, output head). Under bf16 autocast a GEMM that autocast does not reach runs
  in fp32 here as on the GPU (the routed experts until they cast explicitly);
- the bytes the other ops move (each op's tensor operands read and its outputs written,
  views excluded), split into the casts of parameters (``weights``), the optimizer step
  (``optimizer``) and the rest (``activations``);
- the host syncs.

The proxy is the planned model with every width divided by one factor (widths at least 8,
rope dims even), at most ``PROXY_SEQ`` positions and its first ``PROXY_LAYERS`` layers
(their pattern kept), the experts, top-k and heads unchanged, one micro-batch: it costs
seconds of CPU where the model would not fit. Traffic inside SDPA's math path (the CPU's way
with some attention variants) is kept apart: on a GPU it is one fused kernel, priced as
attention. What carries over to the planned model is what does not depend on the widths: per
class, computed FLOPs / the model's FLOP formula (``estimate.layer_flops_by_class`` at the
proxy's dims: capacity padding, recomputation, attention's full square under a causal mask)
and the share of each dtype; activation traffic per byte of saved activations
(``moetrain.plan.activations``, its dims-aware model of what a block keeps); cast and
optimizer bytes per parameter.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moetrain.config import JobConfig
from moetrain.plan.census import _MATMULS, StepCensus, _name
from moetrain.plan.flops import CLASSES, layer_flops_by_class

__all__ = ["CLASSES", "MatmulLabels", "StepMix", "StepMixCensus", "cached_census",
           "census_step", "proxy_config"]  # fmt: skip

_ATTENTION = {n for n in _MATMULS if "attention" in n}
# Ops that move no data (metadata, aliasing, allocation without a write, host reads).
_FREE = {
    "detach", "alias", "_unsafe_view", "_reshape_alias", "lift_fresh", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_", "_local_scalar_dense",
    "sym_size", "sym_stride", "sym_numel", "is_same_size", "_has_compatible_shallow_copy_type",
    "clone_", "_to_copy_meta", "item", "equal",
}  # fmt: skip
PROXY_PARAMS = 2e6
"""Parameters the proxy aims at (its widths are the model's / sqrt(params / this))."""
PROXY_SEQ = 128
"""Positions per sequence of the proxy (sliding windows scaled with them)."""
PROXY_LAYERS = 8
"""Layers of the proxy at most: the first ones, with their pattern (dense and MoE layers,
windows) as the model has it there."""


def _bytes(t: torch.Tensor) -> int:
    """Bytes a kernel reads or writes of ``t``: its elements, but no more than its storage
    (a broadcast view reads its storage once)."""
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return n


class StepMixCensus(StepCensus):
    """``StepCensus`` that also classes each matmul (experts / attention / other) and counts
    the bytes of the other ops by what they serve."""

    def __init__(self, param_storages: set[int]) -> None:
        super().__init__()
        self.class_flops: Counter[tuple[str, torch.dtype]] = Counter()
        self.traffic: Counter[str] = Counter()
        self.phase = "step"
        self.region: list[str] = []
        self._params = param_storages
        self._attention = _AttentionRegion(self)

    def __enter__(self) -> StepMixCensus:
        self._attention.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._attention.__exit__(*exc)

    def _class(self, name: str) -> str:
        return matmul_class(name, self.region)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = _name(func)
        if name in _MATMULS:
            flops, (i, _) = _MATMULS[name]
            self.class_flops[(self._class(name), args[i].dtype)] += flops(args)
            return super().__torch_dispatch__(func, types, args, kwargs)
        if name in _FREE or getattr(func, "is_view", False):
            return super().__torch_dispatch__(func, types, args, kwargs)
        inputs = _tensors(args) + _tensors(tuple((kwargs or {}).values()))
        read = sum(_bytes(t) for t in inputs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        written = sum(_bytes(t) for t in _tensors(out))
        if self.phase == "optimizer":
            kind = "optimizer"
        elif name == "_to_copy" and inputs and _storage(inputs[0]) in self._params:
            kind = "weights"
        elif matmul_class("", self.region) == "attention":
            kind = "attention"  # inside SDPA's math path: a fused kernel's on a GPU
        else:
            kind = "activations"
        self.traffic[kind] += read + written
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an op's arguments or outputs (tensors, and lists or tuples of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


_TAG = "moetrain_class"


def matmul_class(name: str, region: list[str]) -> str:
    """The class of a matmul op ``name`` dispatched now: attention kernels by name, else the
    region the forward is in, else (in backward) the tag its autograd node carries."""
    if name in _ATTENTION:
        return "attention"
    if region:
        return region[-1]
    node = torch._C._current_autograd_node()
    if node is not None:
        return node.metadata.get(_TAG, "matmul")
    return "matmul"


def _mark(output: Any, stop: set[int], cls: str) -> None:
    """Tag the autograd nodes that produced ``output`` back to (not including) the nodes in
    ``stop`` (the inputs' ``grad_fn``) and the leaves, so that backward's matmuls are classed
    with the forward's."""
    todo = [t.grad_fn for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        if node.name() == "torch::autograd::AccumulateGrad":
            continue
        node.metadata[_TAG] = cls
        todo += [n for n, _ in node.next_functions]


def _grad_fns(inputs: Any) -> set[int]:
    return {id(t.grad_fn) for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}


class _AttentionRegion(TorchFunctionMode):
    """Classes the matmuls of ``F.scaled_dot_product_attention`` as attention when it runs
    its math path (on a CPU when q/k and v widths differ: bmm, softmax, bmm). ``census``:
    anything with a ``region`` stack."""

    def __init__(self, census: Any) -> None:
        super().__init__()
        self.census = census

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        self.census.region.append("attention")
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.census.region.pop()
        _mark(out, _grad_fns(args[:3]), "attention")
        return out


def _tag_experts(census: Any, module: torch.nn.Module) -> list[Any]:
    """Forward hooks on ``module`` (a GroupedExperts) that class its matmuls as experts',
    forward and backward."""

    def pre(mod, inputs):
        census.region.append("experts")
        mod._census_inputs = _grad_fns(inputs)

    def post(mod, inputs, output):
        census.region.pop()
        _mark(output, mod._census_inputs, "experts")
        return output

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


class MatmulLabels(TorchDispatchMode):
    """Names each matmul's kernels in a profile by class: every matmul op runs inside
    ``torch.profiler.record_function("moetrain::<class>")`` (experts, attention, matmul), so
    that a profile's table splits the step's GEMM time as the plan does
    (``tools/bench_e2e.py``). Use around eager steps of ``parts`` (a model's modules, or a
    layout's chunks)."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.region: list[str] = []
        self._attention = _AttentionRegion(self)
        self._parts = parts
        self._hooks: list[Any] = []

    def __enter__(self) -> MatmulLabels:
        from moetrain.model.experts import GroupedExperts

        experts = [m for part in self._parts for m in part.modules()
                   if isinstance(m, GroupedExperts)]  # fmt: skip
        self._hooks = [h for mod in experts for h in _tag_experts(self, mod)]
        self._attention.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._attention.__exit__(*exc)
            for h in self._hooks:
                h.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = _name(func)
        if name not in _MATMULS:
            return func(*args, **(kwargs or {}))
        with torch.profiler.record_function(f"moetrain::{matmul_class(name, self.region)}"):
            return func(*args, **(kwargs or {}))


@dataclass
class StepMix:
    """A step's census, per unit the plan scales (module docstring)."""

    source: str
    flops: dict[str, dict[str, float]]
    """class -> dtype name -> matmul FLOPs the censused step computed."""
    model_flops: dict[str, float]
    """class -> the model formula's FLOPs for the same step (``layer_flops_by_class``)."""
    traffic: dict[str, float]
    """"activations", "weights", "optimizer" -> bytes the censused step moved ("attention":
    inside SDPA's math path, which a GPU runs as one fused kernel: not priced there)."""
    saved: float
    """Activation bytes ``moetrain.plan.activations`` counts for the censused micro-batch."""
    params: float
    """Parameters (elements) of the censused model."""
    optim_state: float = 0.0
    """Bytes of the optimizer states after the censused step."""
    dtype: str = "bfloat16"
    """The compute dtype the step ran in."""
    syncs: int = 0
    casts: dict[str, float] = field(default_factory=dict)
    """"from->to" -> elements cast (every floating cast of the step)."""

    def ratio(self, cls: str) -> float:
        """FLOPs computed / FLOPs the model formula counts, for ``cls`` (1 when absent)."""
        model = self.model_flops.get(cls, 0.0)
        done = sum(self.flops.get(cls, {}).values())
        return done / model if model > 0 else 1.0

    def shares(self, cls: str) -> dict[str, float]:
        """dtype name -> fraction of ``cls``'s computed FLOPs in that dtype."""
        by = self.flops.get(cls, {})
        total = sum(by.values())
        return {d: f / total for d, f in by.items()} if total > 0 else {}

    @property
    def traffic_per_saved_byte(self) -> float:
        return self.traffic.get("activations", 0.0) / self.saved if self.saved else 0.0

    def per_param(self, kind: str) -> float:
        """Bytes of ``kind`` ("weights": parameter casts per micro-batch, "optimizer": the
        optimizer step) per parameter element."""
        return self.traffic.get(kind, 0.0) / self.params if self.params else 0.0

    def per_state_byte(self, kind: str) -> float:
        """Bytes of ``kind`` per byte of optimizer state (the optimizer step's traffic)."""
        return self.traffic.get(kind, 0.0) / self.optim_state if self.optim_state else 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> StepMix:
        return cls(**json.loads(text))


def proxy_config(cfg: JobConfig, n_params: float | None = None) -> JobConfig:
    """``cfg`` with every width divided by sqrt(n_params / PROXY_PARAMS) (at least 8; rope
    dims even), at most PROXY_SEQ positions (windows in proportion) and PROXY_LAYERS layers
    (the first), one micro-batch of ``moe.token_group_seqs`` sequences (or one), SDPA
    attention, no checkpoint to start from, one process; the same experts, top-k and heads."""
    from moetrain.model.transformer import meta_model

    if n_params is None:
        n_params = meta_model(cfg.model, cfg.moe).num_params()
    s = max(1.0, math.sqrt(n_params / PROXY_PARAMS))
    m, mo = cfg.model, cfg.moe

    def w(v: int | None, even: bool = False) -> int | None:
        if v is None:
            return None
        out = max(8, round(v / s))
        return out + (out % 2) if even else out

    head_dim = m.head_dim if m.head_dim is not None else m.dim // m.n_heads
    model = dataclasses.replace(
        m, dim=w(m.dim), ffn_dim=w(m.ffn_dim), head_dim=w(head_dim, even=True),
        vocab_size=w(m.vocab_size or 256), q_lora_rank=w(m.q_lora_rank),
        kv_lora_rank=w(m.kv_lora_rank), qk_nope_head_dim=w(m.qk_nope_head_dim, even=True),
        qk_rope_head_dim=w(m.qk_rope_head_dim, even=True), v_head_dim=w(m.v_head_dim, even=True),
        attention_backend="sdpa", init_from=None, upcycle_from=None,
    )  # fmt: skip
    moe = dataclasses.replace(mo, expert_ffn_dim=w(mo.expert_ffn_dim),
                              shared_expert_ffn_dim=w(mo.shared_expert_ffn_dim))  # fmt: skip
    batch = mo.token_group_seqs or 1
    train = dataclasses.replace(cfg.train, micro_batch_size=batch, global_batch_size=batch)
    # Positions: at most PROXY_SEQ, windows kept in proportion (attention's share of pairs).
    seq = min(cfg.data.seq_len, PROXY_SEQ)
    window = m.sliding_window
    if window is not None:
        window = max(1, round(window * seq / cfg.data.seq_len))
    layers = min(m.n_layers, PROXY_LAYERS)
    windowed = m.sliding_window_layers
    if windowed is not None:
        windowed = [i for i in windowed if i < layers]
    model = dataclasses.replace(model, sliding_window=window, max_seq_len=max(seq, 8),
                                n_layers=layers, sliding_window_layers=windowed)  # fmt: skip
    moe = dataclasses.replace(moe, dense_layers=[i for i in mo.dense_layers if i < layers])
    data = dataclasses.replace(cfg.data, seq_len=seq)
    parallel = dataclasses.replace(
        cfg.parallel, tp=1, pp=1, cp=1, ep=1, dp_shard=1, dp_replicate=1,
        sequence_parallel=False, pp_stage_layers=None, activation_checkpointing="none",
    )  # fmt: skip
    return dataclasses.replace(cfg, model=model, moe=moe, train=train, parallel=parallel,
                               data=data)  # fmt: skip


def census_step(
    cfg: JobConfig,
    dtype: torch.dtype,
    build_optimizers: Any,
    *,
    proxy: bool = True,
    seed: int = 0,
) -> StepMix:
    """Census one training step of ``cfg``'s model (its proxy unless ``proxy`` is False) on
    the CPU in ``dtype`` (bf16: under autocast, as the trainer on a GPU). ``build_optimizers``:
    the trainer's (``moetrain.train.engine.build_optimizers``)."""
    from moetrain.model.experts import GroupedExperts
    from moetrain.model.precision import Precision, fp32_region
    from moetrain.model.transformer import Transformer
    from moetrain.parallel.dims import ParallelDims
    from moetrain.plan import activations as act
    from moetrain.plan.build import Chunk, Layer

    run = proxy_config(cfg) if proxy else cfg
    m, mo = run.model, run.moe
    torch.manual_seed(seed)
    model = Transformer(m, mo)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    B, S = run.train.micro_batch_size, run.data.seq_len
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, m.vocab_size, (B, S + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    kwargs: dict[str, torch.Tensor] = {}
    if m.document_mask:
        kwargs["documents"] = torch.zeros(B, S, dtype=torch.long)
    if m.mtp_depth:
        kwargs["labels"] = labels
    dims = ParallelDims.from_config(run.parallel, 1)
    _, optimizers = build_optimizers(run, dims, None, [model], [])
    census = StepMixCensus({_storage(p) for p in model.parameters()})
    hooks = [h for mod in model.modules() if isinstance(mod, GroupedExperts)
             for h in _tag_experts(census, mod)]  # fmt: skip
    # The trainer's policy on this CPU: autocast around the forward only, as the trainer's
    # (the backward runs each op in its forward's dtype), the loss over fp32 logits.
    Precision(dtype, "cpu").wrap_forward(model)
    loss_region = fp32_region("loss", "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: one thread is fastest, and immune to a busy machine
    try:
        with census:
            logits = model(inputs, **kwargs)
            with loss_region.autocast_off():
                logits = loss_region.cast(logits)
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
            census.phase = "optimizer"
            for opt in optimizers:
                opt.step()
    finally:
        torch.set_num_threads(threads)
        for h in hooks:
            h.remove()
    flops: dict[str, dict[str, float]] = {}
    for (cls, dt), f in census.class_flops.items():
        flops.setdefault(cls, {})[str(dt).removeprefix("torch.")] = float(f)
    model_flops: Counter[str] = Counter()
    n_blocks = m.n_layers + m.mtp_depth
    for i in range(n_blocks):
        for cls, f in layer_flops_by_class(run, i, 1).items():
            model_flops[cls] += f * B * S
    model_flops["matmul"] += 6 * m.dim * m.vocab_size * B * S * (1 + m.mtp_depth)
    model_flops["matmul"] += 6 * 2 * m.dim * m.dim * B * S * m.mtp_depth  # eh_proj
    sh = act.shapes(run, dims, dtype, "cuda")  # attention's tensors as a fused kernel keeps them
    layers = [Layer(i, _is_moe(i, run)) for i in range(m.n_layers)]
    saved = act.chunk_bytes(run, sh, Chunk(0, layers, True, True))
    casts = {f"{str(a).removeprefix('torch.')}->{str(b).removeprefix('torch.')}": float(n)
             for (a, b), n in census.cast_elements.items()}  # fmt: skip
    return StepMix(
        source=f"census of {'a proxy of ' if proxy else ''}the model: one micro-batch of "
        f"{B} x {S} tokens, {str(dtype).removeprefix('torch.')}, {n_params / 1e6:.2f}M "
        f"parameters (dim {m.dim}), torch {torch.__version__.split('+')[0]}",
        flops=flops,
        model_flops=dict(model_flops),
        traffic={k: float(v) for k, v in census.traffic.items()},
        saved=float(saved),
        params=float(n_params),
        optim_state=float(_state_bytes(optimizers)),
        dtype=str(dtype).removeprefix("torch."),
        syncs=census.sync_count(),
        casts=casts,
    )


def _is_moe(i: int, cfg: JobConfig) -> bool:
    from moetrain.model.transformer import is_moe_layer

    return is_moe_layer(i, cfg.moe)


def _state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    seen: set[int] = set()
    total = 0
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and _storage(v) not in seen:
                    seen.add(_storage(v))
                    total += v.untyped_storage().nbytes()
    return total


_CACHE: dict[str, StepMix] = {}


def cached_census(cfg: JobConfig, dtype: torch.dtype, build_optimizers: Any) -> StepMix:
    """``census_step`` of ``cfg``'s proxy, once per model, optimizer and step shape in this
    process (a layout search plans one model many times)."""
    key = json.dumps([dataclasses.asdict(cfg.model), dataclasses.asdict(cfg.moe),
                      dataclasses.asdict(cfg.optim), cfg.data.seq_len, str(dtype)],
                     sort_keys=True, default=str)  # fmt: skip
    if key not in _CACHE:
        _CACHE[key] = census_step(cfg, dtype, build_optimizers)
    return _CACHE[key]
