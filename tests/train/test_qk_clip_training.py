"""QK-clip (``optim.qk_clip``) in training: on tiny at learning rates where the attention
logits grow, Muon's and AdamW's largest logit held near tau with the loss no worse
(tools/qk_clip_runs.py, whose longer runs docs/optim.md quotes); the maxima logged per layer
to TensorBoard. The rescale itself: tests/model/test_qk_clip.py; under every layout: the
equivalence matrix (factor "qk_clip")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from qk_clip_runs import run  # noqa: E402

STEPS, TAU = 25, 6.0
LOSS_NOISE = 0.02
"""How much worse the clipped run's eval loss may be: 25 steps of one seed (measured: Muon
+0.005, AdamW -0.135)."""


def _after_first_clip(max_logit: list[float]) -> list[float]:
    """The maxima of the steps after the first one past tau (the first rescale)."""
    first = next(i for i, m in enumerate(max_logit) if m > TAU)
    return max_logit[first + 1 :]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, lr, growth", [("muon", 0.03, 1.6), ("adamw", 0.01, 5.0)])
def test_qk_clip_holds_the_largest_logit_near_tau_with_the_loss_no_worse(
    optimizer: str, lr: float, growth: float
) -> None:
    plain = run(optimizer, lr, None, STEPS)
    clipped = run(optimizer, lr, TAU, STEPS)
    # Without the clip the logits grow well past tau (measured: Muon 3.5 -> 10.9, AdamW
    # 3.5 -> 83) ...
    assert plain["max_logit"][-1] > growth * TAU, plain["max_logit"]
    # ... with it, each step starts from weights whose logits (on the last step's tokens)
    # were tau, and one update moves them by a little: Muon within 27% above tau after the
    # first rescale, AdamW's larger steps within 27% by the last 5.
    held = _after_first_clip(clipped["max_logit"])
    if optimizer == "muon":
        assert held and max(held) < 1.4 * TAU, clipped["max_logit"]
    assert max(held[-5:]) < 1.4 * TAU, clipped["max_logit"]
    assert clipped["eval_loss"] < plain["eval_loss"] + LOSS_NOISE, (clipped, plain)


def test_max_logits_are_logged_per_layer(tmp_path: Path) -> None:
    from micro import micro_config

    from moetrain.train.metrics import read_scalars
    from moetrain.train.trainer import Trainer

    trainer = Trainer(micro_config(tmp_path, "train.steps=2", "optim.qk_clip=0.05",
                                   "log.tensorboard=true"))  # fmt: skip
    trainer.fit()
    scalars = read_scalars(tmp_path)
    for layer in range(4):
        values = [v for _, v in scalars[f"attention/max_logit/layer_{layer}"]]
        assert len(values) == 2 and all(v > 0 for v in values), values
