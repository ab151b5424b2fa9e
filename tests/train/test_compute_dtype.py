"""A bf16 step computes in bf16: what each matmul of one training step receives, counted at
torch's dispatcher (``StepCensus``), and how often each weight is rounded to bf16.

The compute-dtype policy (``moetrain.model.precision``, docs/kernels.md): every GEMM takes
bf16 operands, forward and backward, through every kernel backend; what stays fp32 is
named here, with its FLOPs computed by hand: the routers' gates (forward, input gradient,
weight gradient) and the combine's weighted sum (the torch ``unpermute``'s fp32 einsum,
forward and the router weights' gradient). Each weight the policy rounds is rounded once
per micro-batch (autocast's cache, or one explicit cast); the gates and the token
embeddings never are. The grouped GEMM's operands are replayed through torch's meta kernel
for ``_grouped_mm``, which holds CUDA's rules (bf16 only, 16-byte aligned strides): the
CPU run proves the GPU would take the same calls.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from typing import Any

import pytest
import torch
from faults import plant
from moetrain.kernels import resolve_backend
from moetrain.kernels.grouped_gemm import torch_backend as gemm_torch
from multirank import micro_config

from moetrain.plan.census import StepCensus
from moetrain.train.trainer import Trainer

BF16 = torch.bfloat16
# The micro MoE, smaller, with every kind of GEMM: a dense first layer, shared experts under
# a sigmoid gate, routed experts with biases (gpt-oss), untied output head.
OPTIONS = (
    "model.dim=32",
    "model.ffn_dim=64",
    "moe.expert_ffn_dim=32",
    "moe.dense_layers=[0]",
    "moe.shared_expert_gate=true",
    "moe.expert_ffn_bias=true",
    "moe.router_bias=true",
    "data.seq_len=16",
    "train.dtype=bf16",
)
FP32_BY_POLICY = ("ffn.router.gate.", "tok_embeddings.")
"""Parameters the policy keeps in fp32 (never rounded to bf16 for compute)."""


def _step(*overrides: str, **census: Any) -> tuple[StepCensus, Trainer]:
    """One bf16 training step of the micro MoE under a census (``census``: its options; the
    model's parameters are passed as ``params``)."""
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(micro_config(out, "train.steps=1", *OPTIONS, *overrides))
        params = [(n, p) for part in trainer.engine.parts for n, p in part.named_parameters()]
        with StepCensus(params=params, **census) as c:
            trainer.train_step()
        trainer.close()
    return c, trainer


def _named_fp32_flops(trainer: Trainer) -> int:
    """The fp32 matmul FLOPs the policy names, by hand: per MoE layer and micro-batch of T
    tokens, the gate's 3 GEMMs of 2 T D E (forward, input and weight gradients) and, with
    the torch backend's ``unpermute``, the combine's 2 einsums of 2 T K D (forward, gradient
    of the router weights; the Triton kernel runs no aten matmul)."""
    cfg = trainer.cfg
    T = cfg.train.micro_batch_size * cfg.data.seq_len
    D, E, K = cfg.model.dim, cfg.moe.num_experts, cfg.moe.top_k
    combine = resolve_backend(cfg.moe.kernels, trainer.device) == "torch"
    per_layer = 3 * 2 * T * D * E + (2 * 2 * T * K * D if combine else 0)
    return len(trainer.engine.moe_layer_ids) * trainer.engine.n_micro * per_layer


def _not_bf16(c: StepCensus, allowed: tuple[torch.dtype, ...] = ()) -> str:
    """The matmuls that took operands in another dtype than bf16 (or ``allowed``): op,
    operand dtypes and shapes, counted."""
    seen = Counter(
        (op, dtypes, shapes)
        for op, dtypes, shapes in c.operands
        if any(d not in (BF16, *allowed) for d in dtypes[:2] if d.is_floating_point)
    )
    return "\n".join(f"  {n} x {op} {dtypes} {shapes}" for (op, dtypes, shapes), n in seen.items())


def _assert_bf16_but_the_named(c: StepCensus, trainer: Trainer, other=()) -> None:
    by_dtype = c.flops_by_dtype()
    fp32, named = by_dtype.get(torch.float32, 0), _named_fp32_flops(trainer)
    report = f"{c.report()}\nnot bf16:\n{_not_bf16(c, other)}"
    assert set(by_dtype) <= {BF16, torch.float32, *other}, report
    assert fp32 == named, f"fp32 matmul FLOPs {fp32:,}, the policy names {named:,}\n{report}"
    assert not c.mismatched, report
    assert by_dtype[BF16] > 10 * fp32, report


@pytest.fixture(scope="module")
def torch_step() -> tuple[StepCensus, Trainer]:
    """One step on the torch backend (``torch._grouped_mm``), every census option on: the
    FLOPs, CUDA-contract and weight-cast tests read it."""
    return _step("moe.kernels=torch", contracts=True, triton=True)


@pytest.mark.parametrize(
    "backend", ["grouped_mm", "per-expert", pytest.param("triton", marks=pytest.mark.slow)]
)
def test_a_bf16_step_runs_every_matmul_in_bf16_but_the_gates_and_the_combine(
    backend: str, torch_step, monkeypatch
) -> None:
    """Forward and backward, every backend of the routed experts: ``torch._grouped_mm``, the
    torch backend's per-expert fallback (``out=`` matmuls), the Triton kernels (CPU
    interpreter; their launches counted by the dtypes they are handed)."""
    if backend == "grouped_mm":
        c, trainer = torch_step
    elif backend == "per-expert":
        monkeypatch.setattr(gemm_torch, "_native_ok", lambda *a: False)
        c, trainer = _step("moe.kernels=torch")
    else:
        pytest.importorskip("triton")
        c, trainer = _step("moe.kernels=triton", triton=True)
    _assert_bf16_but_the_named(c, trainer)
    routed = {op for (op, _dt) in c.matmul_flops if "grouped" in op}
    want = {"grouped_mm": {"_grouped_mm"}, "per-expert": set(),  # the per-expert mm's: above
            "triton": {"triton_grouped_mm", "triton_grouped_wgrad"}}[backend]  # fmt: skip
    assert routed == want, c.report()


def test_the_grouped_gemm_operands_pass_torchs_cuda_checks(torch_step) -> None:
    """Every ``_grouped_mm`` of the step (forward, input and weight gradients) replayed on
    meta tensors through torch's meta kernel, which checks CUDA's rules: none refused."""
    c, _ = torch_step
    assert c.contract_checks["_grouped_mm"] >= 3 * 3, c.report()  # 3 GEMMs, fwd + 2 bwd
    assert not c.contract_failures, c.report()


def test_the_census_sees_an_fp32_grouped_gemm_and_cudas_refusal(monkeypatch) -> None:
    """The checks above can fail: the experts' GEMMs in fp32 (what the code did before the
    policy: the routed tokens left in fp32 and the weights cast to their dtype,
    ``routed_rows_in_fp32`` of tests/faults.py) are fp32 FLOPs the policy does not name, and
    CUDA's kernel refuses them."""
    plant("routed_rows_in_fp32", monkeypatch.setattr)
    c, trainer = _step("moe.kernels=torch", contracts=True)
    assert c.flops_by_dtype()[torch.float32] > _named_fp32_flops(trainer)
    assert ("_grouped_mm", torch.float32) in c.matmul_flops
    assert any("BF16" in msg for _op, msg in c.contract_failures), c.contract_failures


def test_fp8_high_precision_parts_run_in_bf16() -> None:
    """FP8 on ``torch._scaled_mm`` (torch's CPU kernel): the FP8 GEMMs take float8 operands,
    their weight gradients and every GEMM left out of FP8 bf16 ones; fp32 only where named."""
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("this torch has no _scaled_mm")
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    c, trainer = _step("train.fp8=rowwise", "train.fp8_backend=scaled_mm", "moe.kernels=torch")
    _assert_bf16_but_the_named(c, trainer, other=fp8)
    scaled = sum(f for (op, dt), f in c.matmul_flops.items() if dt in fp8)
    assert scaled > 0, c.report()


def _assert_each_weight_rounded_once(c: StepCensus, trainer: Trainer) -> None:
    n = trainer.engine.n_micro
    names = [name for name, _ in trainer.engine.parts[0].named_parameters()]
    to_bf16 = {name: c.weight_casts[(name, torch.float32, BF16)] for name in names}
    wrong = {
        name: k
        for name, k in to_bf16.items()
        if k != (0 if any(s in name for s in FP32_BY_POLICY) else n)
    }
    assert not wrong, f"casts to bf16 in a step of {n} micro-batches: {wrong}"
    other = {k: v for k, v in c.weight_casts.items() if k[1:] != (torch.float32, BF16)}
    assert not other, other


def test_each_weight_is_rounded_to_bf16_once_per_micro_batch(torch_step) -> None:
    """Every parameter the policy computes in bf16 is cast to it exactly once per micro-batch
    (never zero: its GEMM would run in fp32; never twice), the gates and the embeddings
    never; no parameter is cast to any other dtype."""
    _assert_each_weight_rounded_once(*torch_step)


def test_a_dropped_fp32_region_is_caught(monkeypatch) -> None:
    """A planted policy change: the ``router_gate`` fp32 region dropped from the policy's
    registry (``router_gate_in_bf16`` of tests/faults.py). The checks above name it: the
    gates' GEMMs are bf16 FLOPs where the policy names fp32 ones, and each gate's weight is
    rounded to bf16 once per micro-batch. (tests/model/test_precision.py drops every region
    in turn against its fp32 reference.)"""
    plant("router_gate_in_bf16", monkeypatch.setattr)
    c, trainer = _step("moe.kernels=torch")
    with pytest.raises(AssertionError, match=r"fp32 matmul FLOPs [\d,]+, the policy names"):
        _assert_bf16_but_the_named(c, trainer)
    with pytest.raises(AssertionError, match=r"casts to bf16 .*ffn\.router\.gate\.weight"):
        _assert_each_weight_rounded_once(c, trainer)


def test_under_full_activation_checkpointing_the_recompute_rounds_again() -> None:
    """The documented exception: a recomputed block rounds its weights again in backward
    (autocast's cache does not outlive the forward it served), twice per micro-batch; the
    embeddings, the final norm and the head, outside the checkpointed blocks, once."""
    c, trainer = _step("parallel.activation_checkpointing=full")
    n = trainer.engine.n_micro
    for (name, _src, _dst), k in c.weight_casts.items():
        want = 2 * n if name.startswith("layers.") else n
        assert k == want, (name, k, want)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_gather_variant_keeps_bf16_operands(kernels: str) -> None:
    """``gather_grouped_mm`` (the GEMM that reads its rows through an index; no model layer
    calls it yet) handed bf16 rows and weights computes in bf16, forward and backward, and
    its ``_grouped_mm`` calls pass CUDA's checks."""
    if kernels == "triton":
        pytest.importorskip("triton")
    from moetrain.kernels import gather_grouped_mm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 32, generator=g).to(BF16).requires_grad_()
    w = torch.randn(3, 32, 16, generator=g).to(BF16).requires_grad_()
    src = torch.tensor([0, 3, -1, 5, 7, 7, 2, 11, -1, 1, 4, 9, 10, 6, 8, 0])
    offs = torch.tensor([5, 9, 16], dtype=torch.int32)
    with StepCensus(contracts=True, triton=True) as c:
        gather_grouped_mm(x, src, w, offs, backend=kernels).float().square().sum().backward()
    assert set(c.flops_by_dtype()) == {BF16}, c.report()
    assert c.total_flops() >= 3 * 2 * 16 * 32 * 16, c.report()  # forward, dgrad, wgrad
    assert not c.contract_failures, c.report()


