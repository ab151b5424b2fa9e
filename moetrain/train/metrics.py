"""Training metrics: MoE router statistics turned into scalars, TensorBoard writing, MFU.

The MoE layers hand over raw sums (``MoELayer.pop_stats``); this module derives the
per-layer figures users look at: load imbalance, coefficient of variation, dropped
fraction, router entropy, the balancing losses and the expert bias.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

# bf16 dense tensor-core peaks (FLOP/s) by device-name fragment; ANCHORS.md.
_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "L40": 181e12}


def layer_summary(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-layer figures from one layer's accumulated ``pop_stats`` sums."""
    calls = max(float(stats["calls"]), 1.0)
    load_E = stats["tokens_per_expert"].double()
    mean = load_E.mean().item()
    out = {
        "max_over_mean": (load_E.max().item() / mean) if mean > 0 else 0.0,
        "cv": (load_E.std(unbiased=False).item() / mean) if mean > 0 else 0.0,
        "dropped_fraction": float(stats["dropped"]) / max(float(stats["assignments"]), 1.0),
        "router_entropy": float(stats["entropy"]) / calls,
        "aux_loss": float(stats["aux_loss"]) / calls,
        "seq_aux_loss": float(stats["seq_aux_loss"]) / calls,
        "z_loss": float(stats["z_loss"]) / calls,
        "dead_experts": float((load_E == 0).sum()),
    }
    return out


def merge_stats(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add two layers' ``pop_stats`` sums (the expert bias is a state, not a sum: keep b's)."""
    if a is None:
        return {k: v.clone() for k, v in b.items()}
    return {k: (b[k].clone() if k == "expert_bias" else a[k] + b[k]) for k in b}


def peak_flops(device: torch.device) -> tuple[float, str]:
    """Peak FLOP/s for the MFU denominator and where it came from.

    On a known GPU: its bf16 dense peak. Elsewhere: a dense fp32 matmul measured now,
    so on a CPU 'MFU' reads as a fraction of what this machine's matmul actually reaches.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for frag, flops in _PEAK_FLOPS.items():
            if frag in name:
                return flops, f"{name} bf16 peak"
    n = 1024
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b  # warm-up
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.2:
        a @ b
        reps += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start), "measured fp32 matmul"


class MetricsWriter:
    """TensorBoard writer for scalars and per-layer MoE figures (rank 0 only)."""

    def __init__(self, log_dir: Path | None):
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def moe_layers(self, per_layer: dict[int, dict[str, torch.Tensor]], step: int) -> None:
        if self.writer is None:
            return
        for layer, stats in sorted(per_layer.items()):
            prefix = f"moe/layer{layer}"
            for name, value in layer_summary(stats).items():
                self.writer.add_scalar(f"{prefix}/{name}", value, step)
            load_E = stats["tokens_per_expert"].double()
            share_E = load_E / load_E.sum().clamp_min(1)
            for e, (share, bias) in enumerate(zip(share_E.tolist(), stats["expert_bias"].tolist())):
                self.writer.add_scalar(f"{prefix}/tokens/expert{e}", share, step)
                self.writer.add_scalar(f"{prefix}/expert_bias/expert{e}", bias, step)
            # One bucket per expert: the histogram view shows the load across experts.
            E = load_E.numel()
            self.writer.add_histogram_raw(
                f"{prefix}/tokens_per_expert", min=0, max=E - 1, num=int(load_E.sum()),
                sum=float((torch.arange(E) * load_E).sum()),
                sum_squares=float((torch.arange(E) ** 2 * load_E).sum()),
                bucket_limits=[e + 0.5 for e in range(E)], bucket_counts=load_E.tolist(),
                global_step=step,
            )

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def format_log_line(step: int, total: int, values: dict[str, Any]) -> str:
    parts = [f"step {step}/{total}"]
    for key, fmt in (("loss", "{:.4f}"), ("eval_loss", "{:.4f}"), ("aux", "{:.4f}"),
                     ("lr", "{:.2e}"), ("grad_norm", "{:.3f}"), ("tokens_per_s", "{:,.0f}"),
                     ("mfu", "{:.1%}"), ("max_over_mean", "{:.2f}"), ("dropped", "{:.2%}")):
        if key in values:
            parts.append(f"{key} " + fmt.format(values[key]))
    return " | ".join(parts)
