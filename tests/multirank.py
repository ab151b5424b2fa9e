"""Multi-rank test harness: run a function on N CPU processes with gloo.

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

import faulthandler
import io
import math
import os
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from divergence import Check, Divergences
from layout_facts import check_layout, expected_layout, layout_facts, observe, watch_fsdp
from threads import ORACLE_THREADS, one_thread

__all__ = [
    "GRAD_TOL",
    "MICRO",
    "TOLERANCES",
    "PARAM_TOL",
    "VALUE_TOL",
    "RankFailure",
    "compare_runs",
    "micro_config",
    "micro_run",
    "run_ranks",
]

PG_TIMEOUT_S = 60
"""Timeout of the gloo process group: a collective some rank never joins fails after this."""


class RankFailure(RuntimeError):
    """A rank raised, died, or the run passed its deadline. The message holds the traceback."""


def _entry(
    rank: int,
    world_size: int,
    rendezvous: str,
    fn: Callable[..., Any],
    args_bytes: bytes,
    results: Any,
    init_pg: bool,
    environ: dict[str, str],
    log: str,
) -> None:
    import torch.distributed as dist

    # The rank's stdout and stderr go to its log, which a failure quotes (_with_output): what a
    # rank prints as it dies (an abort's message, faulthandler's stack of every thread on a
    # fatal signal) would otherwise go to the parent's descriptors, out of any report.
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_ranks' deadline asks for stacks

    os.environ.clear()  # exactly the caller's environment
    os.environ.update(environ)

    # torchrun's variables, so that code reading them (the trainer) sees a normal launch.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(ORACLE_THREADS)  # as every run it is compared with (tests/threads.py)
    try:
        if init_pg:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{rendezvous}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=PG_TIMEOUT_S),
            )
        args = torch.load(io.BytesIO(args_bytes), weights_only=False)
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


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker")
"""What gloo says on a rank whose peer went away: the peer's own failure is the cause."""


def _root_failure(
    name: str, results: Any, failures: dict[int, str], procs: list[Any], done: dict[int, Any]
) -> RankFailure:
    """The failure that caused the others. A failing rank's report can arrive after its
    peers': ``Queue.put`` hands it to a feeder thread while the rank goes on to destroy its
    process group, and the peers fail on the closed connection. So the other ranks' reports
    are read for a few seconds, and the first one that is not a lost peer is blamed; if each is
    a lost peer, a rank that died without a report (its exit code: a signal, a hard abort)."""
    end = time.monotonic() + 5.0
    while len(failures) + len(done) < len(procs) and time.monotonic() < end:
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue.Empty:
            continue
        if not ok:
            failures[rank] = value
    rank = next((r for r, v in failures.items() if not any(s in v for s in PEER_LOST)), None)
    silent = [r for r, p in enumerate(procs)
              if r not in failures and r not in done and p.exitcode not in (None, 0)]  # fmt: skip
    if rank is None and silent:
        return RankFailure(
            f"{name}: rank {silent[0]} died with exit code {procs[silent[0]].exitcode} without "
            f"a report; ranks {sorted(failures)} lost it as a peer. Rank "
            f"{next(iter(failures))}:\n{next(iter(failures.values()))}"
        )
    rank = next(iter(failures)) if rank is None else rank
    others = sorted(set(failures) - {rank})
    tail = f"\n(ranks {others} failed too, on lost peers or the same error)" if others else ""
    return RankFailure(f"{name}: rank {rank} failed:\n{failures[rank]}{tail}")


RANK_OUTPUT_CHARS = 4000
"""About how much of a failed rank's output a ``RankFailure`` quotes (``_shorten``)."""


def _log(tmp: str, rank: int) -> str:
    return str(Path(tmp) / f"rank{rank}.log")


def _with_output(e: RankFailure, tmp: str, procs: list[Any], done: dict[int, Any]) -> RankFailure:
    """``e`` with each unfinished rank's output (stdout and stderr, ``_shorten``ed) appended,
    and the exit code of those that died: a rank killed by a signal has no traceback to
    report, and its last words (an abort's message, faulthandler's stacks) are all there is."""
    parts = [str(e)]
    for rank, p in enumerate(procs):
        if rank in done:
            continue
        try:
            text = Path(_log(tmp, rank)).read_text(errors="replace")
        except OSError:
            text = ""
        code = "" if p.exitcode is None else f", exit code {p.exitcode}"
        if not text.strip():
            if p.exitcode not in (None, 0):
                parts.append(f"--- rank {rank}{code}: printed nothing")
            continue
        parts.append(f"--- rank {rank}{code}, output:\n{_shorten(text).rstrip()}")
    return RankFailure("\n".join(parts))


LAST_WORDS = ("terminate called", "what():", "Fatal Python error", "Traceback", "Error",
              "error", "malloc", "free()", "corrupt", "Assertion", "assert")  # fmt: skip
"""Lines of a rank's output kept even from the middle of a long one: a C++ abort's message
(gloo names a collective mismatch there) and glibc's heap-corruption messages come before
faulthandler's stacks."""


