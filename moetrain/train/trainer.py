"""The trainer: builds everything from a JobConfig, runs steps, evaluates, checkpoints, logs.

This is the one place where config sections, model, data, optimizer, checkpoints and
logging meet. Each piece receives only its own config section. The step itself goes through
``moetrain.train.engine.Engine``, which hides the parallel layout; the layout is validated
before the process group starts, and rank 0 alone logs and writes TensorBoard.

The ``Trainer`` is one class (the module is about 600 lines) because it is the composition
root: its methods are the run's phases in order (build, train step, evaluate, checkpoint and
resume, log, close), each a few lines over the collaborators beside it -- ``runtime``
(device, process group, RNG), ``fingerprint``, ``memory_check``, ``announce``, ``engine``
(the step), ``checkpoint``, ``metrics`` and ``resilience``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moetrain.config import ConfigError, JobConfig, config_to_yaml
from moetrain.data import (
    PackedBatches,
    check_data,
    eval_token_domains,
    load_tokenizer,
    unigram_entropy,
)
from moetrain.kernels.fp8 import resolve_backend as resolve_fp8_backend
from moetrain.model import Transformer, meta_model
from moetrain.model.fp8 import convert_to_fp8
from moetrain.model.masks import document_lengths
from moetrain.model.precision import Precision
from moetrain.parallel.dims import ParallelDims
from moetrain.train.announce import BENCHMARK_TAG, announce_start
from moetrain.train.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint
from moetrain.train.engine import Engine
from moetrain.train.fingerprint import model_fingerprint
from moetrain.train.memory_check import check_memory
from moetrain.train.metrics import (
    MetricsWriter,
    format_log_line,
    layer_summary,
    merge_stats,
    peak_flops,
    synchronize,
)
from moetrain.train.replay import load_replay_step, save_record
from moetrain.train.resilience import (
    CollapseMonitor,
    FaultInjector,
    NonFiniteError,
    NonFiniteGuard,
    PreemptionGuard,
)
from moetrain.train.resume import check_resume_config, refuse_weights_only
from moetrain.train.runtime import (
    init_distributed,
    pick_device,
    rng_state,
    set_rng_state,
    setup_logging,
    world_size,
)
from moetrain.train.specialization import SpecializationLog
from moetrain.train.start import Start, find_start

log = logging.getLogger("moetrain")



@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float
    moe: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    mtp_loss: float = float("nan")
    """The multi-token-prediction loss (lambda / D * sum_k L^k); nan without it."""
    flops_per_token: float = float("nan")
    """Model FLOPs per token of the step (this rank's sequences): under document masking the
    attention's share is counted from the documents' actual lengths."""
    max_logits: dict[int, float] = field(default_factory=dict)
    """QK-clip (``optim.qk_clip``): each attention layer's largest pre-softmax logit of the
    step's forwards, over the job (before the rescale)."""


class Trainer:
    """The trainer for every layout: one process, or a torchrun job with ``parallel.*``."""

    def __init__(self, cfg: JobConfig, start: Start | None = None):
        """``start``: where the first weights come from when ``model.init_from`` or
        ``model.upcycle_from`` asks for one (``moetrain.train.start``); by default the
        installed one, found through the package's entry points."""
        self.cfg = cfg
        tcfg = cfg.train
        self.device = pick_device(tcfg.device)
        # The compute dtype, chosen once (moetrain.model.precision): the engine enters it.
        self.precision = Precision.choose(tcfg.dtype, self.device.type)
        self.dtype = self.precision.dtype
        if cfg.model.attention_backend == "flex" and self.device.type == "cpu":
            raise ConfigError(
                "model.attention_backend: flex trains on CUDA only (FlexAttention has no "
                "backward on CPU); use sdpa, which gives the same numbers (docs/attention.md)"
            )
        if cfg.moe.kernels == "triton" and cfg.moe.num_experts:
            from moetrain.kernels import resolve_backend

            try:  # here rather than at the first forward: a config error, not a traceback
                resolve_backend("triton", self.device)
            except RuntimeError as exc:
                raise ConfigError(f"moe.kernels: {exc}") from None
        self.out_dir = Path(tcfg.output_dir)
        # Starting from another framework's checkpoint: its architecture replaces the YAML's
        # first (the start factory edits cfg).
        if start is None:
            start = find_start(cfg)
        # The layout is checked against the world size before anything else is built.
        dims = ParallelDims.from_config(cfg.parallel, world_size())

        # Data first: a missing dataset or tokenizer must fail before any real work.
        check_data(cfg.data, cfg.model.document_mask)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir)
        vocab = cfg.model.vocab_size or self.tokenizer.vocab_size
        if vocab < self.tokenizer.vocab_size:
            raise ConfigError(
                f"model.vocab_size: {vocab} is smaller than the tokenizer's "
                f"vocabulary of {self.tokenizer.vocab_size}"
            )
        cfg.model.vocab_size = vocab
        self.dims = dims.validate(cfg)  # before any process group exists
        if cfg.moe.num_experts:  # moe.kernels auto on CUDA logs each op's measured choice
            from moetrain.kernels.selection import MoEShape, choose_kernels

            m, tokens = cfg.moe, dims.micro_batch_size(cfg) * cfg.data.seq_len // dims.cp
            shape = MoEShape(tokens, cfg.model.dim, m.expert_ffn_dim, m.num_experts, m.top_k,
                             m.score_func)  # fmt: skip
            choose_kernels(m.kernels, self.device, shape, self.dtype)
        if tcfg.memory_check:  # before anything is allocated
            check_memory(cfg, dims, self.device)

        init_distributed(self.device, tcfg.collective_timeout_s)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.is_main = self.rank == 0
        meshes = dims.build_mesh(self.device.type) if dist.is_initialized() else None
        coords = dims.coords(self.rank)
        dp_rank = coords["dp_replicate"] * dims.dp_shard + coords["dp_shard"]
        self.dp_rank = dp_rank
        mbs = dims.micro_batch_size(cfg)
        self.train_data = PackedBatches(
            cfg.data, self.tokenizer, "train", tcfg.global_batch_size, mbs, dp_rank, dims.dp
        )
        # Eval: at least eval_batches * micro_batch_size sequences, rounded up to what the
        # layout runs at once (dp ranks x pipeline micro-batches).
        unit = dims.dp * mbs * (dims.breadth_first(cfg) if dims.pp > 1 else 1)
        eval_seqs = -(-tcfg.eval_batches * tcfg.micro_batch_size // unit) * unit
        self.eval_seqs = eval_seqs
        self.eval_data = PackedBatches(
            cfg.data, self.tokenizer, "eval", eval_seqs, mbs, dp_rank, dims.dp
        )

        # The model is built on the meta device (no memory): the engine applies the layout to
        # it, then gives this rank's shards alone their storage and their initial values,
        # which depend on the seed and never on the layout (``moetrain.model.init``).
        model: Transformer = meta_model(cfg.model, cfg.moe)
        if tcfg.fp8 != "none":  # before any parallelism: the same modules under every layout
            backend = resolve_fp8_backend(tcfg.fp8_backend, self.device)
            conv = convert_to_fp8(model, tcfg.fp8, tcfg.fp8_experts, backend)
            log.info("fp8 %s (%s): %d linear layers, routed experts of %d MoE layers; "
                     "kept in high precision for their widths: %s", tcfg.fp8, backend,
                     len(conv.linears), len(conv.expert_layers),
                     ", ".join(conv.unaligned) or "none")  # fmt: skip
        self.n_params, self.n_active = model.num_params(), model.num_params(active=True)
        self.moe_layer_ids = sorted(model.moe_layers())
        self.n_moe_layers = len(self.moe_layer_ids)
        self.flops_per_token = model.flops_per_token(cfg.data.seq_len)
        # Under document masking the attention's FLOPs follow the documents of each step.
        self._dense_flops = model.dense_flops_per_token()
        self._attention_flops = model.attention_flops
        self._doc_lengths: list[np.ndarray] = []  # pieces trained on since the last histogram
        # Weights a start loads next are not drawn first (a start from before ``names``
        # existed has every weight drawn, then overwritten, as all starts once did).
        names = getattr(start, "names", None)
        loaded = names() if names is not None else ()
        self.engine = Engine(cfg, model, dims, meshes, self.device, self.precision, loaded)
        del model
        if start is not None:  # every rank reads only the slices it holds
            start.load(self.engine)
        # An asynchronous save's collectives run beside training's: on a group of their own.
        ckpt_group = None
        if tcfg.checkpoint_async and dist.is_available() and dist.is_initialized():
            ckpt_group = dist.new_group(backend="gloo")
        self.ckpt = CheckpointManager(
            self.out_dir / "checkpoints", tcfg.keep_last, process_group=ckpt_group
        )
        self.fingerprint = model_fingerprint(cfg, vocab)
        self.step = 0
        self.resumed_from: Path | None = None  # the checkpoint maybe_resume loaded
        torch.manual_seed(tcfg.seed)  # whatever draws from the global generator starts here

        # Dashboard cadence, dead-expert/imbalance warnings. TensorBoard is opened by fit once
        # the start is accepted (``_open_run_dir``): a refused start writes no event file.
        self.writer = MetricsWriter(None, cfg.log)
        # The MFU denominator, measured by fit() (on CPU a timed matmul: not worth its 0.2 s
        # for a trainer driven step by step, as tests and tools do).
        self.peak_flops, self.peak_source = float("nan"), "not measured"
        self.nonfinite = NonFiniteGuard(tcfg.nonfinite_policy, tcfg.max_nonfinite_skips)
        self.faults = FaultInjector(self.rank)
        self.collapse = CollapseMonitor(
            cfg.log.collapse_fraction, cfg.log.collapse_steps, cfg.moe.top_k, self.writer.warnings
        )
        # Expert specialization: every evaluation records the eval tokens' routing (a
        # collective, so every rank knows); rank 0 saves and shows it (``_open_run_dir``).
        self.record_eval_routing = cfg.log.specialization and self.n_moe_layers > 0
        self.specialization: SpecializationLog | None = None

    def _measure_peak(self, seconds: float = 0.2) -> None:
        """The MFU denominator: a GPU's datasheet peak, or on CPU a matmul measured now."""
        self.peak_flops, self.peak_source = peak_flops(self.device, seconds)
        if self.dims.world_size > 1:  # tokens/s is the whole job's: so is the peak
            self.peak_flops *= self.dims.world_size
            self.peak_source += f" x {self.dims.world_size} ranks"

    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and persistent buffers as plain CPU tensors, gathered
        over every parallel dimension (collective: every rank calls it and gets it)."""
        return self.engine.full_state_dict()

    def close(self) -> None:
        """Wait for a checkpoint still being written; flush and close the TensorBoard
        writer."""
        self.ckpt.close()
        self.writer.flush()
        self.writer.close()

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, asynchronous: bool = False) -> Path | None:
        """Save the checkpoint of this step and return its path once published; with
        ``asynchronous`` (``train.checkpoint_async``), stage it and return None while a
        background thread writes it. A synchronous save waits for the one in flight first."""
        extra = {
            "step": self.step,
            "scheduler": self.engine.scheduler_state(),
            "data": self.train_data.state_dict(),
            "rng": rng_state(),
            "config": self.cfg.to_dict(),
        }
        if asynchronous:
            self.ckpt.save_async(
                self.step, self.engine.app_state(), extra, fingerprint=self.fingerprint
            )
            return None
        self.ckpt.wait()
        path = self.ckpt.save(
            self.step, self.engine.app_state(), extra, fingerprint=self.fingerprint
        )
        log.info("saved checkpoint %s", path)
        return path

    def maybe_resume(self) -> None:
        """Load the checkpoint ``train.resume`` names, or refuse the start (ConfigError,
        CheckpointError, DataError). Reads only: nothing in the run directory is written."""
        resume = self.cfg.train.resume
        if resume == "never":
            # Any checkpoint directory counts, verified or not: starting over would bury it.
            if self.ckpt.checkpoints():
                raise ConfigError(
                    f"train.resume: 'never' but {self.ckpt.root} already holds "
                    "checkpoints; pick another train.output_dir or resume"
                )
            return
        path = self.ckpt.latest() if resume == "auto" else Path(resume)
        if path is None:
            existing = self.ckpt.checkpoints()
            if existing:
                # Starting over would bury them (and keep_last could prune them): refuse.
                newest = existing[-1][1]
                try:
                    verify_checkpoint(newest)
                    problem = "it does not load"
                except CheckpointError as exc:
                    problem = str(exc)
                raise CheckpointError(
                    f"train.resume: 'auto' found {len(existing)} checkpoint(s) in "
                    f"{self.ckpt.root} but none verifies ({problem}); repair or move them, or "
                    "start a new train.output_dir"
                )
            return
        # What the checkpoint is (verified, its fingerprint matched, its step and config read)
        # before any tensor is: a refused resume costs no load.
        path, saved = self.ckpt.peek(path, expected_fingerprint=self.fingerprint)
        refuse_weights_only(path, saved)
        check_resume_config(path, saved, self.cfg)
        # Keys are full-model names under every layout: DCP reshards a checkpoint saved under
        # another layout on load. Data state is the global stream position (layout-free).
        state = self.engine.app_state()
        extra = self.ckpt.load(path, state, expected_fingerprint=self.fingerprint)
        self.engine.load_app_state(state)
        if int(extra["step"]) > 0:  # a step-0 start (train.steps=0) keeps this run's schedule
            self.engine.load_scheduler_state(extra["scheduler"])
        self.train_data.load_state_dict(extra["data"])
        set_rng_state(extra["rng"])
        self.step = int(extra["step"])
        self.resumed_from = path
        log.info("resumed from %s at step %d", path, self.step)
        schedule = self.engine.schedulers[0].lr_lambdas[0]
        total = schedule.total_steps
        if self.cfg.train.steps > total and self.step > 0 and schedule.schedule == "cosine":
            log.warning("train.steps=%d runs past the resumed schedule's %d steps: the learning "
                        "rate stays at its floor (optim.min_lr_ratio x optim.lr) from step %d "
                        "on", self.cfg.train.steps, total, total)  # fmt: skip

    # ------------------------------------------------------------------ steps

    def train_step(self) -> StepResult:
        start = time.perf_counter()
        tcfg = self.cfg.train
        micro_batches = self.train_data.next_step()
        replay = self._replay(micro_batches) if tcfg.routing_replay is not None else None
        loss = self.engine.forward_backward(
            micro_batches, replay=replay, record=tcfg.record_routing
        )
        lr = self.engine.lr
        mtp_loss = self.engine.pop_mtp_loss()
        if tcfg.record_routing:
            record = self.engine.routing_record()
            if self.is_main and record is not None:
                moe = self.cfg.moe
                save_record(self.out_dir / "routing" / "train", self.step + 1, record,
                            moe.num_experts, moe.top_k, loss)  # fmt: skip
        # A non-finite loss or norm leaves the parameters untouched (see NonFiniteGuard).
        grad_norm = self.engine.optimizer_step(self.cfg.optim.grad_clip, loss=loss)
        moe = self.engine.moe_stats()
        if not NonFiniteGuard.is_bad(loss, grad_norm):  # a skipped step changes no state
            self.engine.update_expert_bias(moe)
        max_logits = self.engine.max_logits()
        self.step += 1
        tokens = sum(b["input_ids"].numel() for b in micro_batches) * self.dims.dp
        flops = self._step_flops_per_token(micro_batches)
        synchronize(self.device)
        seconds = time.perf_counter() - start
        return StepResult(loss, grad_norm, lr, tokens, seconds, moe, mtp_loss, flops, max_logits)

    def _step_flops_per_token(self, micro_batches: list[dict[str, torch.Tensor]]) -> float:
        """Model FLOPs per token of this rank's sequences; records their document pieces
        for the document-length histogram. Under document masking each piece attends within
        itself, so the attention costs the sum of its pieces' squares, not the sequences'."""
        histograms, document_mask = self.cfg.log.histogram_every, self.cfg.model.document_mask
        if "doc_ends" not in micro_batches[0] or not (histograms or document_mask):
            return self.flops_per_token
        lengths = document_lengths(torch.cat([b["doc_ends"] for b in micro_batches]))
        if histograms:
            self._doc_lengths.append(lengths.numpy())
        if not document_mask:
            return self.flops_per_token
        return self._dense_flops + self._attention_flops(lengths) / float(lengths.sum())

    def _replay(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict[int, torch.Tensor]:
        """The routing ``train.routing_replay`` gives the next step, checked against the step's
        data on every rank (a mismatch anywhere stops every rank with the same error)."""
        cfg = self.cfg
        inputs, ids = load_replay_step(
            cfg.train.routing_replay, self.step + 1, self.moe_layer_ids,
            cfg.train.global_batch_size, cfg.data.seq_len, cfg.moe.num_experts, cfg.moe.top_k,
        )  # fmt: skip
        mine = torch.cat([b["input_ids"] for b in micro_batches])
        lo = self.dp_rank * mine.shape[0]
        bad = torch.tensor([0.0 if torch.equal(inputs[lo : lo + mine.shape[0]], mine) else 1.0])
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            raise ConfigError(
                f"train.routing_replay: the input_ids of step {self.step + 1}'s routing file are "
                "not the step's global batch; the replay and the data stream are not aligned "
                "(data.dataset, data.seed, data.seq_len, the step a resumed run starts from)"
            )
        return ids

    def probed_step(self, probe: Callable[[str], None]) -> StepResult:
        """One training step with ``probe(phase)`` called after its forward, its backward and
        its optimizer step (the accounting's memory probes: ``measure_step`` of
        ``moetrain.parallel.accounting``, whose ``MeasuredRun`` the trainer is)."""
        self.engine.probe = probe
        try:
            return self.train_step()
        finally:
            self.engine.probe = None

    def _measured_step(self) -> StepResult:
        """A training step under the accounting probes (``moetrain.parallel.accounting``):
        this rank's model-state bytes beside the ZeRO formula and its bytes sent per
        collective kind, to TensorBoard and the log."""
        from moetrain.parallel.accounting import (
            measure_step,
            optimizer_state_bytes_per_param,
            zero_bytes_per_param,
        )

        report = measure_step(self)
        d = self.dims
        zero = self.cfg.parallel.zero_stage if d.dp_cp > 1 else 0
        # The formula's optimizer term read from the state (bf16 moments, Muon's one buffer)
        optim_bytes = optimizer_state_bytes_per_param(self.engine.optimizers)
        formula = zero_bytes_per_param(zero, d.dp_shard * d.cp, optim_bytes=optim_bytes)
        formula *= report.params_per_rank
        scalars = report.as_scalars()
        scalars["memory/model_state_over_zero_formula"] = report.peak.total / formula
        self.writer.scalars(scalars, self.step)
        sent = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(report.sent.items()))
        log.info(
            "accounting (rank 0, step %d): model state %.2f MB = %.3f x the ZeRO-%d "
            "formula; sent %s",
            self.step,
            report.peak.total / 1e6,
            report.peak.total / formula,
            zero,
            sent or "nothing",
        )
        return report.result

    @torch.no_grad()
    def evaluate(self, record_routing: bool = False) -> float:
        """The held-out loss; with ``record_routing`` (every rank), the eval tokens' routing
        too, saved and shown by rank 0 (``moetrain.train.specialization``)."""
        self.eval_data.reset()
        routing: dict[str, Any] | None = {} if record_routing else None
        loss = self.engine.eval_loss(self.eval_data.next_step(), routing)
        if routing is not None and self.specialization is not None:
            self.specialization.on_eval(self.step, routing, loss)
        return loss

    # ------------------------------------------------------------------ loop

    def fit(self, stop_at: int | None = None, *, finished_ok: bool = False) -> dict[str, float]:
        """Train to ``train.steps`` (or stop early at ``stop_at`` with a checkpoint, as an
        interruption would) and return the final eval loss and the unigram entropy.

        A resume that would train nothing (the checkpoint is at ``train.steps`` or past it)
        is refused with a ConfigError, unless ``finished_ok``: then the run is evaluated and
        summarised again (a sweep re-reading a finished run)."""
        cfg, tcfg = self.cfg, self.cfg.train
        end = tcfg.steps if stop_at is None else min(stop_at, tcfg.steps)
        # Validate first, write after: a refused start leaves the run directory as it was.
        self.maybe_resume()
        if self.resumed_from is not None and self.step >= tcfg.steps and not finished_ok:
            raise ConfigError(
                f"train.steps: {tcfg.steps}, and the checkpoint {self.resumed_from} is at step "
                f"{self.step}: nothing to train. Raise train.steps to train on, or give a new "
                "run its own train.output_dir"
            )
        self._open_run_dir()
        self._measure_peak()
        entropy = unigram_entropy(self.tokenizer, cfg.data) if self.is_main else 0.0
        announce_start(
            cfg, self.dims, self.writer, self.step, params=self.n_params,
            active_params=self.n_active, moe_layers=self.n_moe_layers, device=self.device,
            dtype=self.dtype, entropy=entropy, peak_flops=self.peak_flops,
            peak_source=self.peak_source, resumed=self.resumed_from is not None,
        )  # fmt: skip

        bar = None
        if cfg.log.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=tcfg.steps, initial=self.step, unit="step", dynamic_ncols=True)
        window: list[StepResult] = []
        summary: dict[str, float] = {"unigram_entropy": entropy}
        eval_loss = None
        with PreemptionGuard() as preempt:
            eval_loss = self._loop(end, window, bar, preempt)
            self.ckpt.wait()  # a save in flight is published before the run ends
        if tcfg.steps == 0 and self.step == 0:
            # The starting model itself (an upcycled or imported start), for export.
            self.save_checkpoint()
        if bar is not None:
            bar.close()
        self.writer.warnings.flush()
        if self.specialization is not None and self.step == tcfg.steps:
            self.specialization.finish()
        self.writer.flush()
        self.writer.close()
        if preempt.signum is not None:
            log.info(
                "stopped at step %d after %s; the next launch resumes from the checkpoint",
                self.step,
                signal.Signals(preempt.signum).name,
            )
            summary.update(
                {
                    "eval_loss": float("nan") if eval_loss is None else eval_loss,
                    "step": self.step,
                    "preempted": 1.0,
                }
            )
            return summary
        if eval_loss is None:
            eval_loss = self.evaluate()
        summary.update({"eval_loss": eval_loss, "step": self.step})
        log.info("done: eval loss %.4f nats/token vs unigram entropy %.4f", eval_loss, entropy)
        return summary

    def _open_run_dir(self) -> None:
        """Rank 0, once the start is accepted: write ``config.yaml`` (what the tools rebuild
        the model from) and open the TensorBoard writer (which creates an event file)."""
        if not self.is_main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.yaml").write_text(config_to_yaml(self.cfg))
        if self.cfg.log.tensorboard:
            self.writer.open(self.out_dir / "tb")
        if self.record_eval_routing:
            moe = self.cfg.moe
            domains = eval_token_domains(self.cfg.data, self.tokenizer, self.eval_seqs)
            self.specialization = SpecializationLog(
                self.out_dir, self.writer, self.tokenizer.decode, domains, moe.num_experts,
                moe.top_k, self.cfg.log.specialization_top_tokens,
            )  # fmt: skip

    def _loop(
        self, end: int, window: list[StepResult], bar: Any, preempt: PreemptionGuard
    ) -> float | None:
        """Steps until ``end`` or a preemption signal; returns the last eval loss."""
        cfg, tcfg = self.cfg, self.cfg.train
        eval_loss = None
        measure_at = self.step + 2  # the second step: Adam states exist, shapes are settled
        while self.step < end:
            self.faults.maybe_fail(self.step + 1)
            res = self._measured_step() if self.step + 1 == measure_at else self.train_step()
            window.append(res)
            tok_s = res.tokens / res.seconds
            mfu = tok_s * res.flops_per_token / self.peak_flops
            if NonFiniteGuard.is_bad(res.loss, res.grad_norm):
                try:
                    self.nonfinite.on_bad_step(self.step, res.loss, res.grad_norm)
                except NonFiniteError:
                    # Parameters and optimizer were left untouched: this is the last good
                    # state, positioned after the bad batch.
                    self.save_checkpoint()
                    raise
            scalars = {
                "train/loss": res.loss,
                "train/lr": res.lr,
                "train/grad_norm": res.grad_norm,
                "perf/tokens_per_s": tok_s,
                "perf/mfu": mfu,
                "train/skipped_steps": self.nonfinite.skipped,
            }
            if self.cfg.model.mtp_depth:
                scalars["train/mtp_loss"] = res.mtp_loss
            for layer, value in res.max_logits.items():
                scalars[f"attention/max_logit/layer_{layer}"] = value
            self.writer.scalars(scalars, self.step)
            self.writer.moe_layers(res.moe, self.step)
            every = cfg.log.histogram_every
            if every and self.step % every == 0 and self._doc_lengths:
                self.writer.document_lengths(np.concatenate(self._doc_lengths), self.step)
                self._doc_lengths = []
            if self.is_main:
                self.collapse.update(self.step, res.moe)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{res.loss:.3f}", tok_s=f"{tok_s:,.0f}")
            last = self.step == end
            if (tcfg.eval_every and self.step % tcfg.eval_every == 0) or last:
                eval_loss = self.evaluate(record_routing=self.record_eval_routing)
                self.writer.scalars({"eval/loss": eval_loss}, self.step)
            if self.step % cfg.log.log_every == 0 or last:
                self._log_window(
                    window,
                    eval_loss if self.step % max(tcfg.eval_every, 1) == 0 or last else None,
                    bar,
                )
                window = []
            saved = (tcfg.checkpoint_every and self.step % tcfg.checkpoint_every == 0) or last
            if saved:  # the last one synchronously: the run ends with it on disk
                self.save_checkpoint(asynchronous=tcfg.checkpoint_async and not last)
            if preempt.should_stop(self.device):
                if not saved:  # after the save in flight, if any
                    self.save_checkpoint()
                break
        return eval_loss

    def _log_window(self, window: list[StepResult], eval_loss: float | None, bar) -> None:
        self.writer.warnings.flush()  # repeated warnings of the window: one line per kind
        if self.peak_source.startswith("measured"):
            self._measure_peak(0.05)  # the CPU is shared: MFU against its speed right now
        tokens = sum(r.tokens for r in window)
        seconds = sum(r.seconds for r in window)
        tok_s = tokens / max(seconds, 1e-9)
        values: dict[str, Any] = {
            "loss": sum(r.loss for r in window) / len(window),
            "lr": window[-1].lr,
            "grad_norm": window[-1].grad_norm,
            "tokens_per_s": tok_s,
            "mfu": sum(r.tokens * r.flops_per_token for r in window)
            / max(seconds, 1e-9)
            / self.peak_flops,
        }
        merged: dict[int, dict[str, torch.Tensor]] = {}
        for r in window:
            for i, s in r.moe.items():
                merged[i] = merge_stats(merged.get(i), s)
        if merged:
            sums = [layer_summary(s) for s in merged.values()]
            values["aux"] = sum(s["aux_loss"] for s in sums) / len(sums)
            values["max_over_mean"] = max(s["max_over_mean"] for s in sums)
            values["dropped"] = sum(s["dropped_fraction"] for s in sums) / len(sums)
        logits = [v for r in window for v in r.max_logits.values()]
        if logits:
            values["max_logit"] = max(logits)
        if eval_loss is not None:
            values["eval_loss"] = eval_loss
        line = format_log_line(self.step, self.cfg.train.steps, values)
        if self.cfg.moe.force_load_balancing:
            line += f" | {BENCHMARK_TAG}"
        if bar is not None:
            bar.write(line)
        else:
            log.info(line)


def run(cfg: JobConfig) -> dict[str, float]:
    setup_logging()
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger().setLevel(logging.WARNING)  # rank 0 logs
    try:
        return Trainer(cfg).fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
