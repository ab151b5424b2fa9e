"""Training metrics: MoE router statistics turned into scalars, TensorBoard writing, MFU.

The MoE layers hand over raw sums (``MoELayer.pop_stats``); this module derives the
per-layer figures users look at: load imbalance, coefficient of variation, dropped
fraction, router entropy, the balancing losses and the expert bias. It also writes the
expert-load dashboard (a custom-scalars layout, a layer x expert token-share heatmap image,
router-score histograms), warns when an expert dies or a layer's imbalance passes
``log.imbalance_warn_threshold``, and reads a run's scalars back for the tools.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetrain.config import LogConfig
from moetrain.model.losses import GlobalBalanceLoss
from moetrain.model.moe_stats import MAX_NAMES
from moetrain.plan.hardware import gpu_of_device

log = logging.getLogger("moetrain")



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
        "global_aux_loss": global_aux_loss(stats),
        "z_loss": float(stats["z_loss"]) / calls,
        "dead_experts": float((load_E == 0).sum()),
        # Expert-parallel dispatch: token bytes this layer sent to other ranks, summed over
        # the dp ranks and pipeline stages of one tp index (tp ranks each send as much).
        "a2a_bytes": float(stats["a2a_bytes"]) if "a2a_bytes" in stats else 0.0,
    }
    if "recv_rows" in stats:
        # Rows a rank's experts received in one forward (under expert parallelism from its
        # whole EP group): the largest over ranks and micro-batches, and over their mean.
        # The largest is the receive buffer a dropless step needed.
        mean_rows = float(stats["recv_rows"]) / calls
        out["recv_rows_max"] = float(stats["recv_rows_max"])
        out["recv_rows_max_over_mean"] = out["recv_rows_max"] / mean_rows if mean_rows else 0.0
    return out


def global_aux_loss(stats: dict[str, torch.Tensor]) -> float:
    """The global-batch balancing loss of one step, E * sum_e f_e * P_e: f_e from the step's
    expert counts (every micro-batch and dp rank, before drops), P_e the mean routing
    probability over the step's micro-batches. Computed whatever its coefficient."""
    if "probs_sum" not in stats:
        return float("nan")
    return GlobalBalanceLoss.value(stats["tokens_per_expert"], stats["probs_sum"], stats["calls"])


def merge_stats(
    a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Add two layers' ``pop_stats`` sums (the expert bias is a state, not a sum: keep b's;
    the ``MAX_NAMES`` take the larger)."""
    if a is None:
        return {k: v.clone() for k, v in b.items()}

    def merged(k: str) -> torch.Tensor:
        if k == "expert_bias":
            return b[k].clone()
        return torch.maximum(a[k], b[k]) if k in MAX_NAMES else a[k] + b[k]

    return {k: merged(k) for k in b}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; a CPU op has finished
    when it returns): a wall-clock time taken after this covers the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(device: torch.device, seconds: float = 0.2) -> tuple[float, str]:
    """Peak FLOP/s for the MFU denominator and where it came from.

    On a GPU of the table ``moetrain plan`` prices with (``moetrain.plan.hardware.GPUS``): its
    bf16 dense datasheet peak. Elsewhere: a dense fp32 matmul measured now for ``seconds``,
    so on a CPU 'MFU' reads as a fraction of what this machine's matmul reaches at the moment
    (the trainer re-measures every log window: a shared CPU's speed varies).
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        gpu = gpu_of_device(name)
        if gpu is not None:
            return gpu.bf16_tflops * 1e12, f"{name} bf16 peak"
    n = 1024
    # Constant operands: drawing random ones would advance the global RNG that router jitter
    # uses, and the run would stop being reproducible across a resume.
    a = torch.full((n, n), 0.5, device=device)
    b = torch.full((n, n), 0.25, device=device)
    a @ b  # warm-up
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        reps += 1
    synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start), "measured fp32 matmul"


def custom_scalars_layout(layers: list[int]) -> dict[str, dict[str, list]]:
    """The TensorBoard custom-scalars layout: a training group, then one group per MoE layer
    with its load imbalance, drops, router entropy, dead experts, losses and expert bias."""
    layout: dict[str, dict[str, list]] = {
        "training": {
            "loss (train, eval)": ["Multiline", ["train/loss", "eval/loss"]],
            "tokens/s": ["Multiline", ["perf/tokens_per_s"]],
        },
    }
    for layer in layers:
        p = f"moe/layer{layer}"
        layout[f"MoE layer {layer}"] = {
            "load imbalance (max/mean, CV)": ["Multiline", [f"{p}/max_over_mean", f"{p}/cv"]],
            "dropped-token fraction": ["Multiline", [f"{p}/dropped_fraction"]],
            "router entropy": ["Multiline", [f"{p}/router_entropy"]],
            "dead experts": ["Multiline", [f"{p}/dead_experts"]],
            "rows received per rank (max/mean)": [
                "Multiline", [f"{p}/recv_rows_max_over_mean"]],
            "aux and z losses": [
                "Multiline",
                [f"{p}/aux_loss", f"{p}/seq_aux_loss", f"{p}/global_aux_loss", f"{p}/z_loss"],
            ],
            "expert bias": ["Multiline", [rf"{p}/expert_bias/expert\d+"]],
            "token share per expert": ["Multiline", [rf"{p}/tokens/expert\d+"]],
        }
    return layout