ROOT = ("tok_embeddings.", "norm.", "output.")
"""The root unit's parameters (by name prefix): token embeddings, final norm, output head."""


def gathered_in_fp32(name: str) -> bool:
    """Under FSDP2 mixed precision, the units the policy gathers in fp32: the root and every
    router; the blocks' other weights in bf16 (``apply_fsdp``,
    moetrain/parallel/data_parallel.py)."""
    return name.startswith(ROOT) or ".ffn.router." in name


def _gathered_dtypes(part: torch.nn.Module) -> tuple[dict[str, torch.dtype], Any]:
    """The dtype of each parameter as its module's forward sees it (the first call): under
    FSDP2 the module then holds the unsharded parameter, in the dtype its unit was all-gathered
    in. Returns the record and the hooks' remover."""
    seen: dict[str, torch.dtype] = {}

    def hook(prefix: str) -> Any:
        def record(module: torch.nn.Module, args: Any) -> None:
            for name, p in module.named_parameters(recurse=False):
                seen.setdefault(prefix + name, p.dtype)

        return record

    handles = [
        m.register_forward_pre_hook(hook(f"{n}." if n else ""))
        for n, m in part.named_modules()
        if next(m.parameters(False), None) is not None
    ]
    return seen, lambda: [h.remove() for h in handles]


