"""End to end on CPU: a micro model trains, logs every metric, and resumes exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from divergence import Divergences
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moetrain.config import load_config
from moetrain.train.trainer import Trainer

MICRO = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.max_seq_len=64",
    "moe.num_experts=4",
    "moe.top_k=2",
    "moe.expert_ffn_dim=64",
    "moe.capacity_factor=1.0",
    "moe.token_group_seqs=2",
    "moe.num_shared_experts=1",
    "moe.expert_bias_rate=0.01",
    "moe.jitter_eps=0.01",
    "moe.seq_aux_loss_coef=0.001",
    "data.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.eval_every=2",
    "train.eval_batches=2",
    "train.checkpoint_every=3",
    "log.log_every=2",
    "log.progress_bar=false",
    "optim.warmup_steps=2",
]


def micro_config(out: Path, *extra: str):
    return load_config(None, [*MICRO, f"train.output_dir={out}", *extra])


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.timeout(300)
def test_trains_logs_every_metric_and_resumes_exactly(tmp_path: Path) -> None:
    full_dir, split_dir = tmp_path / "full", tmp_path / "split"
    summary = Trainer(micro_config(full_dir, "train.steps=6")).fit()
    assert math.isfinite(summary["eval_loss"]) and summary["step"] == 6

    full = scalars(full_dir)
    for tag in [
        "train/loss",
        "eval/loss",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/mfu",
        "data/unigram_entropy",
    ]:
        assert tag in full, f"missing {tag}"
    for layer in (0, 1):
        for name in [
            "max_over_mean",
            "cv",
            "dropped_fraction",
            "router_entropy",
            "aux_loss",
            "seq_aux_loss",
            "z_loss",
            "dead_experts",
            "a2a_bytes",
            "tokens/expert0",
            "expert_bias/expert3",
        ]:
            assert f"moe/layer{layer}/{name}" in full, f"missing moe/layer{layer}/{name}"
    assert [s for s, _ in full["train/loss"]] == [1, 2, 3, 4, 5, 6]
    shares = [full[f"moe/layer0/tokens/expert{e}"][0][1] for e in range(4)]
    assert sum(shares) == pytest.approx(1.0, abs=1e-5)
    # The expert bias moved (rate 0.01, sign updates), and stays a multiple of the rate.
    bias = full["moe/layer0/expert_bias/expert0"][-1][1]
    assert bias != 0 and abs(bias / 0.01 - round(bias / 0.01)) < 1e-3

    # Interrupted after 3 steps (a checkpoint is written at 3), then resumed to 6.
    Trainer(micro_config(split_dir, "train.steps=6")).fit(stop_at=3)
    Trainer(micro_config(split_dir, "train.steps=6")).fit()
    split = scalars(split_dir)
    for tag in [
        "train/loss",
        "train/grad_norm",
        "moe/layer1/aux_loss",
        "moe/layer0/z_loss",
        "moe/layer1/expert_bias/expert2",
    ]:
        assert [v for _, v in split[tag] if _ > 3] == [v for _, v in full[tag] if _ > 3], tag
    assert split["eval/loss"][-1] == full["eval/loss"][-1]
    # And the state itself: every parameter and AdamW moment of the final checkpoints equal,
    # bit for bit; a difference names each tensor, worst first (tests/divergence.py).
    compare_states(final_state(split_dir), final_state(full_dir), "resumed vs uninterrupted")


def final_state(run_dir: Path) -> dict[str, dict]:
    """Parameters and AdamW moments of the run's latest checkpoint (full size)."""
    trainer = Trainer(micro_config(run_dir, "train.steps=6"))
    trainer.maybe_resume()
    state = {"param": trainer.full_model_state_dict(),
             "optim": trainer.engine.full_optimizer_state()}  # fmt: skip
    trainer.close()
    return state


def compare_states(got: dict[str, dict], want: dict[str, dict], what: str) -> None:
    found = Divergences(what)
    for part, tensors in want.items():
        assert sorted(got[part]) == sorted(tensors), f"{what}: {part} names differ"
        for name, value in tensors.items():
            tensor = name.rsplit(".", 1)[0] if part == "optim" else name
            found.check_close(tensor, f"{part}[{name}]", None, got[part][name], value, 0.0, 0.0,
                              part)  # fmt: skip
    assert not found, found.message()


def test_compare_states_names_every_differing_tensor() -> None:
    import torch

    want = {"param": {"layers.0.ffn.router.gate.weight": torch.ones(2, 2),
                      "tok_embeddings.weight": torch.ones(3)},
            "optim": {"layers.0.ffn.router.gate.weight.exp_avg": torch.zeros(2, 2)}}  # fmt: skip
    got = {part: {k: v.clone() for k, v in t.items()} for part, t in want.items()}
    got["param"]["layers.0.ffn.router.gate.weight"][0, 1] += 1e-7
    got["optim"]["layers.0.ffn.router.gate.weight.exp_avg"] += 1.0
    with pytest.raises(AssertionError) as info:
        compare_states(got, want, "planted")
    message = str(info.value)
    assert "planted: 1 tensor diverge" in message, message
    assert "param[layers.0.ffn.router.gate.weight]" in message
    assert "optim[layers.0.ffn.router.gate.weight.exp_avg]" in message
    assert "tok_embeddings" not in message


def test_resume_never_refuses_existing_checkpoints(tmp_path: Path) -> None:
    from moetrain.config import ConfigError

    Trainer(micro_config(tmp_path, "train.steps=1")).fit()
    with pytest.raises(ConfigError, match="train.resume: 'never'"):
        Trainer(micro_config(tmp_path, "train.steps=2", "train.resume=never")).fit()


def test_checkpoint_from_another_model_shape_is_refused(tmp_path: Path) -> None:
    from moetrain.train.checkpoint import CheckpointError

    Trainer(micro_config(tmp_path, "train.steps=1")).fit()
    with pytest.raises(CheckpointError, match="num_experts"):
        Trainer(micro_config(tmp_path, "train.steps=2", "moe.num_experts=8")).fit()


def test_a_warmup_as_long_as_the_run_is_warned(tmp_path: Path, caplog) -> None:
    import logging

    cfg = micro_config(tmp_path / "run", "train.steps=2", "optim.warmup_steps=2",
                       "train.eval_every=0", "train.checkpoint_every=0")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        Trainer(cfg).fit()
    assert (
        "optim.warmup_steps=2 >= train.steps=2: the learning rate rises for the whole "
        "run and never reaches optim.lr=" in caplog.text
    )
    caplog.clear()
    cfg = micro_config(tmp_path / "run2", "train.steps=3", "optim.warmup_steps=2",
                       "train.eval_every=0", "train.checkpoint_every=0")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        Trainer(cfg).fit()
    assert "optim.warmup_steps" not in caplog.text