class WarningSummary:
    """Repeated warnings, summarised: the first warning of each kind (a kind is, e.g., "load
    imbalance in MoE layer 3") is logged as it happens; later ones of the same kind are
    counted and logged once per log window by ``flush()``, as one line with their count,
    the steps they span and the last message."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.pending: dict[str, list[Any]] = {}  # kind -> [count, first step, last step, msg]

    def warn(self, kind: str, step: int, msg: str, *args: Any) -> None:
        if kind not in self.seen:
            self.seen.add(kind)
            log.warning(msg, *args)
            return
        entry = self.pending.setdefault(kind, [0, step, step, ""])
        entry[0] += 1
        entry[2] = step
        entry[3] = msg % args

    def flush(self) -> None:
        """Log one line per kind that repeated since the last flush."""
        for kind, (count, first, last, msg) in self.pending.items():
            steps = f"step {first}" if first == last else f"steps {first}-{last}"
            log.warning("%s: %d more time%s (%s); last: %s", kind, count,
                        "" if count == 1 else "s", steps, msg)
        self.pending.clear()


class ExpertLoadMonitor:
    """Dead experts over a sliding window of steps, and imbalance warnings, per layer.

    An expert is dead when it received no tokens in the last ``window`` steps (counted from
    the first step this monitor saw). A warning is raised when an expert dies and when a
    layer's max/mean load rises past ``imbalance_threshold``; each fires again only after
    the expert has come back or the imbalance has fallen back under the threshold, and
    repeats are summarised (``WarningSummary``: the first of a kind is logged, later ones
    counted per log window).
    """

    def __init__(self, window: int, imbalance_threshold: float | None,
                 warnings: WarningSummary | None = None):
        self.warnings = warnings or WarningSummary()
        self.window = window
        self.imbalance_threshold = imbalance_threshold
        self.last_active: dict[int, torch.Tensor] = {}  # layer -> step each expert last had tokens
        self.dead: dict[int, set[int]] = {}
        self.over: dict[int, bool] = {}

    def update(self, layer: int, load_E: torch.Tensor, max_over_mean: float, step: int) -> int:
        """Record one step of a layer's load; log what changed; return its dead-expert count."""
        if layer not in self.last_active:
            # Before the first step seen, count every expert as active: a window must pass.
            self.last_active[layer] = torch.full((load_E.numel(),), step - 1, dtype=torch.long)
            self.dead[layer] = set()
            self.over[layer] = False
        last = self.last_active[layer]
        last[load_E.cpu() > 0] = step
        dead_now = set(torch.nonzero(step - last >= self.window).flatten().tolist())
        for e in sorted(dead_now - self.dead[layer]):
            self.warnings.warn(
                f"moe layer {layer}: dead experts",
                step,
                "moe layer %d: expert %d is dead (no tokens in the last %d steps) at step %d",
                layer,
                e,
                self.window,
                step,
            )
        for e in sorted(self.dead[layer] - dead_now):
            log.info("moe layer %d: expert %d receives tokens again at step %d", layer, e, step)
        self.dead[layer] = dead_now
        t = self.imbalance_threshold
        if t is not None:
            over = max_over_mean > t
            if over and not self.over[layer]:
                self.warnings.warn(
                    f"moe layer {layer}: load imbalance past log.imbalance_warn_threshold",
                    step,
                    "moe layer %d: load imbalance max/mean %.2f passed "
                    "log.imbalance_warn_threshold=%g at step %d",
                    layer,
                    max_over_mean,
                    t,
                    step,
                )
            self.over[layer] = over
        return len(dead_now)


