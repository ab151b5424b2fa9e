"""Interruptions end to end: preemption, kill -9 while saving, non-finite numbers, router
collapse, a dead rank under torchrun (with and without --max-restarts)."""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moetrain.config import load_config
from moetrain.train.resilience import CollapseMonitor, NonFiniteError
from moetrain.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
MICRO = [
    "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_dim=64",
    "model.max_seq_len=32", "moe.num_experts=4", "moe.expert_ffn_dim=32",
    "moe.token_group_seqs=2", "moe.jitter_eps=0.01", "moe.expert_bias_rate=0.01",
    "data.seq_len=16", "train.global_batch_size=4", "train.micro_batch_size=2",
    "train.eval_batches=1", "train.eval_every=0", "log.log_every=1", "log.progress_bar=false",
    "optim.warmup_steps=2",
]
BOUND_S = 90  # a dead rank must end the job within this (generous for a loaded 2-core CI box)


def cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moetrain.train", "--config", str(REPO / "configs/tiny.yaml"),
            *MICRO, f"train.output_dir={out}", *extra]


def env(**extra: str) -> dict[str, str]:
    """The runs' environment: one intra-op thread each (``OMP_NUM_THREADS=1``, as
    ``tests/threads.py``'s ``one_thread``), so that a resumed curve compared exactly with the
    ``reference`` fixture's sums in its order whatever the caller's thread setting."""
    e = {k: v for k, v in os.environ.items() if k != "MOETRAIN_INJECT_FAULT"}
    e.update({"PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
              "OMP_NUM_THREADS": "1"})  # fmt: skip
    e.update(extra)
    return e


def losses(run: Path) -> dict[int, float]:
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted run's loss curve (8 steps)."""
    out = tmp_path_factory.mktemp("reference")
    subprocess.run(cmd(out, "train.steps=8", "train.checkpoint_every=2"), env=env(),
                   check=True, capture_output=True, timeout=300)
    return losses(out)


