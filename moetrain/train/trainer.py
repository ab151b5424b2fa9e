"""The trainer: builds everything from a JobConfig, runs steps, evaluates, checkpoints, logs.

This is the one place where config sections, model, data, optimizer, checkpoints and
logging meet. Each piece receives only its own config section.
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moetrain.config import ConfigError, JobConfig, config_to_yaml
from moetrain.data import PackedBatches, check_data, load_tokenizer, unigram_entropy
from moetrain.model import Transformer, build_model
from moetrain.train.checkpoint import CheckpointManager
from moetrain.train.metrics import (
    MetricsWriter,
    format_log_line,
    layer_summary,
    merge_stats,
    peak_flops,
)
from moetrain.train.optim import build_optimizer, build_scheduler, clip_grad_norm_

log = logging.getLogger("moetrain")


def setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                            datefmt="%H:%M:%S", stream=sys.stdout)


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' requested but no CUDA device is available; "
                          "use 'auto' or 'cpu'")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 autocast on CUDA, fp32 on CPU (unless asked otherwise)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def rng_state() -> dict[str, Any]:
    """RNG states as plain containers and tensors (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]) + [random.getstate()[0], random.getstate()[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[-2], tuple(py[:-2]), py[-1]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np_state[1].numpy().astype(np.uint32), *np_state[2:]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_fingerprint(cfg: JobConfig, vocab_size: int) -> dict[str, Any]:
    """What a checkpoint must agree on to be loadable into this run's model."""
    m, e = cfg.model, cfg.moe
    return {
        "vocab_size": vocab_size, "dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads,
        "n_kv_heads": m.kv_heads, "ffn_dim": m.ffn_dim, "tie_embeddings": m.tie_embeddings,
        "num_experts": e.num_experts, "expert_ffn_dim": e.expert_ffn_dim,
        "every_n_layers": e.every_n_layers, "num_shared_experts": e.num_shared_experts,
        "shared_expert_ffn_dim": e.shared_expert_ffn_dim,
    }


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float
    moe: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


class Trainer:
    """Single-process trainer (one CPU or one GPU)."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        tcfg = cfg.train
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("WORLD_SIZE > 1: multi-process layouts (parallel.*) are not "
                              "available yet; launch with --nproc-per-node 1")
        self.device = pick_device(tcfg.device)
        self.dtype = pick_dtype(tcfg.dtype, self.device)
        self.out_dir = Path(tcfg.output_dir)

        # Data first: a missing dataset or tokenizer must fail before any real work.
        check_data(cfg.data)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir)
        vocab = cfg.model.vocab_size or self.tokenizer.vocab_size
        if vocab < self.tokenizer.vocab_size:
            raise ConfigError(f"model.vocab_size: {vocab} is smaller than the tokenizer's "
                              f"vocabulary of {self.tokenizer.vocab_size}")
        cfg.model.vocab_size = vocab
        self.grad_accum = tcfg.global_batch_size // tcfg.micro_batch_size
        self.train_data = PackedBatches(cfg.data, self.tokenizer, "train",
                                        tcfg.global_batch_size, tcfg.micro_batch_size)
        self.eval_data = PackedBatches(cfg.data, self.tokenizer, "eval",
                                       tcfg.eval_batches * tcfg.micro_batch_size,
                                       tcfg.micro_batch_size)

        self.model: Transformer = build_model(cfg.model, cfg.moe, seed=tcfg.seed,
                                              device=self.device)
        self.model.set_aux_loss_scale(1.0 / self.grad_accum)
        self.step_model: torch.nn.Module = (
            torch.compile(self.model) if tcfg.compile else self.model
        )
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, tcfg.steps)
        self.ckpt = CheckpointManager(self.out_dir / "checkpoints", tcfg.keep_last)
        self.fingerprint = model_fingerprint(cfg, vocab)
        self.step = 0
        torch.manual_seed(tcfg.seed)  # router jitter draws from the global generator

        self.writer = MetricsWriter(self.out_dir / "tb" if cfg.log.tensorboard else None,
                                    cfg.log)  # dashboard cadence, dead-expert/imbalance warnings
        self.flops_per_token = self.model.flops_per_token(cfg.data.seq_len)
        self.peak_flops, self.peak_source = peak_flops(self.device)

    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and persistent buffers as plain CPU tensors."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        self.writer.flush()
        self.writer.close()

    # ------------------------------------------------------------------ checkpoints

    def _app_state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save_checkpoint(self) -> Path:
        extra = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "data": self.train_data.state_dict(),
            "rng": rng_state(),
            "config": self.cfg.to_dict(),
        }
        path = self.ckpt.save(self.step, self._app_state(), extra,
                              fingerprint=self.fingerprint)
        log.info("saved checkpoint %s", path)
        return path

    def maybe_resume(self) -> None:
        resume = self.cfg.train.resume
        if resume == "never":
            if self.ckpt.latest() is not None:
                raise ConfigError(f"train.resume: 'never' but {self.ckpt.root} already holds "
                                  "checkpoints; pick another train.output_dir or resume")
            return
        path = self.ckpt.latest() if resume == "auto" else Path(resume)
        if path is None:
            return
        state = self._app_state()
        extra = self.ckpt.load(path, state, expected_fingerprint=self.fingerprint)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(extra["scheduler"])
        self.train_data.load_state_dict(extra["data"])
        set_rng_state(extra["rng"])
        self.step = int(extra["step"])
        log.info("resumed from %s at step %d", path, self.step)

    # ------------------------------------------------------------------ steps

    def _autocast(self):
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = batch["input_ids"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        with self._autocast():
            logits = self.step_model(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    def train_step(self) -> StepResult:
        start = time.perf_counter()
        self.model.train()
        micro_batches = self.train_data.next_step()
        total = torch.zeros((), device=self.device)
        tokens = 0
        for batch in micro_batches:
            loss = self._loss(batch)
            (loss / self.grad_accum).backward()
            total += loss.detach()
            tokens += batch["input_ids"].numel()
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        moe = {i: layer.pop_stats() for i, layer in self.model.moe_layers().items()}
        for i, layer in self.model.moe_layers().items():
            layer.update_expert_bias(moe[i]["tokens_per_expert"])
        self.step += 1
        loss_value = (total / len(micro_batches)).item()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(loss_value, float(grad_norm), lr, tokens,
                          time.perf_counter() - start, moe)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        self.eval_data.reset()
        losses = [self._loss(b).item() for b in self.eval_data.next_step()]
        self.model.train()
        return sum(losses) / len(losses)

    # ------------------------------------------------------------------ loop

    def fit(self, stop_at: int | None = None) -> dict[str, float]:
        """Train to ``train.steps`` (or stop early at ``stop_at`` with a checkpoint, as an
        interruption would) and return the final eval loss and the unigram entropy."""
        cfg, tcfg = self.cfg, self.cfg.train
        end = tcfg.steps if stop_at is None else min(stop_at, tcfg.steps)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.yaml").write_text(config_to_yaml(cfg))
        self.maybe_resume()
        n_params, n_active = self.model.num_params(), self.model.num_params(active=True)
        entropy = unigram_entropy(self.tokenizer, cfg.data)
        log.info("model: %.2fM params (%.2fM active per token), %d MoE layers, device %s %s",
                 n_params / 1e6, n_active / 1e6, len(self.model.moe_layers()), self.device,
                 str(self.dtype).removeprefix("torch."))
        log.info("data: unigram entropy of the training tokens %.3f nats/token; MFU against "
                 "%.1f GFLOP/s (%s)", entropy, self.peak_flops / 1e9, self.peak_source)
        self.writer.text("config", "```\n" + config_to_yaml(cfg) + "\n```")
        self.writer.scalars({"data/unigram_entropy": entropy}, self.step)

        bar = None
        if cfg.log.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=tcfg.steps, initial=self.step, unit="step", dynamic_ncols=True)
        window: list[StepResult] = []
        summary: dict[str, float] = {"unigram_entropy": entropy}
        eval_loss = None
        while self.step < end:
            res = self.train_step()
            window.append(res)
            tok_s = res.tokens / res.seconds
            mfu = tok_s * self.flops_per_token / self.peak_flops
            if not math.isfinite(res.loss):
                raise FloatingPointError(f"non-finite loss {res.loss} at step {self.step}")
            scalars = {"train/loss": res.loss, "train/lr": res.lr, "train/grad_norm": res.grad_norm,
                       "perf/tokens_per_s": tok_s, "perf/mfu": mfu}
            self.writer.scalars(scalars, self.step)
            self.writer.moe_layers(res.moe, self.step)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{res.loss:.3f}", tok_s=f"{tok_s:,.0f}")
            last = self.step == end
            if (tcfg.eval_every and self.step % tcfg.eval_every == 0) or last:
                eval_loss = self.evaluate()
                self.writer.scalars({"eval/loss": eval_loss}, self.step)
            if self.step % cfg.log.log_every == 0 or last:
                self._log_window(window, eval_loss if self.step % max(tcfg.eval_every, 1) == 0
                                 or last else None, bar)
                window = []
            if (tcfg.checkpoint_every and self.step % tcfg.checkpoint_every == 0) or last:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        self.writer.flush()
        self.writer.close()
        if eval_loss is None:
            eval_loss = self.evaluate()
        summary.update({"eval_loss": eval_loss, "step": self.step})
        log.info("done: eval loss %.4f nats/token vs unigram entropy %.4f", eval_loss, entropy)
        return summary

    def _log_window(self, window: list[StepResult], eval_loss: float | None, bar) -> None:
        tokens = sum(r.tokens for r in window)
        seconds = sum(r.seconds for r in window)
        tok_s = tokens / max(seconds, 1e-9)
        values: dict[str, Any] = {
            "loss": sum(r.loss for r in window) / len(window), "lr": window[-1].lr,
            "grad_norm": window[-1].grad_norm, "tokens_per_s": tok_s,
            "mfu": tok_s * self.flops_per_token / self.peak_flops,
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
        if eval_loss is not None:
            values["eval_loss"] = eval_loss
        line = format_log_line(self.step, self.cfg.train.steps, values)
        if bar is not None:
            bar.write(line)
        else:
            log.info(line)


def run(cfg: JobConfig) -> dict[str, float]:
    setup_logging()
    return Trainer(cfg).fit()