def render_share_heatmap(share_LE: np.ndarray, layers: list[int], title: str) -> np.ndarray:
    """A layer x expert token-share heatmap as an RGB image (H, W, 3) uint8 (Agg, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    L, E = share_LE.shape
    fig = Figure(figsize=(max(4.0, 0.5 * E + 2.0), max(2.5, 0.45 * L + 1.5)), dpi=100)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(
        share_LE, aspect="auto", cmap="viridis", vmin=0.0, vmax=max(float(share_LE.max()), 2.0 / E)
    )
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_xticks(range(E))
    ax.set_yticks(range(L), [str(layer) for layer in layers])
    ax.set_title(title, fontsize=9)
    if L * E <= 256:
        for (i, j), v in np.ndenumerate(share_LE):
            ax.text(
                j,
                i,
                f"{v:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if v < share_LE.max() * 0.6 else "black",
            )
    fig.colorbar(im, ax=ax, label="token share")
    fig.tight_layout()
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[:, :, :3].copy()


class MetricsWriter:
    """TensorBoard writer for scalars and the per-layer MoE dashboard (rank 0 only).

    The expert-load monitor (dead experts, imbalance warnings) runs even without a
    TensorBoard directory, so the warnings reach the log either way.
    """

    def __init__(self, log_dir: Path | None, log_cfg: LogConfig | None = None):
        cfg = log_cfg or LogConfig()
        self.heatmap_every = cfg.heatmap_every
        self.histogram_every = cfg.histogram_every
        self.warnings = WarningSummary()
        self.monitor = ExpertLoadMonitor(
            cfg.dead_expert_window, cfg.imbalance_warn_threshold, self.warnings
        )
        self._layout_written = False
        # Sums since the last heatmap image / score histogram, per layer.
        self._heat_tokens: dict[int, torch.Tensor] = {}
        self._score_hist: dict[int, torch.Tensor] = {}
        self.writer = None
        if log_dir is not None:
            self.open(log_dir)

    def open(self, log_dir: Path) -> None:
        """Start writing TensorBoard events to ``log_dir`` (creates an event file there);
        until then every write is a no-op."""
        from torch.utils.tensorboard import SummaryWriter

        if self.writer is None:
            self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def document_lengths(self, lengths: Any, step: int) -> None:
        """Histogram ``data/document_lengths``: the tokens of each document piece trained on
        since the last one (a document cut by a sequence boundary counts once per
        sequence): what the attention of document masking spans."""
        if self.writer is None:
            return
        self.writer.add_histogram("data/document_lengths", np.asarray(lengths), step)

    def moe_layers(self, per_layer: dict[int, dict[str, torch.Tensor]], step: int) -> None:
        """One training step's per-layer ``pop_stats`` sums: scalars, monitor, dashboard."""
        summaries = {}
        for layer, stats in sorted(per_layer.items()):
            summary = layer_summary(stats)
            summary["dead_experts"] = float(
                self.monitor.update(
                    layer, stats["tokens_per_expert"], summary["max_over_mean"], step
                )
            )
            summaries[layer] = summary
        if self.writer is None or not per_layer:
            return
        if not self._layout_written:
            self.writer.add_custom_scalars(custom_scalars_layout(sorted(per_layer)))
            self._layout_written = True
        for layer, stats in sorted(per_layer.items()):
            prefix = f"moe/layer{layer}"
            for name, value in summaries[layer].items():
                self.writer.add_scalar(f"{prefix}/{name}", value, step)
            load_E = stats["tokens_per_expert"].double().cpu()
            share_E = load_E / load_E.sum().clamp_min(1)
            bias_E = stats["expert_bias"].tolist()
            for e, (share, bias) in enumerate(zip(share_E.tolist(), bias_E, strict=True)):
                self.writer.add_scalar(f"{prefix}/tokens/expert{e}", share, step)
                self.writer.add_scalar(f"{prefix}/expert_bias/expert{e}", bias, step)
            # One bucket per expert: the histogram view shows the load across experts.
            E = load_E.numel()
            self.writer.add_histogram_raw(
                f"{prefix}/tokens_per_expert",
                min=0,
                max=E - 1,
                num=int(load_E.sum()),
                sum=float((torch.arange(E) * load_E).sum()),
                sum_squares=float((torch.arange(E) ** 2 * load_E).sum()),
                bucket_limits=[e + 0.5 for e in range(E)],
                bucket_counts=load_E.tolist(),
                global_step=step,
            )
            self._heat_tokens[layer] = self._heat_tokens.get(layer, 0) + load_E
            if "score_hist" in stats:
                self._score_hist[layer] = (
                    self._score_hist.get(layer, 0) + stats["score_hist"].double().cpu()
                )
        if self.heatmap_every and step % self.heatmap_every == 0:
            self._write_heatmap(step)
        if self.histogram_every and step % self.histogram_every == 0:
            self._write_score_histograms(step)

    def _write_heatmap(self, step: int) -> None:
        layers = sorted(self._heat_tokens)
        share_LE = torch.stack(
            [
                self._heat_tokens[layer] / self._heat_tokens[layer].sum().clamp_min(1)
                for layer in layers
            ]
        ).numpy()
        image = render_share_heatmap(share_LE, layers, f"token share per expert, up to step {step}")
        self.writer.add_image("moe/token_share_heatmap", image, step, dataformats="HWC")
        self._heat_tokens.clear()

    def _write_score_histograms(self, step: int) -> None:
        """Router scores of every (token, expert) pair since the last histogram, per layer."""
        for layer, counts in sorted(self._score_hist.items()):
            n = counts.numel()
            centers = (torch.arange(n, dtype=torch.float64) + 0.5) / n
            self.writer.add_histogram_raw(
                f"moe/layer{layer}/router_scores",
                min=0.0,
                max=1.0,
                num=int(counts.sum()),
                sum=float((centers * counts).sum()),
                sum_squares=float((centers**2 * counts).sum()),
                bucket_limits=((torch.arange(n) + 1.0) / n).tolist(),
                bucket_counts=counts.tolist(),
                global_step=step,
            )
        self._score_hist.clear()

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        self.warnings.flush()  # repeats since the last log window are not lost
        if self.writer is not None:
            self.writer.close()


