"""A resume says what it does: it refuses to train nothing, refuses a config that changes
what the model computes (naming the keys) unless ``train.resume_allow_changes`` lists them,
says when a value it was given is not used (the schedule and optimizer are the checkpoint's),
and a run resumed with another ``moe.top_k`` (allowed) finishes, routing stability included.

Micro runs of one to three steps: about 30 s on 2 busy cores (the top_k case, with its
evaluations, is most of it).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from multirank import micro_config

from moetrain.config import ConfigError
from moetrain.train.specialization import routing_stability, stability_over_steps
from moetrain.train.trainer import Trainer

QUIET = ("log.progress_bar=false", "log.tensorboard=false", "train.eval_batches=1")


def _fit(out: Path, *overrides: str, **kwargs) -> dict[str, float]:
    return Trainer(micro_config(out, *QUIET, *overrides)).fit(**kwargs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 1-step run: the checkpoint every test below resumes (each from a copy)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    _fit(out, "train.steps=1")
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_a_resume_that_would_train_nothing_is_refused(trained: Path, tmp_path: Path) -> None:
    run = _copy(trained, tmp_path)
    for steps in (1, 0):
        with pytest.raises(ConfigError, match=rf"train.steps: {steps}, .* is at step 1: nothing "
                           "to train"):  # fmt: skip
            _fit(run, f"train.steps={steps}")
    # A sweep re-reading a finished run still gets its summary.
    summary = _fit(run, "train.steps=1", finished_ok=True)
    assert summary["step"] == 1 and np.isfinite(summary["eval_loss"])


@pytest.mark.parametrize(
    "override, named",
    [
        ("moe.top_k=1", "moe.top_k 2 -> 1"),
        ("moe.score_func=sigmoid", "moe.score_func 'softmax' -> 'sigmoid'"),
        ("moe.capacity_factor=2.0", "moe.capacity_factor 1.0 -> 2.0"),
        ("model.rope_theta=5000.0", "model.rope_theta 10000.0 -> 5000.0"),
        ("model.document_mask=true", "model.document_mask False -> True"),
    ],
)
def test_a_config_that_changes_the_model_function_is_refused_naming_the_keys(
    trained: Path, tmp_path: Path, override: str, named: str
) -> None:
    run = _copy(trained, tmp_path)
    with pytest.raises(ConfigError) as info:
        _fit(run, "train.steps=2", override)
    message = str(info.value)
    assert message.startswith("train.resume: ") and named in message, message
    assert f"train.resume_allow_changes=[{override.split('=')[0]}]" in message, message
    assert not (run / "checkpoints" / "step_00000002").exists()


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["optim.name=muon"], "optim.name 'adamw' -> 'muon'"),
        (["optim.name=muon", "train.resume_allow_changes=[optim.name]"],
         "optim.name 'adamw' -> 'muon'"),
    ],
    ids=["refused", "refused even when allowed"],
)  # fmt: skip
def test_a_resume_that_switches_optimizer_is_refused_naming_the_key(
    trained: Path, tmp_path: Path, overrides: list[str], named: str
) -> None:
    """The checkpoint holds AdamW's state: a Muon run cannot continue it (its matrices
    would start with no momentum while their AdamW moments are dropped)."""
    run = _copy(trained, tmp_path)
    with pytest.raises(ConfigError) as info:
        _fit(run, "train.steps=2", *overrides)
    message = str(info.value)
    assert message.startswith("train.resume: ") and named in message, message
    assert "another optimizer" in message and "cannot accept this" in message, message
    assert not (run / "checkpoints" / "step_00000002").exists()


def test_changed_values_that_are_not_used_are_named(
    trained: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """optim.* comes back from the checkpoint (AdamW's groups, the schedule): said, not
    silently dropped; a logging key changes freely."""
    run = _copy(trained, tmp_path)
    with caplog.at_level(logging.INFO, logger="moetrain"):
        trainer = Trainer(micro_config(run, *QUIET, "train.steps=2", "optim.lr=0.5",
                                       "log.log_every=7"))  # fmt: skip
        trainer.fit()
    text = caplog.text
    assert "resume: optim.lr 0.003 -> 0.5 is not used" in text, text
    assert "resume: log.log_every 10 -> 7 (logging" in text, text
    assert trainer.engine.schedulers[0].base_lrs[0] == pytest.approx(0.003)


def test_an_allowed_top_k_change_trains_and_finishes(tmp_path: Path) -> None:
    """The issue's crash: a 2-step run resumed with moe.top_k=1 died at the end of training
    in routing stability (ids of K=2 records reshaped with K=1). Allowed by the override key,
    it trains step 3 and reports stability over the evaluations of both."""
    run = tmp_path / "run"
    spec = ("train.eval_every=2", "log.specialization=true")
    _fit(run, "train.steps=2", *spec)
    summary = _fit(run, "train.steps=3", "moe.top_k=1", "train.resume_allow_changes=[moe.top_k]",
                   *spec)  # fmt: skip
    assert summary["step"] == 3
    from moetrain.train.specialization import load_eval_routing

    records = load_eval_routing(run)
    assert [records[s]["ids"][0].shape[-1] for s in sorted(records)] == [2, 1]  # steps 2, 3
    stab = stability_over_steps(records)
    assert set(stab) == {2, 3} and all(v == 1.0 for v in stab[3].values())


def test_stability_reads_each_record_with_its_own_top_k() -> None:
    """Top-1 is column 0 of each record: the K=2 and K=1 records below agree on 3 of 4."""
    earlier = {0: np.array([[[1, 0], [2, 3], [0, 1], [3, 2]]])}  # (N=1, T=4, K=2)
    final = {0: np.array([[[1], [2], [0], [1]]])}  # (1, 4, 1)
    assert routing_stability(earlier, final) == {0: 0.75}
    with pytest.raises(ValueError, match="4 routed tokens against 3"):
        routing_stability(earlier, {0: np.array([[[1], [2], [0]]])})
