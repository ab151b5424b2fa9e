"""QK-clip (``optim.qk_clip``) in training: on tiny at learning rates where the attention
logits grow, Muon's and AdamW's largest logit held near tau with the loss no worse (a
short version of tools/qk_clip_runs.py's runs, whose longer ones docs/optim.md quotes);
the maxima logged per layer to TensorBoard. The rescale itself: tests/model/test_qk_clip.py;
under every layout: the equivalence matrix (factor "qk_clip")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from qk_clip_runs import run  # noqa: E402
from threads import one_thread  # noqa: E402

STEPS, TAU = 15, 4.0
SHORT = ["data.seq_len=32"]
"""tiny on sequences of 32 tokens (the tool's 64 halved), 15 steps, one intra-op thread:
about 25 s for the four runs on one core."""
LOSS_NOISE = 0.05
"""How much worse the clipped run's eval loss may be: 15 steps of one seed (measured: Muon
+0.015, AdamW -0.081)."""


def _after_first_clip(max_logit: list[float]) -> list[float]:
    """The maxima of the steps after the first one past tau (the first rescale)."""
    first = next(i for i, m in enumerate(max_logit) if m > TAU)
    return max_logit[first + 1 :]


@pytest.mark.parametrize("optimizer, lr", [("muon", 0.03), ("adamw", 0.01)])
def test_qk_clip_holds_the_largest_logit_near_tau_with_the_loss_no_worse(
    optimizer: str, lr: float
) -> None:
    with one_thread():
        plain = run(optimizer, lr, None, STEPS, extra=SHORT)
        clipped = run(optimizer, lr, TAU, STEPS, extra=SHORT)
    # Without the clip the logits grow well past tau (measured from 3.1: Muon to 8.1, AdamW
    # to 17.9) ...
    assert plain["max_logit"][-1] > 1.6 * TAU, plain["max_logit"]
    held = _after_first_clip(clipped["max_logit"])
    if optimizer == "muon":
        # ... with it each step starts from weights whose logits on the last step's tokens
        # were tau, and one update moves them a little past it (measured: at most 1.33 tau).
        assert held and max(held) < 1.5 * TAU, clipped["max_logit"]
    else:
        # AdamW's larger steps at this lr take a few rescales to settle (measured: the last
        # 5 steps 5.7 on average against 17.0 unclipped, the last one 1.13 tau).
        mean = sum(held[-5:]) / 5
        assert mean < 0.5 * sum(plain["max_logit"][-5:]) / 5, (clipped, plain)
        assert held[-1] < 1.5 * TAU, clipped["max_logit"]
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
