"""The hardware a plan is priced on: one table of constants per GPU, every one an input.

Datasheet figures are the vendor's; the achievable fractions are what published
measurements reach (each row names its source; docs/plan.md lists them all). Any field can be
overridden on the command line (``moetrain plan --gpu h100 --set nvlink_gbs=400``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


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
    runtime_reserve_gb: float = 2.0
    """Memory the CUDA context, NCCL's buffers and the caching allocator's fragmentation
    take besides the tensors (moetrain's allowance: the CUDA context alone is about 0.5 GB,
    NCCL allocates per communicator; PyTorch's memory notes)."""


# Datasheets: NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOP/s BF16 dense, 1,979 FP8,
# 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s = 450 per direction); H200 (141 GB HBM3e at 4.8
# TB/s, same compute and NVLink); H800 (H100's compute, NVLink cut to 400 GB/s; DeepSeek-V3
# report: 160 GB/s achievable NVLink, 50 GB/s InfiniBand per GPU); B200 (HGX B200: 2.25
# PFLOP/s BF16 dense, 4.5 FP8, 180 GB HBM3e at 7.7 TB/s, NVLink 5 1.8 TB/s = 900 per
# direction); A100 SXM 80 GB (312 TFLOP/s BF16, 2.04 TB/s, NVLink 600 GB/s). Network: 8 x
# ConnectX-7 400 Gb/s (50 GB/s) per DGX/HGX H100, H200 and B200 node.
GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("h100", 989.0, 1979.0, 80.0, 3.35, 450.0, 50.0),
        GPU("h200", 989.0, 1979.0, 141.0, 4.8, 450.0, 50.0),
        GPU("h800", 989.0, 1979.0, 80.0, 3.35, 200.0, 50.0),
        GPU("b200", 2250.0, 4500.0, 180.0, 7.7, 900.0, 50.0),
        GPU("a100", 312.0, 0.0, 80.0, 2.04, 300.0, 25.0),
    )
}

OVERLAP = {"dp": 0.0, "dp_fsdp": 0.8, "tp": 0.0, "cp": 0.0, "ep": 0.0, "pp": 0.9}
"""Fraction of each axis's communication hidden behind computation, moetrain's own code:
ZeRO-0/1 reduce after backward (``GradientSync``: nothing hidden); FSDP2 prefetches its
all-gathers and reduce-scatters on a side stream (most of it hidden); tensor and context
parallelism and the expert all-to-all sit between the layers' matmuls (nothing hidden;
``parallel.overlap_shared_experts`` hides the all-to-all behind the shared experts, counted
where it applies); pipeline sends and receives overlap the next micro-batch."""


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
