"""The hardware a plan is priced on: one table of constants per GPU, every one an input,
and the rates measured on it.

Datasheet figures are the vendor's; the achievable fractions are what published
measurements reach (each row names its source; docs/plan.md lists them all). Any field can be
overridden on the command line (``moetrain plan --gpu h100 --set nvlink_gbs=400``).

``rates`` gives the speed of each kind of work a step does (expert GEMMs, attention, other
matmuls, by dtype; copies) on a GPU, each with its source: the rows measured on its
architecture (``moetrain.kernels.measured``, generated from docs/data/benchmarks.csv) where they
exist, else a datasheet figure times a stated efficiency.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moetrain.kernels.selection import MoEShape


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float
    """Dense BF16 tensor-core peak, TFLOP/s (datasheet, without sparsity)."""
    fp8_tflops: float
    """Dense FP8 tensor-core peak, TFLOP/s (datasheet); moetrain trains in bf16, shown for
    reference."""
    memory_gb: float
    """HBM per GPU, GB (10^9 bytes)."""
    hbm_tbs: float
    """HBM bandwidth, TB/s."""
    nvlink_gbs: float
    """NVLink bandwidth per GPU and direction, GB/s."""
    ib_gbs: float
    """Network bandwidth per GPU and direction, GB/s (one NIC per GPU, rail-optimised)."""
    matmul_efficiency: float = 0.6
    """Fraction of ``bf16_tflops`` the model's matmuls reach (grouped expert GEMMs, attention,
    projections): DeepGEMM's bf16 grouped GEMM 657-670 TFLOP/s and torch._grouped_mm 597-624
    on H200 (deepseek-ai/DeepGEMM), 0.60-0.68 of 989; measured dense bf16 matmuls reach
    about 0.8 (NVIDIA's H100 MLPerf-era GEMM figures)."""
    comm_efficiency: float = 0.8
    """Fraction of a link's bandwidth a collective reaches (bus bandwidth): NCCL all-reduce
    on 8 x H100 NVLink about 360-370 GB/s of 450 (nccl-tests), DeepEP's all-to-all 153-158
    GB/s of H800's 160 GB/s NVLink and 43-58 of 50 GB/s RDMA (deepseek-ai/DeepEP)."""
    fp32_tflops: float = 0.0
    """FP32 peak without tensor cores, TFLOP/s (datasheet): where fp32 matmuls run (torch
    keeps TF32 off by default)."""
    arch: str = ""
    """Compute capability as the measured table names it ("sm_90")."""
    attention_efficiency: float = 0.5
    """Fused attention's rate as a fraction of the measured dense bf16 matmul (of
    ``matmul_efficiency`` x peak without rows), on the FLOPs the plan counts (causal: half
    the square). No attention row is measured yet; FlashAttention-3 reaches 0.52-0.78 of the
    H100's peak at head dim 128, sequences 512-16K (Shah et al. 2024, its benchmark table);
    shorter causal sequences sit at the low end."""
    copy_efficiency: float = 0.9
    """Fraction of ``hbm_tbs`` a copy reaches where none was measured (an H100 copies at
    3,003 GB/s of 3,350 in docs/data/benchmarks.csv: 0.90)."""
    runtime_reserve_gb: float = 2.0
    """Memory the CUDA context, NCCL's buffers and the caching allocator's fragmentation
    take besides the tensors (moetrain's allowance: the CUDA context alone is about 0.5 GB,
    NCCL allocates per communicator; PyTorch's memory notes)."""


# Datasheets: NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOP/s BF16 dense, 1,979 FP8,
# 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s = 450 per direction); H200 (141 GB HBM3e at 4.8
# TB/s, same compute and NVLink); H800 (H100's compute, NVLink cut to 400 GB/s; DeepSeek-V3
# report: 160 GB/s achievable NVLink, 50 GB/s InfiniBand per GPU); B200 (HGX B200: 2.25
# PFLOP/s BF16 dense, 4.5 FP8, 180 GB HBM3e at 7.7 TB/s, NVLink 5 1.8 TB/s = 900 per
# direction); A100 SXM 80 GB (312 TFLOP/s BF16, 2.04 TB/s, NVLink 600 GB/s). FP32 (no tensor
# cores): H100/H200/H800 SXM 67 TFLOP/s, HGX B200 75, A100 19.5. Network: 8 x
# ConnectX-7 400 Gb/s (50 GB/s) per DGX/HGX H100, H200 and B200 node. L40 (a PCIe card, Ada
# sm_89: 181 TFLOP/s BF16 dense, 362 FP8, FP32 90.5, 48 GB GDDR6 at 864 GB/s; no NVLink, so
# its GPUs talk over PCIe Gen4 x16, 32 GB/s per direction; the network is an assumption, one
# 200 Gb/s NIC per GPU as the A100 row's). The one table of GPU peaks: ``moetrain plan``
# prices with it and the trainer's MFU divides by its ``bf16_tflops`` (``gpu_of_device``).
GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("h100", 989.0, 1979.0, 80.0, 3.35, 450.0, 50.0, fp32_tflops=67.0, arch="sm_90"),
        GPU("h200", 989.0, 1979.0, 141.0, 4.8, 450.0, 50.0, fp32_tflops=67.0, arch="sm_90"),
        GPU("h800", 989.0, 1979.0, 80.0, 3.35, 200.0, 50.0, fp32_tflops=67.0, arch="sm_90"),
        GPU("b200", 2250.0, 4500.0, 180.0, 7.7, 900.0, 50.0, fp32_tflops=75.0, arch="sm_100"),
        GPU("a100", 312.0, 0.0, 80.0, 2.04, 300.0, 25.0, fp32_tflops=19.5, arch="sm_80"),
        GPU("l40", 181.0, 362.0, 48.0, 0.864, 32.0, 25.0, fp32_tflops=90.5, arch="sm_89"),
    )
}