def _shorten(text: str) -> str:
    """``text`` within about ``RANK_OUTPUT_CHARS`` (twice that when a rank died by a signal):
    its start, the lines between that hold ``LAST_WORDS``, and its end; a fatal signal's
    stacks (faulthandler's, from ``Fatal Python error`` on) whole but for the list of
    extension modules."""
    lines = text.splitlines()
    text = "\n".join(line for line in lines if not line.startswith("Extension modules:"))
    fatal = text.find("Fatal Python error")
    if fatal >= 0:  # what the rank printed just before the signal, then the stacks
        before = text.rfind("\n", 0, max(fatal - 1, 0))
        before = text.rfind("\n", 0, max(before, 0))  # two lines before it
        head, tail = text[: max(before, 0)], text[max(before, 0) :]
        return _shorten(head) + "\n" + tail[-2 * RANK_OUTPUT_CHARS :] if head.strip() else tail
    if len(text) <= RANK_OUTPUT_CHARS:
        return text
    head, tail = text[: RANK_OUTPUT_CHARS // 4], text[-RANK_OUTPUT_CHARS // 2 :]
    middle = text[len(head) : len(text) - len(tail)]
    kept = [line for line in middle.splitlines() if any(w in line for w in LAST_WORDS)][:20]
    gap = f"[... {len(middle)} characters, {len(kept)} lines kept ...]"
    return "\n".join([head, gap, *kept, "[...]", tail])


def _context() -> Any:
    """Each rank is a freshly spawned interpreter (about 6 s of CPU to import torch, its
    distributed packages and moetrain).

    Ranks forked from a fork server that imported those once were a third faster on 2 cores,
    and were retired: in 2 of 7 full runs one rank of one test died of SIGABRT, a different
    test each time and never on a rerun, while spawned ranks have never shown it. The server
    forked a process holding a native thread (pyarrow's jemalloc ``jemalloc_bg_thd``,
    started when ``datasets`` is imported), and POSIX leaves a forked child of a
    multi-threaded process undefined beyond async-signal-safe calls until it execs: an
    allocator whose background thread is gone in the child is exactly what that rules out.
    ``_entry`` still sets the caller's environment, so a rank's does not depend on how it
    started."""
    return mp.get_context("spawn")


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
    ctx = _context()
    results = ctx.Queue()
    # Bytes, not tensors, in both directions: torch's pickler would move every argument
    # tensor's storage into shared memory held by a file descriptor in this process for as
    # long as the tensor lives (the cached references live for the whole session: hundreds
    # of descriptors per test, until open() fails with EMFILE).
    buf = io.BytesIO()
    torch.save(args, buf)
    args_bytes = buf.getvalue()
    with tempfile.TemporaryDirectory(prefix="moetrain-mr-") as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        procs = [
            ctx.Process(
                target=_entry,
                args=(rank, world_size, rendezvous, fn, args_bytes, results, init_pg,
                      dict(os.environ), _log(tmp, rank)),
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
                        for r in missing:  # each prints where its threads are (_entry)
                            if procs[r].pid is not None and procs[r].exitcode is None:
                                os.kill(procs[r].pid, signal.SIGUSR1)
                        time.sleep(1.0)
                        raise RankFailure(
                            f"{fn.__name__}: ranks {missing} still running after {timeout:.0f} s"
                        ) from None
                    else:
                        continue
                if not ok:
                    raise _root_failure(fn.__name__, results, {rank: value}, procs, out)
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            for p in procs:
                p.join(timeout=30)
        except RankFailure as e:
            raise _with_output(e, tmp, procs, out) from None
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


def micro_run(
    out_dir: str | Path,
    steps: int,
    *overrides: str,
    inject: Callable[[Any, int], None] | None = None,
    traffic: bool = True,
) -> dict[str, Any]:
    """Train the micro MoE ``steps`` steps (no eval, no checkpoint) and report.

    Returns ``loss``, ``mtp_loss`` (nan without multi-token prediction), ``grad_norm`` (lists
    over steps), ``moe`` (per step, per layer:
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
    losses, norms, moe, mtp = [], [], [], []
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


def _tolerance_row(trainer: Any) -> str:
    """The ``TOLERANCES`` row of a run: its compute dtype, or "fp8" for FP8 GEMMs on fp32.
    Under bf16, "bf16" where the layout rounds to bf16 exactly where one process does, or
    "bf16 reordered" (``bf16_reordered``), with FP8 "bf16 reordered fp8"."""
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[trainer.dtype]
    fp8 = trainer.cfg.train.fp8 != "none"
    if dtype == "fp32":
        return "fp8" if fp8 else dtype
    if not bf16_reordered(trainer.engine.dims, trainer.cfg):
        return "bf16"
    return "bf16 reordered fp8" if fp8 else "bf16 reordered"


def bf16_reordered(dims: Any, cfg: Any) -> bool:
    """Whether a layout rounds bf16 partial results one process does not (the compute-dtype
    policy, ``moetrain.model.precision``, is the same everywhere; what differs is which
    sums a bf16 GEMM output or collective holds): tp's row-parallel partial sums and
    expert TP's, ep's expert GEMMs over the rows of several data-parallel ranks, cp's
    weight gradients over half sequences, a pipeline's micro-batches of another size than
    ``train.micro_batch_size``. Data parallelism, ZeRO 0-3 and HSDP, and pipelines at the
    same micro-batches reorder fp32 sums only."""
    return (
        dims.tp > 1
        or dims.ep > 1
        or dims.cp > 1
        or dims.micro_batch_size(cfg) != cfg.train.micro_batch_size
    )


# ----------------------------------------------------------------------------- tolerances

# The tolerances of every layout-vs-single-process comparison, stated once, per dtype.
TOLERANCES: dict[str, dict[str, dict[str, float]]] = {
    "fp32": {
        # Losses, gradient norms, router statistics, token and drop counts, expert bias:
        # layouts only reorder fp32 sums (measured <= 1e-6).
        "value": {"atol": 1e-5, "rtol": 1e-4},
        # Final parameters: looser, because Adam turns last-bit differences in near-zero
        # gradients into visible updates (m / sqrt(v) does not scale with the gradient).
        # Measured <= 1.2e-5; elements whose gradient is below the comparison's noise floor
        # may move further (``noise_floor_slack``).
        "param": {"atol": 5e-5, "rtol": 1e-4},
        # Gradients (every step, before clipping) and AdamW's moments (after the last step),
        # per tensor: max |got - ref| <= scale * max |ref|, relative to the tensor's own
        # magnitude (gradients span 1e-4..1e-1 between tensors: one absolute atol would be
        # blind on the small ones). "first": the first step's gradients, where a layout only
        # reorders fp32 sums (measured <= 4e-7). "later": later steps' gradients and the
        # moments inherit the parameter differences Adam amplifies (a near-zero gradient
        # element whose last bit differs moves its parameter by a sizeable fraction of lr),
        # measured <= 2.2e-4 over the equivalence matrix on an AVX-512 CPU (``CLAMPED``
        # where model.clip_qkv clamps). How far Adam amplifies depends on the machine's BLAS
        # too (1.1e-3 for MiniMax-M2's options under tp2 + SP on AVX2): a cell past these
        # rows is decided step by step (``anchored_compare``), never by widening them. A
        # constant factor on one tensor's gradient -- what Adam hides from the parameters --
        # is an error of the order of the tensor itself: x0.5 reads 0.5.
        "grad": {"first": 1e-5, "later": 1e-3},
        # Router-score histograms: the fraction of scores in another bin (measured 0).
        "hist": {"moved": 1e-3},
    },
    # bf16 (``train.dtype=bf16``): one compute-dtype policy for one process and every layout
    # (``moetrain.model.precision``: the same tensors rounded to bf16, at the same places).
    # Measured over every layout of the equivalence matrix (tests/parallel/test_bf16_layouts.py:
    # its micro MoE, 2 steps, dense routing), before the policy / after it.
    "bf16": {
        # Layouts whose bf16 roundings are one process's -- data parallelism, ZeRO 0-3, HSDP,
        # pipelines at the same micro-batches: their forward is one process's bit for bit
        # and they reorder fp32 sums only, so the fp32 row holds. Measured: losses equal,
        # statistics and the gradient norm <= 1.2e-7, the first step's gradients <= 1.2e-7,
        # later ones and the moments <= 2.3e-7, parameters <= 3.7e-9; with FP8 rowwise <=
        # 3.4e-7. Before the policy ZeRO-2/3 rounded the embeddings, the final norm and the
        # head (the residual stream bf16): first-step gradients 1.3e-2, losses 7.7e-5 apart,
        # which the old row (5e-3 on values, 0.05 on first-step gradients) let pass
        # (tests/faults.py ``fsdp_root_in_bf16``).
        "value": {"atol": 1e-5, "rtol": 1e-4},
        "param": {"atol": 5e-5, "rtol": 1e-4},
        "grad": {"first": 1e-5, "later": 1e-3},
        "hist": {"moved": 1e-3},
    },
    "bf16 reordered": {
        # Layouts that round other bf16 partial results than one process (``bf16_reordered``):
        # tp's row-parallel partial sums, each rounded to bf16 before the all-reduce (about 1
        # ulp, 2^-8, of an activation), ep's expert GEMMs over other ranks' rows and cp's
        # weight gradients over half sequences (each GEMM output rounded once, over another
        # set of tokens), a pipeline's micro-batches of another size. Measured over 2, 4 and
        # 8 ranks: losses <= 8.0e-5 apart (1e-5 of the loss), the gradient norm <= 1.3e-4,
        # z-losses <= 1.3e-4; was 5e-3 on both.
        "value": {"atol": 5e-4, "rtol": 1e-4},
        # A gradient element near zero whose sign the rounding flips moves by up to 2 lr
        # a step in Adam's first steps; ``noise_floor_slack`` allows that to the elements
        # below the first step's gradient tolerance. Measured 2.6e-3 (cp2 x tp2 SP); was
        # 1.5e-2.
        "param": {"atol": 5e-3, "rtol": 0.0},
        # Gradients: the first step's agree to <= 1.06e-2 of each tensor's scale (cp2 x tp2
        # SP; was 0.05); later steps and the moments inherit the parameter moves above,
        # measured <= 5.9e-2. Still far from a constant factor (x0.5).
        "grad": {"first": 0.02, "later": 0.1},
        # A score within an ulp of a bin edge changes bin: measured 1 score in 512 (was 0.02).
        "hist": {"moved": 5e-3},
    },
    "bf16 reordered fp8": {
        # bf16 with FP8 GEMMs under a "bf16 reordered" layout: a bf16 difference that lands
        # an FP8 input on the other side of a rounding boundary moves it by 2^-3 of itself
        # (the discontinuity of the "fp8" row), so the first step only, as there. Measured
        # over 2, 4 and 8 ranks, both recipes: losses <= 6.1e-5 apart, the gradient norm
        # <= 7.5e-4, z-losses <= 1.8e-4, gradients <= 7.1e-2 of their scale (tensorwise,
        # cp2 x dp2 x tp2 SP), 2 scores in 512 in another bin. Under the "bf16" layouts FP8
        # meets the "bf16" row (measured <= 3.8e-7; before the policy ZeRO-3's FP8 scales came
        # from other weights than one process's: 3.6% of the drops differed).
        "steps": 1,
        "value": {"atol": 2e-3, "rtol": 1e-4},
        "param": {"atol": 5e-3, "rtol": 0.0},  # not compared ("steps": 1)
        "grad": {"first": 0.1, "later": 0.1},  # later: not compared
        "hist": {"moved": 1e-2},
    },
    "fp8": {
        # fp32 training with FP8 GEMMs (``train.fp8``), compared on the first step only
        # ("steps": 1): its losses, statistics and every gradient. Every FP8 scale is the
        # same under every layout (whole tensors, per-token rows), so the first step
        # reproduces one FP8 process as fp32 does -- but for one discontinuity, like a
        # clamp's (CLAMPED): a GEMM input that a layout sums in another fp32 order (tp's
        # row-parallel reductions) and that lies within its last bit of a rounding boundary
        # of the FP8 grid rounds to the neighbouring FP8 value, 2^-3 of itself, and in this
        # 32-wide model that moves the token's later activations enough to flip more of
        # them. Over the matrix (every FP8 cell on 2, 4 and 8 ranks): losses within 9.5e-7,
        # statistics within 3.1e-6 and routing equal; the gradient norm within 7.0e-5; the
        # gradients within 4.3e-2 of their tensor's scale (tp2 with per-head q/k norms, YaRN
        # and document masks; 2.0e-5 in a plain tp2 SP cell). After the step, Adam has moved
        # a parameter by up to 2 lr where such a gradient element changed sign, which can
        # move a token's routing at the next step (measured: 1 token of 42 in another
        # expert, that expert's gradient 16% off): later steps, the moments and the final
        # parameters are not compared (the optimizer is, under every layout, without FP8).
        # Scales from one rank's slice of a tensor move the first step's gradients by 3e-2
        # to 1.2e-1, within reach of that allowance: tests/parallel/test_fp8_layouts.py
        # catches them token by token instead (tests/faults.py ``fp8_local_amax``).
        "steps": 1,
        "value": {"atol": 1e-5, "rtol": 5e-4},
        "param": {"atol": 5e-5, "rtol": 1e-4},  # not compared ("steps": 1)
        "grad": {"first": 0.1, "later": 1e-3},  # later: not compared
        "hist": {"moved": 1e-3},
    },
}
VALUE_TOL = TOLERANCES["fp32"]["value"]
PARAM_TOL = TOLERANCES["fp32"]["param"]
GRAD_TOL = TOLERANCES["fp32"]["grad"]
LAYOUT_STATS = ("a2a_bytes", "calls")
"""MoE statistics that describe the layout rather than the training (bytes sent between
EP ranks, forward calls = micro-batches): not compared with one process; the layout checks
assert them instead."""
PER_CALL_STATS = ("aux_loss", "seq_aux_loss", "z_loss", "entropy", "probs_sum")
"""MoE statistics summed over a step's forward calls: compared as per-call means (a layout
may cut the step into other micro-batches; token counts and drops are sums over tokens)."""


CLAMPED = {"grad_later": 0.05, "param": {"atol": 1e-3, "rtol": 1e-3}}
"""Later steps' gradients and moments, and final parameters, of a run whose q/k/v are
clamped (``model.clip_qkv``). A clamp's gradient is discontinuous: the parameter difference
Adam leaves after the first step (1e-6) can move an element that sits on the bound across
it, and that element's gradient jumps between zero and its full value -- measured up to
1.8e-2 of the tensor (7.5e-3 in wq, norms equal to 4 digits) at the second step and 3.3e-4
on 4 of 2048 weights after it, under cp2 and zbv, both on the same side of the bound. The
first step, where the runs see the same parameters, keeps the tight tolerance, and so do
losses and statistics."""


BF16_MOMENTS = {"grad_later": 1e-2, "param": {"atol": 2e-4, "rtol": 1e-4}}
"""A run with ``optim.moments_dtype=bf16``. A layout's moment that lies within its last fp32
bit of a bf16 rounding boundary rounds the other way, one bf16 ulp of itself -- up to 2^-7
of it at the bottom of a binade, so up to 7.8e-3 of the tensor's largest element (compared
with ``grad["later"]``; measured 4.6e-3: an exp_avg of layers.0.ffn.w1 under cp2 with
ZeRO-3, an exhaustive cell). The next update of that element, lr m / sqrt(v), moves by the
same fraction of the moment, more where m is a small difference of the old moment and the
new gradient: parameters within 2e-4 (measured 8.8e-5, layers.3.attention.wo under tp2 SP
with document masks and DeepSeek-V2 routing)."""


def _option(options: Sequence[str], key: str) -> str | None:
    values = [o.split("=", 1)[1] for o in options if o.startswith(f"{key}=")]
    return values[-1] if values else None


def tolerances(options: Sequence[str], dtype: str = "fp32") -> dict[str, dict[str, float]]:
    """``{"param": ..., "grad": ...}``: the ``TOLERANCES`` rows of ``dtype`` for a run with
    these overrides (loosened by ``CLAMPED`` after the first step where q/k/v are clamped,
    by ``BF16_MOMENTS`` for the moments and parameters under ``optim.moments_dtype=bf16``;
    runs with ``train.fp8`` have their own row, "fp8")."""
    param, grad = dict(TOLERANCES[dtype]["param"]), dict(TOLERANCES[dtype]["grad"])
    if _option(options, "model.clip_qkv") not in (None, "null", "None", "none"):
        grad["later"] = max(grad["later"], CLAMPED["grad_later"])
        param = {k: max(v, CLAMPED["param"][k]) for k, v in param.items()}
    if _option(options, "optim.moments_dtype") == "bf16":
        grad["later"] = max(grad["later"], BF16_MOMENTS["grad_later"])
        param = {k: max(v, BF16_MOMENTS["param"][k]) for k, v in param.items()}
    return {"param": param, "grad": grad}


def noise_floor_slack(ref: dict[str, Any], floor: float) -> dict[str, torch.Tensor]:
    """Per parameter, the extra distance its elements may move: for an element whose
    reference gradient was within ``floor`` of its tensor's largest at some step, 2 x the sum
    of the lrs from the first such step on; 0 for the others.

    The gradient check allows an error of ``floor`` x the tensor's scale, so the sign of such
    an element's gradient is not pinned by the comparison (a cancelling sum, e.g. an output
    row of a token the batch does not hold: measured 2e-7 of a 0.23-scale tensor). Adam
    normalises it anyway: its update is lr x m / sqrt(v), of size ~lr whatever the gradient's
    magnitude (|m^ / sqrt(v^)| <= 1.002 over two steps), so two runs may move it up to 2 lr a
    step apart -- at that step and at every later one, whose m and v still hold the unpinned
    value: an element quiet at the first step and large at the second (an embedding row of a
    token first seen in the second batch: -2.8e-9 then -8.6e-3 of a 0.18-scale tensor) has a
    second update that depends steeply on the first gradient, measured 2% of that step's lr
    apart under tp2 on one machine. Every other element keeps the tight ``param`` tolerance;
    an error a layout makes (a scaled gradient, lost moments, a wrong lr) shows on those and
    in the gradient and moment checks."""
    if "grads" not in ref or not ref.get("lrs"):
        return {}
    lrs = list(ref["lrs"])
    out = {}
    for name in ref["params"]:
        shape = ref["params"][name].shape
        slack = torch.zeros(shape, dtype=torch.float64)
        for t, grads in enumerate(ref["grads"]):
            g = grads.get(name)
            if g is None or g.shape != shape:
                continue
            g = g.double().abs()
            quiet = g <= floor * g.max()
            slack = torch.maximum(slack, quiet.double() * (2.0 * sum(lrs[t:])))
        if slack.any():
            out[name] = slack
    return out


def compare_runs(
    got: dict[str, Any],
    ref: dict[str, Any],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    param_tol: dict[str, float] | None = None,
    grad_tol: dict[str, float] | None = None,
    what: str = "",
) -> dict[str, float]:
    """Assert two ``micro_run`` reports agree, with the ``TOLERANCES`` row of their dtype
    unless given: values within atol/rtol, parameters within ``param_tol``, every gradient
    at every step and both AdamW moments of every parameter within ``grad_tol`` (skipped
    when either report lacks them). Returns the worst error of each part (relative to the
    tensor's scale for gradients and moments).

    Every check runs; the assertion message lists every diverging tensor, grouped by kind
    (router, experts, attention, norms, embeddings, ...), worst first, each with the first
    step at which it diverged (``tests/divergence.py``)."""
    errs: dict[str, float] = {}
    precision = ref.get("precision")
    assert got.get("precision") == precision, f"{what}: {got.get('precision')} vs {precision}"
    # The layout's row: under bf16 it depends on what the layout sums (``bf16_reordered``).
    table = TOLERANCES[got.get("dtype", ref.get("dtype", "fp32"))]
    if "steps" in table:  # a row compared on its first steps only (fp8)
        got, ref = _first_steps(got, table["steps"]), _first_steps(ref, table["steps"])
    atol = table["value"]["atol"] if atol is None else atol
    rtol = table["value"]["rtol"] if rtol is None else rtol
    param_tol = param_tol or table["param"]
    grad_tol = grad_tol or table["grad"]
    found = Divergences(what or "runs")

    def note(name: str, err: float) -> None:
        key = name.split("[")[0]
        errs[key] = max(errs.get(key, 0.0), err)

    def shape_differs(tensor: str, label: str, part: str, step, a, b) -> bool:
        if a.shape == b.shape:
            return False
        found.add(tensor, Check(label, part, step, math.inf, f"shape {tuple(a.shape)} vs "
                                f"{tuple(b.shape)}"))  # fmt: skip
        return True

    def check(tensor: str, label: str, step, a: Any, b: Any, atol=atol, rtol=rtol) -> None:
        part = "param" if label.startswith("param[") else "value"
        err = found.check_close(tensor, label, step, a, b, atol, rtol, part)
        if not math.isinf(err):
            note(label, err)

    def check_scaled(tensor: str, label: str, part: str, step, a, b, scale_tol: float) -> None:
        a_t, b_t = a.double(), b.double()
        if shape_differs(tensor, label, part, step, a_t, b_t):
            return
        scale = b_t.abs().max().item() if b_t.numel() else 0.0
        err = (a_t - b_t).abs().max().item() if a_t.numel() else 0.0
        rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
        if math.isnan(rel):
            rel = math.inf
        note("grad first step[" if label.startswith("grad[step 0 ") else label, rel)
        if rel > scale_tol:
            found.add(tensor, Check(
                label, part, step, rel / scale_tol,
                f"max abs error {err:.3g} is {rel:.3g} of the reference's max abs {scale:.3g} "
                f"(allowed {scale_tol:g}); ratio of norms got/ref "
                f"{a_t.norm().item() / max(b_t.norm().item(), 1e-30):.4g}",
            ))  # fmt: skip

    def same_names(kind: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
        missing, extra = sorted(set(b) - set(a)), sorted(set(a) - set(b))
        for name in missing:
            found.add(name, Check(f"{kind}[{name}]", kind, None, math.inf, "missing"))
        for name in extra:
            found.add(name, Check(f"{kind}[{name}]", kind, None, math.inf, "unexpected"))
        return [n for n in b if n in a]

    if "grads" in got and "grads" in ref:
        assert len(got["grads"]) == len(ref["grads"]), f"{what}: gradient steps differ"
        for step, (g, r) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
            tol = grad_tol["first"] if step == 0 else grad_tol["later"]
            for name in same_names("grad", g, r):
                check_scaled(name, f"grad[step {step} {name}]", "grad", step, g[name], r[name],
                             tol)  # fmt: skip
    if "optim" in got and "optim" in ref:
        for name in same_names("optim", got["optim"], ref["optim"]):
            tensor = name.rsplit(".", 1)[0]  # <parameter>.exp_avg / .exp_avg_sq
            check_scaled(tensor, f"optim[{name}]", "optim", None, got["optim"][name],
                         ref["optim"][name], grad_tol["later"])  # fmt: skip
    for key in ("loss", "grad_norm", "mtp_loss"):
        if key not in ref or (key == "mtp_loss" and all(math.isnan(x) for x in ref[key])):
            continue  # no multi-token prediction: nan in both runs
        a, b = list(got.get(key, [])), list(ref[key])
        if len(a) != len(b):
            found.add(key, Check(key, "value", None, math.inf, f"{len(a)} steps vs {len(b)}"))
            continue
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            check(key, f"{key}[step {step}]", step, x, y)
    for step, (g, r) in enumerate(zip(got["moe"], ref["moe"], strict=True)):
        if sorted(g) != sorted(r):
            found.add(
                "moe layers",
                Check(
                    f"moe[step {step}]",
                    "value",
                    step,
                    math.inf,
                    f"MoE layers {sorted(g)} vs {sorted(r)}",
                ),
            )
            continue
        for layer in r:
            for key in r[layer]:
                if key in LAYOUT_STATS:
                    continue
                tensor = f"moe.{key} layer {layer}"
                a, b = g[layer][key], r[layer][key]
                if key == "score_hist":
                    check(tensor, f"moe.score_hist total[step {step} layer {layer}]", step,
                          a.sum(), b.sum())  # fmt: skip
                    moved = 0.5 * (a - b).abs().sum().item() / max(b.sum().item(), 1.0)
                    note("moe.score_hist moved", moved)
                    if moved > table["hist"]["moved"]:
                        found.add(tensor, Check(
                            f"moe.score_hist[step {step} layer {layer}]", "value", step,
                            moved / table["hist"]["moved"],
                            f"{moved:.3%} of the router scores in another bin (allowed "
                            f"{table['hist']['moved']:.1%})",
                        ))  # fmt: skip
                    continue
                if key in PER_CALL_STATS:  # sums over forward calls: compare the means
                    a, b = a / g[layer]["calls"], b / r[layer]["calls"]
                check(tensor, f"moe.{key}[step {step} layer {layer}]", step, a, b)
    noise = noise_floor_slack(ref, grad_tol["first"])
    for name in same_names("param", got["params"], ref["params"]):
        err = found.check_close(name, f"param[{name}]", None, got["params"][name],
                                ref["params"][name], part="param", slack=noise.get(name),
                                **param_tol)  # fmt: skip
        if not math.isinf(err):
            note(f"param[{name}]", err)
    assert not found, found.message()
    return errs


def _first_steps(run: dict[str, Any], steps: int) -> dict[str, Any]:
    """A ``micro_run`` report cut to its first ``steps`` steps: no moments, no final
    parameters (they come after the last step)."""
    out = {k: v[:steps] if k in ("loss", "grad_norm", "moe", "grads", "lrs") else v
           for k, v in run.items() if k != "optim"}  # fmt: skip
    out["params"] = {}
    return out


# ----------------------------------------------------------------------------- layout checks


@dataclass(frozen=True)
class Case:
    """One cell of a layout test: ``layout`` (``parallel.*`` overrides) run on ``options``
    (model / MoE / training overrides, which the single-process reference shares)."""

    name: str
    layout: tuple[str, ...]
    options: tuple[str, ...] = ()
    fault: tuple[Any, ...] | None = None
    """For the oracle's own tests, an error planted on one rank (``rank`` None: on every
    rank): ``("scale", rank, suffix, factor)`` multiplies the reduced gradient of every
    parameter whose name ends with ``suffix``; ``("disable", rank, "module:function")``
    replaces a function of moetrain with a no-op, as if the code silently ignored what it
    implements; ``("plant", rank, name)`` installs a realistic bug of ``tests/faults.py``.
    Undone after the case."""


def scale_grads(suffix: str, factor: float) -> Callable[[Any, int], None]:
    """A ``micro_run`` injection: multiply the reduced gradients of the parameters whose
    single-process name ends with ``suffix`` by ``factor``."""

    def inject(engine: Any, step: int) -> None:
        from moetrain.train.tensors import fqn as _fqn

        for part in engine.parts:
            for name, p in part.named_parameters():
                if _fqn(name).endswith(suffix) and p.grad is not None:
                    p.grad.mul_(factor)

    return inject


def _plant(
    fault: tuple[Any, ...] | None, rank: int, undo: list[Callable[[], None]]
) -> Callable[[Any, int], None] | None:
    """Install ``fault`` on this rank (when it is this rank's); what it patched is restored
    by the callables it appends to ``undo`` (a worker runs several cases)."""
    if fault is None or fault[1] not in (None, rank):
        return None
    if fault[0] == "scale":
        return scale_grads(fault[2], fault[3])

    def patch(obj: Any, attr: str, value: Any) -> None:
        old = getattr(obj, attr)
        setattr(obj, attr, value)
        undo.append(lambda: setattr(obj, attr, old))

    if fault[0] == "disable":
        import importlib

        module, attr = fault[2].split(":")
        patch(importlib.import_module(module), attr, lambda *a, **k: None)
        return None
    if fault[0] == "plant":
        from faults import plant

        plant(fault[2], patch)
        return None
    raise ValueError(f"unknown fault {fault!r}")


_REFERENCES: dict[tuple[tuple[str, ...], int], dict[str, Any]] = {}


def reference_run(options: tuple[str, ...], steps: int) -> dict[str, Any]:
    """The single-process ``micro_run`` of ``options`` (computed once per test process)."""
    key = (tuple(options), steps)
    if key not in _REFERENCES:
        with tempfile.TemporaryDirectory() as out:
            _REFERENCES[key] = micro_run(out, steps, *options)  # on ORACLE_THREADS, as a rank
    return _REFERENCES[key]


ANCHORED_PARAM_TOL = {"atol": 1e-6, "rtol": 1e-5}
"""Parameters (and buffers) after one step that the layout and one process take from the same
parameters, optimizer state and gradients (``anchored_compare``): only the gradient norm's
reduction order differs (the clipping factor, one fp32 rounding) and the optimizer's
elementwise arithmetic is the same: measured 0 (MiniMax-M2's options under tp2 + SP on an
AVX2 CPU, gradient norms 2e-16 apart)."""


def anchored_run(options: tuple[str, ...], got: dict[str, Any], steps: int) -> dict[str, Any]:
    """One process replaying a layout's run step by step: before every step after the first
    it takes the layout's parameters, buffers and optimizer state (``got["before"]``), so its
    forward and backward see what the layout's saw; its reduced gradients are recorded, then
    replaced by the layout's own (``got["grads"]``) before clipping and the optimizer step, so
    its update is one process's update of the layout's inputs. Returns a ``micro_run``-shaped
    report whose ``after`` lists the parameters and optimizer state after every step."""
    from moetrain.train.tensors import fqn as _fqn
    from moetrain.train.trainer import Trainer

    with one_thread(), tempfile.TemporaryDirectory() as out:
        trainer = Trainer(micro_config(out, f"train.steps={steps}", *options))
        engine = trainer.engine
        named = {_fqn(n): p for part in engine.parts for n, p in part.named_parameters()}
        grads: list[dict[str, torch.Tensor]] = []

        def hook(engine: Any) -> None:
            grads.append(engine.full_grad_dict())
            for name, g in got["grads"][len(grads) - 1].items():
                p = named[name]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(g)

        def load(state: dict[str, dict[str, torch.Tensor]]) -> None:
            with torch.no_grad():
                for part in engine.parts:
                    for n, t in part.state_dict(keep_vars=True).items():
                        t.copy_(state["params"][_fqn(n)])
                for opt in engine.optimizers:
                    for group in opt.param_groups:
                        for p in group["params"]:
                            name = next(k for k, v in named.items() if v is p)
                            for moment, value in opt.state[p].items():
                                key = f"{name}.{moment}"
                                if key in state["optim"]:
                                    value.copy_(state["optim"][key])

        engine.grad_hook = hook
        report: dict[str, Any] = {"loss": [], "mtp_loss": [], "grad_norm": [], "moe": [],
                                  "grads": grads, "after": []}  # fmt: skip
        for step in range(steps):
            if step > 0:
                load(got["before"][step - 1])
            res = trainer.train_step()
            report["loss"].append(res.loss)
            report["mtp_loss"].append(res.mtp_loss)
            report["grad_norm"].append(res.grad_norm)
            report["moe"].append(
                {i: {k: v.detach().cpu().clone() for k, v in st.items()}
                 for i, st in res.moe.items()}
            )  # fmt: skip
            report["after"].append({"params": trainer.full_model_state_dict(),
                                    "optim": engine.full_optimizer_state()})  # fmt: skip
        report["dtype"] = _tolerance_row(trainer)
        report["precision"] = (str(trainer.dtype), trainer.cfg.train.fp8)
        trainer.close()
    return report


def _step_report(run: dict[str, Any], step: int, state: dict[str, Any]) -> dict[str, Any]:
    """One step of a ``micro_run`` report, with the parameters and optimizer state after it."""
    keys = ("loss", "mtp_loss", "grad_norm", "moe", "grads")
    return {**{k: run[k][step : step + 1] for k in keys}, "params": state["params"],
            "optim": state["optim"], "dtype": run.get("dtype", "fp32"),
            "precision": run.get("precision")}  # fmt: skip


def anchored_compare(
    options: tuple[str, ...], got: dict[str, Any], steps: int, what: str = ""
) -> dict[str, float]:
    """The layout's run step by step against one process given the same inputs
    (``anchored_run``): every step's losses, statistics and gradients within the FIRST step's
    tolerance of its dtype (where both see the same parameters, a layout only reorders
    sums), and the parameters and optimizer state after every step within
    ``ANCHORED_PARAM_TOL``. Raises AssertionError naming the step and the tensors.

    Why: a whole-run comparison allows later steps the divergence Adam amplifies from
    last-bit differences (``TOLERANCES``' "later" rows), and how far that goes depends on
    the machine's BLAS (an AVX2 CPU sums in other blocks than an AVX-512 one) and on the
    options. Step by step there is nothing to amplify: an update of the same inputs is the
    same update, so a layout that is right at every step passes on any machine, and one
    that is wrong at any step fails at that step, with the tight tolerance. Returns the worst
    error of each part over the steps.

    Measured on an AMD EPYC forced to AVX2 (``ATEN_CPU_CAPABILITY=avx2``), MiniMax-M2's options
    under tp2 + SP (tests/parallel/test_arch_layouts.py): first-step gradients within 7.1e-7
    of their tensors' scale and no sign flipped, yet after the first update an embedding
    element whose gradient is of the order of Adam's eps lay 0.084 lr from one process's, and
    the second step's expert gradients 1.1e-3 of their scale apart (two parameters 1.2 and 2.3
    times the fp32 "param" row); step by step, gradients within 1.1e-6 of scale and updates 0
    apart. With AVX-512 the cell passes the whole-run comparison."""
    ref = anchored_run(options, got, steps)
    worst: dict[str, float] = {}
    dtype = got.get("dtype", "fp32")
    first = TOLERANCES[dtype]["grad"]["first"]
    for step in range(steps):
        after = got["before"][step] if step + 1 < steps else {
            "params": got["params"], "optim": got["optim"]}  # fmt: skip

        mine, theirs = _step_report(got, step, after), _step_report(ref, step, ref["after"][step])
        errs = compare_runs(mine, theirs, param_tol=ANCHORED_PARAM_TOL,
                            grad_tol={"first": first, "later": first},
                            what=f"{what} anchored at step {step}")  # fmt: skip
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
    return worst


def _cases_worker(
    rank: int,
    world_size: int,
    cases: list[Case],
    refs: dict[tuple[str, ...], dict[str, Any]],
    steps: int,
    wants: list[list[dict[str, Any]]],
) -> list[dict[str, Any]]:
    out = []
    counted: set[tuple[str, ...]] = set()  # layouts whose traffic a cell already counted
    for case, want in zip(cases, wants, strict=True):
        overrides = [*case.options, *case.layout]
        undo: list[Callable[[], None]] = []
        inject = _plant(case.fault, rank, undo)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                traffic = case.layout not in counted
                got = micro_run(tmp, steps, *overrides, inject=inject, traffic=traffic)
                counted.add(case.layout)
        except Exception as exc:
            exc.add_note(f"in the cell {case.name}")
            raise
        finally:
            for restore in reversed(undo):
                restore()
        problems = [
            f"layout {m}"
            for m in check_layout(got["layout"], overrides, world_size, rank, want[rank])
        ]
        errs: dict[str, float] = {}
        result: dict[str, Any] = {"name": case.name, "problems": problems}
        try:
            errs = compare_runs(
                got,
                refs[case.options],
                **{
                    f"{k}_tol": v
                    for k, v in tolerances(overrides, got.get("dtype", "fp32")).items()
                },
                what=f"rank {rank}",
            )
        except AssertionError as exc:
            # Beyond the whole-run tolerances: the parent replays the run step by step
            # (anchored_compare), which decides.
            result.update(trajectory=str(exc), got={k: v for k, v in got.items() if k != "layout"})
        result["errs"] = errs
        out.append(result)
    return out


def check_cases(world_size: int, cases: list[Case], steps: int, timeout: float) -> None:
    """Run every case on ``world_size`` spawned ranks (one job, a fresh Trainer per case);
    on every rank compare the run with the single-process reference of its options
    (``compare_runs``: losses, MoE statistics, every gradient of every step, the optimizer
    moments and the final parameters) and its layout facts with what the config asks
    (``expected_layout`` of the raw request, computed here, before and outside the run).
    Raises one AssertionError listing every failing case and rank."""
    refs = {c.options: reference_run(c.options, steps) for c in cases}
    wants = [
        [expected_layout([*c.options, *c.layout], world_size, r) for r in range(world_size)]
        for c in cases
    ]
    results = run_ranks(_cases_worker, world_size, cases, refs, steps, wants, timeout=timeout)
    failures, worst, anchored = [], {}, []
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank, strict=True):
            problems = res["problems"]
            if "trajectory" in res:
                try:
                    errs = anchored_compare(case.options, res["got"], steps, what=f"rank {rank}")
                    anchored.append(f"{res['name']} (rank {rank}) {errs}")
                except AssertionError as exc:
                    problems = [*problems, res["trajectory"], str(exc)]
            if problems:
                failures.append(f"{res['name']} (rank {rank}):\n  " + "\n  ".join(problems))
            for k, v in res["errs"].items():
                worst[k] = max(worst.get(k, 0.0), v)
    print(f"{len(cases)} cases x {world_size} ranks; worst errors {worst}")
    if anchored:  # past the whole-run tolerances, exact step by step
        print("decided step by step (anchored_compare): " + "; ".join(anchored))
    assert not failures, "\n\n".join(failures)


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


def compare_resumed(got: dict[str, Any], ref: dict[str, Any], what: str = "") -> None:
    """A ``reshard_run`` against the uninterrupted single-process ``micro_run``: losses,
    the last step's gradients, the optimizer moments and the parameters."""
    later = TOLERANCES[got.get("dtype", ref.get("dtype", "fp32"))]["grad"]["later"]
    compare_runs(
        {**got, "grad_norm": [], "moe": []},
        {**ref, "grad_norm": [], "moe": [], "grads": ref["grads"][-1:], "mtp_loss": []},
        grad_tol={"first": later, "later": later},  # the resumed step is a later step
        what=what,
    )


def _reshard_worker(
    rank: int,
    world_size: int,
    root: str,
    cases: list[tuple[str, list[str], list[str]]],
    ref: dict[str, Any],
    steps: int,
) -> list[str]:
    problems = []
    for i, (name, save, load) in enumerate(cases):
        got = reshard_run(f"{root}/{i}", steps, save, load)
        try:
            compare_resumed(got, ref, what=f"{name} (rank {rank})")
        except AssertionError as exc:
            problems.append(str(exc))
    return problems


def check_reshards(
    world_size: int,
    cases: list[tuple[str, list[str], list[str]]],
    steps: int,
    timeout: float,
    options: tuple[str, ...] = (),
) -> None:
    """Each (name, save layout, load layout) resumed mid-run reproduces the single-process
    run of ``options`` on every rank (``compare_resumed``)."""
    ref = reference_run(options, steps)
    cases = [(n, [*options, *s], [*options, *ld]) for n, s, ld in cases]
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_reshard_worker, world_size, root, cases, ref, steps, timeout=timeout)
    failures = [p for per_rank in results for p in per_rank]
    assert not failures, "\n\n".join(failures)