def gather_dtype_problems(gathered: dict[str, torch.dtype], casts: dict) -> list[str]:
    """What contradicts the policy's FSDP2 gathers: a parameter seen in another dtype than its
    unit's (``gathered_in_fp32``, else bf16), and a cast of an fp32-gathered parameter's
    shard to bf16 (``StepCensus.weight_casts``: FSDP2 casts a shard before gathering it)."""
    out = []
    for name, dtype in sorted(gathered.items()):
        want = torch.float32 if gathered_in_fp32(name) else BF16
        if dtype != want:
            out.append(f"{name} gathered in {dtype}, the policy's {want}")
    for (name, src, dst), n in sorted(casts.items(), key=str):
        if gathered_in_fp32(name) and dst == BF16:
            out.append(f"{name}: its shard cast {src} -> {dst} {n} times")
    return out


def _zero3_census(rank: int, world: int) -> dict[str, Any]:
    """A rank's census of one ZeRO-3 step (FSDP2 mixed precision: blocks gathered in bf16),
    and what the policy's gathers look like with and without tests/faults.py's
    ``fsdp_root_in_bf16`` (the root gathered in bf16)."""
    import multirank as mr

    out: dict[str, Any] = {}
    for fault in (None, ("plant", None, "fsdp_root_in_bf16")):
        undo: list = []
        mr._plant(fault, rank, undo)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                trainer = Trainer(
                    micro_config(
                        tmp, "train.steps=1", *OPTIONS, "parallel.zero_stage=3", "moe.kernels=torch"
                    )
                )
                part = trainer.engine.parts[0]
                gathered, remove = _gathered_dtypes(part)
                with StepCensus(params=list(part.named_parameters()), contracts=True) as c:
                    trainer.train_step()
                remove()
                trainer.close()
        finally:
            for restore in reversed(undo):
                restore()
        problems = gather_dtype_problems(gathered, dict(c.weight_casts))
        if fault is not None:
            out["planted"] = problems
            out["planted_flops"] = (c.flops_by_dtype(), dict(c.mismatched), c.contract_failures)
            continue
        out.update(
            flops=c.flops_by_dtype(),
            named=_named_fp32_flops(trainer),
            mismatched=dict(c.mismatched),
            refused=c.contract_failures,
            report=c.report(),
            gathered=gathered,
            problems=problems,
        )
    return out