OVERLAP = {"dp": 0.0, "dp_fsdp": 0.8, "tp": 0.0, "cp": 0.0, "ep": 0.0, "pp": 0.9}
"""Fraction of each axis's communication hidden behind computation, moetrain's own code:
ZeRO-0/1 reduce after backward (``GradientSync``: nothing hidden); FSDP2 prefetches its
all-gathers and reduce-scatters on a side stream (most of it hidden); tensor and context
parallelism and the expert all-to-all sit between the layers' matmuls (nothing hidden;
shared experts hide half the all-to-all, computed during the combine's trip or, with
``parallel.overlap_shared_experts``, the dispatch's; ``parallel.ep_overlap=halves`` hides it
behind the other half of the micro-batch, counted where it applies:
``estimate.halves_exposed``); pipeline sends and receives overlap the next micro-batch."""


def gpu(name: str, overrides: dict[str, float] | None = None) -> GPU:
    """The named GPU with ``overrides`` applied (field name -> value)."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"--gpu: {name!r} is not one of {', '.join(GPUS)}")
    g = GPUS[key]
    if overrides:
        fields = {f.name for f in dataclasses.fields(GPU)} - {"name"}
        bad = sorted(set(overrides) - fields)
        if bad:
            raise ValueError(
                f"--set: {bad[0]} is not a GPU constant; they are {', '.join(sorted(fields))}"
            )
        g = dataclasses.replace(g, **overrides)
    return g


def gpu_of_device(device_name: str) -> GPU | None:
    """The table's GPU that a CUDA device name names ("NVIDIA H100 80GB HBM3" is h100, "NVIDIA
    B200" b200), or None for a GPU the table does not have."""
    name = device_name.lower()
    return next((g for g in GPUS.values() if g.name in name), None)


@dataclass(frozen=True)
class Rate:
    """How fast one kind of work runs: ``value`` TFLOP/s (matmuls) or GB/s (copies), and
    where the figure comes from (a measured row, or a datasheet figure and an assumption)."""

    value: float
    source: str
    measured: bool = False


def _nearest(rows: list[dict], features: dict[str, float]) -> dict:
    from moetrain.kernels.selection import _distance

    return min(rows, key=lambda r: _distance(features, r["features"]))


