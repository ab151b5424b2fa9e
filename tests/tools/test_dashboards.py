"""The TensorBoard dashboard a run writes: the custom-scalars layout, the token-share heatmap
image, router-score histograms, dead experts over a window, and the log warnings."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MICRO
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from moetrain.config import LogConfig, load_config
from moetrain.model.moe import MoELayer
from moetrain.train.metrics import MetricsWriter, read_scalars
from moetrain.train.trainer import Trainer


def micro(out: Path, **extra) -> list[str]:
    values = {**MICRO, **extra, "train.output_dir": str(out)}
    return [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
            for k, v in values.items()]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def dashboard_run(tmp_path_factory) -> tuple[Path, list[logging.LogRecord]]:
    """A 4-step micro run with dashboards every 2 steps and an imbalance threshold of 1.0."""
    out = tmp_path_factory.mktemp("dashboard")
    cfg = load_config(None, micro(out, **{"train.steps": 4, "log.imbalance_warn_threshold": 1.0}))
    handler = _Records()
    logger = logging.getLogger("moetrain")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        Trainer(cfg).fit()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return out, handler.records


def _acc(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tb"),
                           size_guidance={"images": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_imbalance_warnings_fire_in_a_run(dashboard_run) -> None:
    _, records = dashboard_run
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    for layer in (0, 1):
        # Threshold 1.0: the first step is already over it; it warns once while it stays over.
        over = [m for m in warnings if m.startswith(f"moe layer {layer}: load imbalance")]
        assert over and over[0].endswith("passed log.imbalance_warn_threshold=1 at step 1")


def test_custom_scalars_layout_is_in_the_event_files(dashboard_run) -> None:
    run_dir, _ = dashboard_run
    scalars = read_scalars(run_dir)
    acc = _acc(run_dir)
    # Custom-scalars layout: one category per MoE layer, each chart on tags that exist.
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    categories = {c.title: c for c in layout.category}
    assert set(categories) == {"training", "MoE layer 0", "MoE layer 1"}
    charts = {ch.title: list(ch.multiline.tag) for ch in categories["MoE layer 1"].chart}
    assert charts["load imbalance (max/mean, CV)"] == ["moe/layer1/max_over_mean",
                                                       "moe/layer1/cv"]
    assert charts["expert bias"] == [r"moe/layer1/expert_bias/expert\d+"]
    for name in ("dropped-token fraction", "router entropy", "dead experts", "aux and z losses",
                 "token share per expert"):
        assert name in charts
    for tags in charts.values():
        for tag in tags:
            if "\\d" not in tag:
                assert tag in scalars, tag


def test_token_share_heatmap_images_are_written(dashboard_run) -> None:
    images = _acc(dashboard_run[0]).Images("moe/token_share_heatmap")
    assert [im.step for im in images] == [2, 4]
    pixels = np.asarray(Image.open(io.BytesIO(images[-1].encoded_image_string)))
    assert pixels.shape[2] in (3, 4) and pixels.shape[0] > 150 and pixels.std() > 10


def test_router_score_histograms_are_written(dashboard_run) -> None:
    acc = _acc(dashboard_run[0])
    # Every 2 steps, over all T*E scores of the 2 steps since the last one.
    tokens_per_step = MICRO["train.global_batch_size"] * MICRO["data.seq_len"]
    for layer in (0, 1):
        tag = f"moe/layer{layer}/router_scores"
        assert tag in acc.Tags()["histograms"], "MoELayer.pop_stats()['score_hist'] lost"
        hists = acc.Histograms(tag)
        assert [h.step for h in hists] == [2, 4]
        for h in hists:
            v = h.histogram_value
            assert v.num == sum(v.bucket) == 2 * tokens_per_step * MICRO["moe.num_experts"]
            assert v.bucket_limit[-1] == 1.0
            # Softmax scores of a token sum to 1: the mean score is 1/E (bin centres blur it).
            assert abs(v.sum / v.num - 1 / MICRO["moe.num_experts"]) < 0.05


def test_forced_dead_expert_is_counted_and_warned(tmp_path: Path, caplog) -> None:
    """A real MoE layer whose expert 3 is never selected (its selection bias, used when
    moe.expert_bias_rate > 0, is far below any score), fed to the writer step by step."""
    cfg = load_config(None, micro(tmp_path)).moe
    torch.manual_seed(0)
    layer = MoELayer(16, cfg)
    layer.router.expert_bias[3] = -100.0
    writer = MetricsWriter(tmp_path / "tb", LogConfig(dead_expert_window=2, heatmap_every=0,
                                                      histogram_every=2))
    with caplog.at_level(logging.INFO, logger="moetrain"):
        for step in range(1, 5):
            layer(torch.randn(4, 8, 16))
            stats = layer.pop_stats()
            assert stats["tokens_per_expert"][3] == 0 and stats["tokens_per_expert"].sum() == 64
            writer.moe_layers({5: stats}, step)
    writer.close()
    dead = [r.getMessage() for r in caplog.records if "is dead" in r.getMessage()]
    assert dead == ["moe layer 5: expert 3 is dead (no tokens in the last 2 steps) at step 2"]
    scalars = read_scalars(tmp_path)
    assert [v for _, v in scalars["moe/layer5/dead_experts"]] == [0.0, 1.0, 1.0, 1.0]
    assert [v for _, v in scalars["moe/layer5/tokens/expert3"]] == [0.0] * 4
    # The layer's score histogram reaches the writer: 2 steps x 32 tokens x 4 experts.
    hists = _acc(tmp_path).Histograms("moe/layer5/router_scores")
    assert [(h.step, h.histogram_value.num) for h in hists] == [(2, 256), (4, 256)]


def _stats(tokens: list[float]) -> dict[str, torch.Tensor]:
    z = torch.zeros(())
    return {"tokens_per_expert": torch.tensor(tokens), "expert_bias": torch.zeros(len(tokens)),
            "calls": torch.ones(()), "assignments": torch.tensor(sum(tokens)), "dropped": z,
            "aux_loss": z, "seq_aux_loss": z, "z_loss": z, "entropy": z}


def test_dead_experts_window_and_warnings_rearm(tmp_path: Path, caplog) -> None:
    writer = MetricsWriter(tmp_path / "tb", LogConfig(dead_expert_window=3,
                                                      imbalance_warn_threshold=1.5,
                                                      heatmap_every=0, histogram_every=0))
    loads = [[4, 4, 0, 4], [4, 4, 0, 4], [4, 4, 0, 4], [4, 4, 0, 4], [3, 3, 3, 3],
             [4, 4, 0, 4], [8, 2, 1, 1], [9, 1, 1, 1], [3, 3, 3, 3], [9, 1, 1, 1]]
    with caplog.at_level(logging.INFO, logger="moetrain"):
        for step, load in enumerate(loads, start=1):
            writer.moe_layers({0: _stats(load)}, step)
    writer.close()
    dead = [(r.levelname, r.getMessage()) for r in caplog.records if "expert 2" in r.getMessage()]
    assert dead == [
        ("WARNING", "moe layer 0: expert 2 is dead (no tokens in the last 3 steps) at step 3"),
        ("INFO", "moe layer 0: expert 2 receives tokens again at step 5"),
    ]
    over = [r.getMessage() for r in caplog.records if "imbalance" in r.getMessage()]
    # max/mean at steps 7-10: 2.67 (warns), 3.0 (still over), 1.0 (re-arms), 3.0 (warns again:
    # a repeat of its kind, summarised in the line close() flushes).
    assert [m.split("max/mean ")[1].split(" ")[0] for m in over] == ["2.67", "3.00"]
    assert [int(m.rsplit(" ", 1)[1]) for m in over] == [7, 10]
    dead_scalar = [v for _, v in read_scalars(tmp_path)["moe/layer0/dead_experts"]]
    assert dead_scalar == [0, 0, 1, 1, 0, 0, 0, 0, 0, 0]