@pytest.fixture(scope="module")
def zero3() -> list[dict[str, Any]]:
    from multirank import run_ranks

    return run_ranks(_zero3_census, 2, timeout=280)


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_under_fsdp2_mixed_precision_too(zero3) -> None:
    """The same step under ZeRO-3 on 2 ranks: FSDP2 hands the blocks' weights over in bf16
    and the root's and routers' in fp32 (observed: the dtype each module's parameters have
    when its forward runs, and no cast of those shards to bf16); every rank's matmuls are
    bf16 but the named ones."""
    for rank, r in enumerate(zero3):
        assert not r["problems"], (rank, r["problems"])
        assert {d for n, d in r["gathered"].items() if n.startswith("tok_embeddings.")} == {
            torch.float32}, (rank, r["gathered"])  # fmt: skip
        assert set(r["gathered"].values()) == {torch.float32, BF16}, (rank, r["gathered"])
        assert set(r["flops"]) == {torch.float32, BF16}, (rank, r["report"])
        assert r["flops"][torch.float32] == r["named"], (rank, r["report"])
        assert not r["mismatched"] and not r["refused"], (rank, r["report"])


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_the_root_gathered_in_bf16_is_caught(zero3) -> None:
    """tests/faults.py ``fsdp_root_in_bf16`` (ZeRO-3 gathers the embeddings, final norm and
    head in bf16; every matmul's operands stay what they were, so the FLOPs by dtype cannot
    see it): the root's parameters are named, each by its gather and by its shard's cast."""
    for rank, r in enumerate(zero3):
        flops, mismatched, refused = r["planted_flops"]  # what the census saw: the same
        assert flops == r["flops"] and not mismatched and not refused, (rank, r["planted_flops"])
        want = [
            f"{name} gathered in {BF16}, the policy's {torch.float32}"
            for name in ("norm.weight", "output.weight", "tok_embeddings.weight")
        ]
        assert [p for p in r["planted"] if "gathered" in p] == want, (rank, r["planted"])
        assert {p.split(":")[0] for p in r["planted"] if "cast" in p} == {
            "norm.weight",
            "output.weight",
            "tok_embeddings.weight",
        }, (rank, r["planted"])
