"""The micro MoE the oracle trains, and the runs it reports.

``micro_run`` trains the tiny MoE used by ``tests/train/test_trainer.py`` (``MICRO``) for a
few steps through the real ``Trainer`` and returns losses, balancing losses, router
statistics, every step's gradients, the optimizer state and the final parameters. Called in a
plain process it is the single-process reference; called inside ``run_ranks``
(tests/harness.py) with ``parallel.*`` overrides it is the layout under test (every rank
returns the same gathered values). ``reshard_run`` trains, checkpoints and resumes under
another layout. Both compute on ``ORACLE_THREADS`` whatever the caller's setting
(tests/threads.py). Comparing the reports is tests/oracle.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from layout_facts import layout_facts, observe, watch_fsdp
from threads import one_thread
from tolerances import _tolerance_row

__all__ = ["MICRO", "micro_config", "micro_run", "reshard_run"]


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


def micro_run(
    out_dir: str | Path,
    steps: int,
    *overrides: str,
    inject: Callable[[Any, int], None] | None = None,
    traffic: bool = True,
) -> dict[str, Any]:
    """Train the micro MoE ``steps`` steps (no eval, no checkpoint) and report.

    Returns ``loss``, ``mtp_loss`` (nan without multi-token prediction), ``max_logits``
    (QK-clip's largest logit per attention layer; empty without ``optim.qk_clip``),
    ``grad_norm`` (lists over steps), ``moe`` (per step, per layer:
    aux_loss, seq_aux_loss, z_loss sums per call, calls, tokens_per_expert, dropped,
    expert_bias), ``grads`` (per step: every parameter's reduced gradient, before clipping,
    gathered to full size under the single-process names), ``optim`` (AdamW's exp_avg and
    exp_avg_sq of every parameter after the last step, full size) and ``params`` (the full
    fp32 state dict gathered over every parallel dimension, on CPU). Under a process group
    every rank returns the same values (each gathered on that rank).

    ``before`` holds, for every step after the first, the parameters (and buffers) and the
    optimizer state the step starts from, full size: ``anchored_run`` replays the steps from
    them.

    ``inject(engine, step)`` runs on the reduced gradients before they are recorded and
    used: the oracle's own tests plant errors with it. ``traffic=False`` skips counting the
    first step's collectives (``CommCounter`` sees every op: slow), leaving the traffic facts
    out of ``layout``: for the cells of a layout whose traffic another cell checked.

    It computes on ``ORACLE_THREADS`` intra-op threads whatever the caller's setting, as every
    rank, reference and replay it may be compared with does (tests/threads.py).
    """
    with one_thread():
        return _micro_run(out_dir, steps, *overrides, inject=inject, traffic=traffic)


def _micro_run(
    out_dir: str | Path,
    steps: int,
    *overrides: str,
    inject: Callable[[Any, int], None] | None,
    traffic: bool,
) -> dict[str, Any]:
    from moetrain.train.trainer import Trainer

    trainer = Trainer(micro_config(out_dir, f"train.steps={steps}", *overrides))
    grads: list[dict[str, torch.Tensor]] = []
    counter: Any = None

    def hook(engine: Any) -> None:
        if inject is not None:
            inject(engine, len(grads))
        seen = len(counter.records) if counter is not None else 0
        grads.append(engine.full_grad_dict())
        if counter is not None:  # the oracle's own gathers are not the layout's traffic
            del counter.records[seen:]

    trainer.engine.grad_hook = hook
    watch = watch_fsdp(trainer.engine)
    observer = observe(trainer.engine)  # what the first step runs (tests/layout_facts.py)
    losses, norms, moe, mtp, max_logits = [], [], [], [], []
    facts: dict[str, Any] = {}
    lrs: list[float] = []
    before: list[dict[str, dict[str, torch.Tensor]]] = []
    for step in range(steps):
        lrs.append(trainer.engine.lr)
        if step > 0:  # what the step starts from: the anchored check replays it (anchored_run)
            before.append({"params": trainer.full_model_state_dict(),
                           "optim": trainer.engine.full_optimizer_state()})  # fmt: skip
        if step == 0:
            from contextlib import nullcontext

            from moetrain.parallel.accounting import CommCounter

            with CommCounter() if traffic else nullcontext() as counter:
                res = trainer.train_step()
            seen = observer.facts()
            observer.remove()
            facts = {**layout_facts(trainer, counter.records if traffic else None), **seen}
            facts["fsdp_resharded_after_forward"] = watch.pop("resharded", None)
            facts["ep_bytes_sent"] = any(float(s["a2a_bytes"]) > 0 for s in res.moe.values())
            counter = None
        else:
            res = trainer.train_step()
        losses.append(res.loss)
        mtp.append(res.mtp_loss)
        max_logits.append(res.max_logits)
        norms.append(res.grad_norm)
        moe.append(
            {i: {k: v.detach().cpu().clone() for k, v in s.items()} for i, s in res.moe.items()}
        )
    params = trainer.full_model_state_dict()
    optim = trainer.engine.full_optimizer_state()
    trainer.close()
    return {
        "loss": losses,
        "mtp_loss": mtp,
        "max_logits": max_logits,
        "grad_norm": norms,
        "moe": moe,
        "grads": grads,
        "optim": optim,
        "params": params,
        "lrs": lrs,
        "before": before,
        "layout": facts,
        "dtype": _tolerance_row(trainer),
        "precision": (str(trainer.dtype), trainer.cfg.train.fp8),
    }


def reshard_run(
    out_dir: str | Path,
    steps: int,
    save: list[str],
    load: list[str],
    *,
    after_load: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Train ``steps - 1`` steps under ``save``, checkpoint, resume under ``load`` (a fresh
    Trainer: DCP reshards), take the last step. Reports like ``micro_run`` for the last
    step: ``loss`` (all steps), ``grads`` (a list holding the last step's), ``optim`` and
    ``params`` (after it). ``after_load(trainer)`` runs after the resume (the oracle's tests
    plant errors there). ``out_dir`` must be shared by every rank. Computes on
    ``ORACLE_THREADS``, as the reference it is compared with (tests/threads.py)."""
    with one_thread():
        return _reshard_run(out_dir, steps, save, load, after_load=after_load)


def _reshard_run(
    out_dir: str | Path,
    steps: int,
    save: list[str],
    load: list[str],
    *,
    after_load: Callable[[Any], None] | None,
) -> dict[str, Any]:
    from moetrain.train.trainer import Trainer

    first = Trainer(micro_config(out_dir, f"train.steps={steps}", *save))
    losses = [first.train_step().loss for _ in range(steps - 1)]
    first.save_checkpoint()
    first.close()
    del first
    second = Trainer(micro_config(out_dir, f"train.steps={steps}", *load))
    second.maybe_resume()
    assert second.step == steps - 1, second.step
    if after_load is not None:
        after_load(second)
    grads: list[dict[str, torch.Tensor]] = []
    second.engine.grad_hook = lambda engine: grads.append(engine.full_grad_dict())
    losses.append(second.train_step().loss)
    result = {
        "loss": losses,
        "grads": grads,
        "optim": second.engine.full_optimizer_state(),
        "params": second.full_model_state_dict(),
        "dtype": _tolerance_row(second),
        "precision": (str(second.dtype), second.cfg.train.fp8),
    }
    second.close()
    return result
