"""bf16 training on CPU: autocast with fp32 master weights tracks the fp32 run.

Every layout under bf16 is checked against one bf16 process in
tests/parallel/test_bf16_layouts.py, what a bf16 step computes (every GEMM in bf16, the
router gates in fp32) in tests/train/test_compute_dtype.py; this file checks bf16 against
fp32 itself.
"""

from __future__ import annotations

import tempfile

import torch
from multirank import micro_config
from threads import one_thread

from moetrain.train.trainer import Trainer

STEPS = 20
LOSS_BOUND = 0.05
"""Per-step |loss_bf16 - loss_fp32| in nats over the first 20 steps of the micro MoE: bf16
rounds every matmul input to 8 bits of mantissa (2^-9 relative), and the runs drift apart as
they train. Measured 0.016 (0.2% of the loss)."""


def _losses(*overrides: str) -> tuple[list[float], Trainer]:
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(micro_config(out, f"train.steps={STEPS}", *overrides))
        losses = [trainer.train_step().loss for _ in range(STEPS)]
        trainer.close()
    return losses, trainer


def test_bf16_loss_tracks_fp32_over_20_steps() -> None:
    with one_thread():  # tiny ops: a second thread only waits on a busy machine
        fp32, _ = _losses()
        bf16, trainer = _losses("train.dtype=bf16")
    assert trainer.dtype == torch.bfloat16
    # Master weights stay fp32 under bf16 autocast.
    assert all(p.dtype == torch.float32 for p in trainer.engine.parts[0].parameters())
    diffs = [abs(a - b) for a, b in zip(bf16, fp32, strict=True)]
    assert max(diffs) <= LOSS_BOUND, (max(diffs), bf16, fp32)
    assert max(diffs) > 0, "bf16 gave the fp32 losses bit for bit: autocast did not run"
    assert bf16[-1] < bf16[0] - 0.5, bf16  # and it trains