@pytest.mark.timeout(400)
def test_sigterm_checkpoints_exits_0_and_resumes_to_the_same_curve(
        tmp_path: Path, reference: dict[int, float]) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(cmd(out, "train.steps=8", "train.checkpoint_every=2",
                                "optim.lr=3e-3"), env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "step 3/8" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    assert "received SIGTERM" in output and "stopped at step" in output, output
    stopped = int(output.split("stopped at step ")[1].split()[0])
    assert 3 <= stopped < 8
    assert (out / "checkpoints" / f"step_{stopped:08d}").is_dir()

    again = subprocess.run(cmd(out, "train.steps=8", "train.checkpoint_every=2",
                               "optim.lr=3e-3"), env=env(), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"at step {stopped}" in again.stdout
    # tiny.yaml's lr is 3e-3 too: the interrupted curve is the uninterrupted one, exactly.
    assert losses(out) == reference


@pytest.mark.timeout(400)
def test_kill_9_while_saving_keeps_the_last_complete_checkpoint(
        tmp_path: Path, reference: dict[int, float]) -> None:
    out = tmp_path / "run"
    killed = subprocess.run(cmd(out, "train.steps=8", "train.checkpoint_every=2"),
                            env=env(MOETRAIN_INJECT_FAULT="rank=0,step=4,kind=kill,point=save"),
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert not (ckpts / "step_00000004").exists()
    assert any(p.name.startswith(".tmp-") for p in ckpts.iterdir())  # the half-written save

    resumed = subprocess.run(cmd(out, "train.steps=8", "train.checkpoint_every=2"), env=env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "at step 2" in resumed.stdout
    assert not any(p.name.startswith(".tmp-") for p in ckpts.iterdir())
    assert losses(out) == reference


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("point", ["stage", "write", "save"])
def test_kill_9_during_an_asynchronous_save_keeps_the_last_published_checkpoint(
        tmp_path: Path, reference: dict[int, float], point: str) -> None:
    """``train.checkpoint_async``: the process is killed while step 4's checkpoint is being
    saved beside training -- once it is staged, once its shards are written, once every file
    is (before it is published); the kill comes from the writing thread for the last two."""
    out = tmp_path / "run"
    args = ("train.steps=8", "train.checkpoint_every=2", "train.checkpoint_async=true")
    killed = subprocess.run(
        cmd(out, *args), env=env(MOETRAIN_INJECT_FAULT=f"rank=0,step=4,kind=kill,point={point}"),
        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert not (ckpts / "step_00000004").exists()
    resumed = subprocess.run(cmd(out, *args), env=env(), capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "at step 2" in resumed.stdout
    assert "written while training went on" in resumed.stdout + resumed.stderr
    assert losses(out) == reference


def _poison_grad_at(trainer: Trainer, bad_step: int) -> None:
    """Make one parameter's gradient NaN during step ``bad_step`` (1-based)."""
    param = next(p for p in trainer.engine.parts[0].parameters() if p.requires_grad)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan") if trainer.step + 1 == bad_step else grad

    param.register_hook(hook)


@pytest.mark.timeout(300)
def test_nonfinite_skip_leaves_parameters_untouched_and_counts(tmp_path: Path) -> None:
    cfg = load_config(None, [*MICRO, "train.steps=4", f"train.output_dir={tmp_path}",
                             "train.nonfinite_policy=skip", "moe.expert_bias_rate=0"])
    trainer = Trainer(cfg)
    _poison_grad_at(trainer, 2)
    trainer.train_step()
    before = {k: v.clone() for k, v in trainer.full_model_state_dict().items()}
    res = trainer.train_step()
    assert math.isnan(res.grad_norm)
    after = trainer.full_model_state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed during a skipped step"
    trainer.close()

    summary = Trainer(load_config(None, [*MICRO, "train.steps=4",
                                         f"train.output_dir={tmp_path / 'fit'}"]))
    _poison_grad_at(summary, 2)
    assert math.isfinite(summary.fit()["eval_loss"])
    acc = EventAccumulator(str(tmp_path / "fit" / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/skipped_steps")] == [0, 1, 1, 1]


@pytest.mark.timeout(300)
def test_nonfinite_halt_saves_the_last_good_state(tmp_path: Path) -> None:
    cfg = load_config(None, [*MICRO, "train.steps=4", f"train.output_dir={tmp_path}",
                             "train.nonfinite_policy=halt", "train.checkpoint_every=0"])
    trainer = Trainer(cfg)
    _poison_grad_at(trainer, 3)
    good: dict[str, torch.Tensor] = {}
    original = trainer.train_step

    def step_and_remember():
        res = original()
        if trainer.step == 2:
            good.update({k: v.clone() for k, v in trainer.full_model_state_dict().items()})
        return res

    trainer.train_step = step_and_remember  # type: ignore[method-assign]
    with pytest.raises(NonFiniteError, match="step 3.*train.nonfinite_policy=halt"):
        trainer.fit()
    trainer.close()
    resumed = Trainer(cfg)
    resumed.maybe_resume()
    assert resumed.step == 3  # positioned after the bad batch
    state = resumed.full_model_state_dict()
    for k, v in good.items():
        assert torch.equal(state[k], v), k


def test_router_collapse_is_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    mon = CollapseMonitor(fraction=0.9, steps=3, top_k=2)
    collapsed = {0: {"tokens_per_expert": torch.tensor([100.0, 20, 40, 40]),
                     "assignments": torch.tensor(200.0)}}
    healthy = {0: {"tokens_per_expert": torch.tensor([50.0, 50, 50, 50]),
                   "assignments": torch.tensor(200.0)}}
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        warned = [mon.update(s, collapsed) for s in range(1, 6)]
        assert warned == [[], [], [0], [], []]
        mon.update(6, healthy)
        assert [mon.update(s, collapsed) for s in range(7, 10)][-1] == [0]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "router collapse in moe layer 0: expert 0" in messages[0]


def test_one_expert_per_batch_is_not_called_collapse(caplog: pytest.LogCaptureFixture) -> None:
    """The busiest expert takes the batch in every step but changes from step to step: a
    warning of its own naming the experts in turn, never "router collapse"; a streak broken
    by a balanced step starts over."""
    mon = CollapseMonitor(fraction=0.9, steps=3, top_k=1)

    def batch_on(e: int) -> dict[int, dict[str, torch.Tensor]]:
        load = torch.full((4,), 1.0)
        load[e] = 97.0
        return {2: {"tokens_per_expert": load, "assignments": torch.tensor(100.0)}}

    balanced = {2: {"tokens_per_expert": torch.full((4,), 25.0),
                    "assignments": torch.tensor(100.0)}}
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        warned = [mon.update(1, batch_on(0)), mon.update(2, batch_on(1)),
                  mon.update(3, balanced), mon.update(4, batch_on(3)),
                  mon.update(5, batch_on(1)), mon.update(6, batch_on(3))]
    assert warned == [[], [], [], [], [], [2]]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert "routes each batch to one expert" in messages[0]
    assert "2 different experts in turn (experts 3 1 3; step 6)" in messages[0]
    assert "collapse" not in messages[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(out: Path, fault: str, *extra: str, restarts: int = 0) -> tuple[int, str, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), f"--max-restarts={restarts}",
               "-m", "moetrain.train", *cmd(out, *extra)[3:]]
    start = time.monotonic()
    # A session of its own: if the job overruns, the launcher *and* its workers are killed,
    # so no orphaned rank lingers to slow down or collide with the tests after this one.
    proc = subprocess.Popen(command, env=env(MOETRAIN_INJECT_FAULT=fault, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BOUND_S + 240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {BOUND_S + 240} s:\n{output}")
    return proc.returncode, output, time.monotonic() - start


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["raise", "kill"])
def test_dead_rank_ends_the_job_with_its_error(tmp_path: Path, kind: str) -> None:
    code, output, seconds = torchrun(tmp_path / "run", f"rank=1,step=3,kind={kind}",
                                     "train.steps=6", "train.checkpoint_every=2",
                                     "train.collective_timeout_s=60")
    assert code != 0, output
    assert "local_rank: 1" in output or "rank 1" in output.lower(), output
    if kind == "raise":
        assert "injected fault at step 3" in output, output
    else:
        assert "Signal 9" in output or "SIGKILL" in output, output
    assert seconds < BOUND_S + 60, f"the job took {seconds:.0f} s to stop"
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000002"


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_relaunch_after_a_dead_rank_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    """What ``torchrun --max-restarts`` does after a failure, done explicitly: the same
    command again. (The in-agent restart was run by hand — it resumes the same way — but on a
    loaded 2-core machine gloo's reconnection inside a restarted agent is not reliable
    enough for CI.)"""
    marker = tmp_path / "fired"
    fault = f"rank=1,step=3,kind=raise,once={marker}"
    args = ("train.steps=5", "train.checkpoint_every=2")
    code, output, _ = torchrun(tmp_path / "run", fault, *args)
    assert code != 0 and marker.exists(), output
    code, output, _ = torchrun(tmp_path / "run", fault, *args)
    assert code == 0, output
    assert "resumed from" in output and "at step 2" in output, output
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000005"