def format_log_line(step: int, total: int, values: dict[str, Any]) -> str:
    parts = [f"step {step}/{total}"]
    for key, fmt in (
        ("loss", "{:.4f}"),
        ("eval_loss", "{:.4f}"),
        ("aux", "{:.4f}"),
        ("lr", "{:.2e}"),
        ("grad_norm", "{:.3f}"),
        ("tokens_per_s", "{:,.0f}"),
        ("mfu", "{:.1%}"),
        ("max_over_mean", "{:.2f}"),
        ("dropped", "{:.2%}"),
        ("max_logit", "{:.2f}"),
    ):
        if key in values:
            parts.append(f"{key} " + fmt.format(values[key]))
    return " | ".join(parts)


# ----------------------------------------------------------------------------- reading back

SUMMARY_FIGURES = ("max_over_mean", "cv", "dropped_fraction", "router_entropy", "dead_experts")
PEAK_FIGURES = ("max_over_mean", "dropped_fraction", "recv_rows_max_over_mean")
"""Figures whose worst step also counts: early training is where routing goes wrong (one
expert per batch, mass drops) and a second-half mean hides it."""


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a run (``<run_dir>/tb``) as (step, value) sorted by step; where a
    resumed run wrote a step twice, the later write wins."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir) / "tb"), size_guidance={"scalars": 0})
    tb_log = logging.getLogger("tensorboard")
    level = tb_log.level
    tb_log.setLevel(max(level, logging.WARNING))  # it logs each finished event file at INFO
    try:
        acc.Reload()
    finally:
        tb_log.setLevel(level)
    out = {}
    for tag in acc.Tags()["scalars"]:
        by_step = {e.step: e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.wall_time)}
        out[tag] = sorted(by_step.items())
    return out


def moe_layer_ids(scalars: dict[str, list[tuple[int, float]]]) -> list[int]:
    return sorted(
        {
            int(m.group(1))
            for tag in scalars
            if (m := re.fullmatch(r"moe/layer(\d+)/max_over_mean", tag))
        }
    )


def run_summary(scalars: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """A run's figures for comparing runs, from its scalars:

    - ``eval_loss``, ``train_loss``: the last logged value;
    - each of ``SUMMARY_FIGURES``: mean over MoE layers of its mean over the second half of
      training (steps > last_step // 2), which is less noisy than one step;
    - ``peak_<name>`` for each of ``PEAK_FIGURES``: its largest value over every logged step
      and MoE layer (the worst step of the worst layer);
    - ``tokens_per_s``: the median over steps, leaving out step 1 (warm-up) when there are
      more;
    - ``steps``: the last training step.
    """
    nan = float("nan")
    out: dict[str, float] = {}
    for key, tag in (("eval_loss", "eval/loss"), ("train_loss", "train/loss")):
        out[key] = scalars[tag][-1][1] if scalars.get(tag) else nan
    last = scalars["train/loss"][-1][0] if scalars.get("train/loss") else 0
    out["steps"] = float(last)
    layers = moe_layer_ids(scalars)
    for name in SUMMARY_FIGURES:
        per_layer = []
        for layer in layers:
            values = [v for s, v in scalars.get(f"moe/layer{layer}/{name}", []) if s > last // 2]
            if values:
                per_layer.append(sum(values) / len(values))
        out[name] = sum(per_layer) / len(per_layer) if per_layer else nan
    for name in PEAK_FIGURES:
        values = [v for layer in layers for _, v in scalars.get(f"moe/layer{layer}/{name}", [])]
        out[f"peak_{name}"] = max(values) if values else nan
    tok = scalars.get("perf/tokens_per_s", [])
    tok = [v for s, v in tok if s > 1] or [v for _, v in tok]
    out["tokens_per_s"] = statistics.median(tok) if tok else nan
    return {k: (v if math.isfinite(v) else nan) for k, v in out.items()}