def rates(g: GPU, shape: MoEShape | None, kernels: str = "auto") -> dict[str, Rate]:
    """The rates of ``g`` for a model whose MoE layers have ``shape`` (None: no experts),
    keyed "<class>/<dtype>" (classes experts, attention, matmul; dtypes bfloat16, float32)
    and "copy". ``kernels``: ``moe.kernels`` (auto: each grouped GEMM on the implementation
    the measured table picks, ``moetrain.kernels.selection``)."""
    from moetrain.kernels import measured
    from moetrain.kernels.selection import choose

    rows = [r for r in measured.RATES if r["arch"] == g.arch]
    gemm = [r for r in rows if r["kind"] == "grouped_mm"]
    dense = [r for r in rows if r["kind"] == "dense" and r["features"]]
    ceiling = next((r for r in rows if r["kind"] == "dense" and r["case"] == "8192^3"), None)
    copy = next((r for r in rows if r["kind"] == "copy"), None)
    out: dict[str, Rate] = {}
    assumed = g.bf16_tflops * g.matmul_efficiency
    no_rows = f"assumed: no measured rows for {g.arch or g.name}"
    bf16_matmul = Rate(assumed, f"{no_rows}; bf16 peak {g.bf16_tflops:g} x matmul_efficiency "
                                f"{g.matmul_efficiency:g}")  # fmt: skip
    out["experts/bfloat16"] = out["matmul/bfloat16"] = bf16_matmul
    if gemm and shape is not None:
        feats = shape.features("grouped_mm_fwd")
        pick = choose(g.arch, shape) if kernels == "auto" else None
        parts, srcs = [], []
        for op in ("fwd", "dgrad", "wgrad"):
            impl = getattr(pick, op).backend if pick is not None else kernels
            mine = [r for r in gemm if r["op"] == op and r["impl"] == impl]
            if not mine:
                break
            r = _nearest(mine, feats)
            parts.append(r["tflops"])
            srcs.append(f"{op} {impl} {r['tflops']:g} on the {r['case']} class ({r['rows']})")
        if len(parts) == 3:  # fwd, dgrad, wgrad: a third of the FLOPs each
            value = 3 / sum(1 / p for p in parts)
            out["experts/bfloat16"] = Rate(value, "measured: " + "; ".join(srcs), True)
    if dense:
        feats = shape.features("grouped_mm_fwd") if shape is not None else dense[0]["features"]
        r = _nearest(dense, feats)
        out["matmul/bfloat16"] = Rate(
            r["tflops"], f"measured: dense matmul of the {r['case']} class ({r['rows']})", True
        )
    if ceiling is not None:
        frac = ceiling["tflops"] / g.bf16_tflops
        why = (f"FP32 peak {g.fp32_tflops:g} x the measured dense bf16 ceiling's fraction of "
               f"its peak, {frac:.3f} ({ceiling['rows']})")  # fmt: skip
        fp32 = Rate(g.fp32_tflops * frac, why)
        attention = Rate(ceiling["tflops"] * g.attention_efficiency, "assumed: attention_"
                         f"efficiency {g.attention_efficiency:g} x the measured dense ceiling "
                         f"{ceiling['tflops']:g} ({ceiling['rows']})")  # fmt: skip
    else:
        fp32 = Rate(g.fp32_tflops * g.matmul_efficiency, f"{no_rows}; FP32 peak "
                    f"{g.fp32_tflops:g} x matmul_efficiency {g.matmul_efficiency:g}")  # fmt: skip
        attention = Rate(assumed * g.attention_efficiency, f"{no_rows}; attention_efficiency "
                         f"{g.attention_efficiency:g} x {assumed:g}")  # fmt: skip
    for cls in ("experts", "attention", "matmul"):
        out[f"{cls}/float32"] = fp32
    out["attention/bfloat16"] = attention
    if copy is not None:
        out["copy"] = Rate(copy["gbs"], f"measured: copy bandwidth ({copy['rows']})", True)
    else:
        why = f"{no_rows}; HBM {g.hbm_tbs:g} TB/s x copy_efficiency {g.copy_efficiency:g}"
        out["copy"] = Rate(g.hbm_tbs * 1e3 * g.copy_efficiency, why)
    return out


def rate_of(table: dict[str, Rate], cls: str, dtype: str) -> Rate:
    """The rate of ``cls`` in ``dtype`` (fp16 and fp8 at bf16's: the tensor-core rates)."""
    key = f"{cls}/{dtype}"
    return table.get(key) or table[f"{cls}/bfloat16"]
