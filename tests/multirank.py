"""Multi-rank test harness: run a function on N spawned CPU processes with gloo.

Import it from any test folder as ``from multirank import run_ranks`` (``tests/conftest.py``
puts ``tests/`` on ``sys.path``; ``from tests.multirank import run_ranks`` also works when the
repository root is on the path, as under ``python -m pytest``).

    def _worker(rank: int, world_size: int, x: int) -> float:
        ...  # the default process group is initialised (gloo), torch uses one thread
        return some_picklable_value

    results = run_ranks(_worker, 4, 3, timeout=120)   # [rank 0's result, rank 1's, ...]

``fn`` must be a module-level function (spawn pickles it by reference). Each run gets its own
rendezvous file in a fresh temporary directory, the process group a short timeout, and the
parent a wall-clock deadline: if any rank raises, dies or the deadline passes, every child is
killed and ``RankFailure`` is raised with the failing rank's traceback. A test never hangs.

The second half is the oracle of the layout tests: ``micro_run`` trains the tiny MoE used by
``tests/train/test_trainer.py`` for a few fp32 steps through the real ``Trainer`` and returns
losses, balancing losses, router statistics and the final parameters. Called in a plain
process it is the single-process reference; called inside ``run_ranks`` with ``parallel.*``
overrides it is the layout under test (every rank returns the same gathered values).
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["MICRO", "RankFailure", "micro_config", "micro_run", "run_ranks", "compare_runs"]

PG_TIMEOUT_S = 60
"""Timeout of the gloo process group: a collective some rank never joins fails after this."""


class RankFailure(RuntimeError):
    """A rank raised, died, or the run passed its deadline. The message holds the traceback."""


def _entry(
    rank: int,
    world_size: int,
    rendezvous: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    init_pg: bool,
) -> None:
    import torch.distributed as dist

    # torchrun's variables, so that code reading them (the trainer) sees a normal launch.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # N processes share a couple of cores
    try:
        if init_pg:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{rendezvous}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=PG_TIMEOUT_S),
            )
        out = fn(rank, world_size, *args)
        # Bytes, not tensors: torch's queue pickler would pass tensors as shared-memory
        # handles that die with this process.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240,
    init_pg: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    Returns the ranks' results in rank order. ``init_pg=False`` leaves the process group to
    ``fn`` (``MASTER_ADDR``/``MASTER_PORT`` are not set; pass an ``init_method``). Raises
    ``RankFailure`` naming the first failing rank, with its traceback, or the ranks still
    running at the deadline.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="moetrain-mr-") as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        procs = [
            ctx.Process(
                target=_entry,
                args=(rank, world_size, rendezvous, fn, args, results, init_pg),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world_size:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if r not in out and p.exitcode is not None and p.exitcode != 0
                    ]
                    if dead:
                        # Give a dying rank's report a moment to arrive before blaming it.
                        try:
                            rank, ok, value = results.get(timeout=2.0)
                        except queue.Empty:
                            raise RankFailure(
                                f"{fn.__name__}: rank {dead[0]} died with exit code "
                                f"{procs[dead[0]].exitcode} without a report"
                            ) from None
                    elif time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(out))
                        raise RankFailure(
                            f"{fn.__name__}: ranks {missing} still running after {timeout:.0f} s"
                        ) from None
                    else:
                        continue
                if not ok:
                    raise RankFailure(f"{fn.__name__}: rank {rank} failed:\n{value}")
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            for p in procs:
                p.join(timeout=30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
            results.close()
    return [out[r] for r in range(world_size)]


# ----------------------------------------------------------------------------- the oracle

MICRO: list[str] = [
    # The micro model of tests/train/test_trainer.py, made deterministic under any layout:
    # no router jitter (its random draws depend on how tokens are split across ranks) and
    # untied embeddings (a tie cannot span pipeline stages); 4 layers so pp=2 x 2 virtual
    # stages has a layer per chunk.
    "model.dim=64",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.max_seq_len=64",
    "model.tie_embeddings=false",
    "moe.num_experts=4",
    "moe.top_k=2",
    "moe.expert_ffn_dim=64",
    "moe.capacity_factor=1.0",
    "moe.token_group_seqs=2",
    "moe.num_shared_experts=1",
    "moe.expert_bias_rate=0.01",
    "moe.jitter_eps=0.0",
    "moe.seq_aux_loss_coef=0.001",
    "moe.every_n_layers=1",
    "data.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.device=cpu",
    "train.dtype=fp32",
    "log.progress_bar=false",
    "log.tensorboard=false",
    "optim.warmup_steps=2",
]


def micro_config(out_dir: str | Path, *overrides: str):
    from moetrain.config import load_config

    return load_config(None, [*MICRO, f"train.output_dir={out_dir}", *overrides])


def micro_run(out_dir: str | Path, steps: int, *overrides: str) -> dict[str, Any]:
    """Train the micro MoE ``steps`` steps (no eval, no checkpoint) and report.

    Returns ``loss``, ``grad_norm`` (lists over steps), ``moe`` (per step, per layer:
    aux_loss, seq_aux_loss, z_loss sums per call, calls, tokens_per_expert, dropped,
    expert_bias) and ``params`` (the full fp32 state dict gathered over every parallel
    dimension, on CPU). Under a process group every rank returns the same values.
    """
    from moetrain.train.trainer import Trainer

    trainer = Trainer(micro_config(out_dir, f"train.steps={steps}", *overrides))
    losses, norms, moe = [], [], []
    for _ in range(steps):
        res = trainer.train_step()
        losses.append(res.loss)
        norms.append(res.grad_norm)
        moe.append(
            {i: {k: v.detach().cpu().clone() for k, v in s.items()} for i, s in res.moe.items()}
        )
    params = trainer.full_model_state_dict()
    trainer.close()
    return {"loss": losses, "grad_norm": norms, "moe": moe, "params": params}


# fp32 tolerances of every layout-vs-single-process comparison, stated once. Parameters get a
# looser atol: Adam turns last-bit differences in near-zero gradients into visible updates.
VALUE_TOL = {"atol": 1e-5, "rtol": 1e-4}
PARAM_TOL = {"atol": 5e-5, "rtol": 1e-4}


def compare_runs(
    got: dict[str, Any],
    ref: dict[str, Any],
    *,
    atol: float,
    rtol: float,
    param_tol: dict[str, float] | None = None,
    what: str = "",
) -> dict[str, float]:
    """Assert two ``micro_run`` reports agree (values within atol/rtol, parameters within
    ``param_tol``, default the same); return the max abs error of each part."""
    errs: dict[str, float] = {}

    def check(name: str, a: Any, b: Any, atol: float = atol, rtol: float = rtol) -> None:
        a_t = torch.as_tensor(a, dtype=torch.float64)
        b_t = torch.as_tensor(b, dtype=torch.float64)
        assert a_t.shape == b_t.shape, f"{what} {name}: shape {a_t.shape} vs {b_t.shape}"
        err = (a_t - b_t).abs().max().item() if a_t.numel() else 0.0
        errs[name.split("[")[0]] = max(errs.get(name.split("[")[0], 0.0), err)
        torch.testing.assert_close(
            a_t, b_t, atol=atol, rtol=rtol, msg=lambda m: f"{what} {name}: {m}"
        )

    check("loss", got["loss"], ref["loss"])
    check("grad_norm", got["grad_norm"], ref["grad_norm"])
    for step, (g, r) in enumerate(zip(got["moe"], ref["moe"], strict=True)):
        assert sorted(g) == sorted(r), f"{what} step {step}: MoE layers {sorted(g)} vs {sorted(r)}"
        for layer in r:
            for key in r[layer]:
                check(f"moe.{key}[step {step} layer {layer}]", g[layer][key], r[layer][key])
    assert sorted(got["params"]) == sorted(ref["params"]), f"{what}: parameter names differ"
    for name in ref["params"]:
        check(
            f"param[{name}]",
            got["params"][name],
            ref["params"][name],
            **(param_tol or {"atol": atol, "rtol": rtol}),
        )
    return errs
