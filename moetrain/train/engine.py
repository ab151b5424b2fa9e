"""The step engine: forward/backward over a step's micro-batches, gradient reduction and
clipping, the optimizer step, and MoE statistics, under any parallel layout.

The trainer sees one object whatever the layout:

    engine.forward_backward(micro_batches, replay=None, record=False)
                                           -> mean loss of the step (same on every rank)
    engine.optimizer_step(grad_clip)       -> global gradient norm
    engine.moe_stats()                     -> per-layer router statistics summed over dp and
                                              pp (never tp: tp ranks hold identical copies)
    engine.eval_loss(micro_batches), engine.app_state() / load_app_state(), ...

A local engine runs micro-batches one after the other (gradient accumulation); a pipeline
engine hands them to the ``torch.distributed.pipelining`` schedule. Everything
layout-specific was applied by ``moetrain.parallel.parallelize``; the collectives here are
the step-level ones: the stage-0/1 gradient reduction, the gradient norm, the loss, the
statistics, the global-batch balancing loss's expert counts and the routing records.

Global-batch balancing (``moe.global_aux_loss_coef``): the loss of every micro-batch needs
the expert counts of the whole step (every micro-batch, every data-parallel rank) before its
backward. With one forward per rank and step and no pipeline, the counts of that forward are
summed over dp between forward and backward; otherwise a no-grad counting pass over the
step's micro-batches (routing exactly as the training forward will: same parameters, jitter
keys and replayed ids) runs first. Either way every layout uses the same counts as one
process on the whole global batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from moetrain.config import JobConfig
from moetrain.model import Transformer
from moetrain.model.moe import SCORE_HIST_BINS, STAT_NAMES
from moetrain.parallel.accounting import params_before_dp
from moetrain.parallel.context_parallel import sequence_index
from moetrain.parallel.data_parallel import GradientSync, moe_layers
from moetrain.parallel.dims import Meshes, ParallelDims
from moetrain.parallel.expert_parallel import (
    expert_grad_sq_norm,
    gather_expert_tensors,
    gather_experts,
    is_expert_param,
    reduce_expert_grads,
)
from moetrain.parallel.parallelize import parallelize
from moetrain.train.optim import build_optimizer, build_scheduler, param_groups

Batch = dict[str, torch.Tensor]
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_NORM_DIMS = ("dp_replicate", "dp_shard", "tp")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _group(mesh: Any) -> Any:
    return mesh.get_group() if mesh is not None and mesh.size() > 1 else None


def reduce_route_counts(counts_LE: torch.Tensor, dp_group: Any) -> None:
    """Sum the expert choices of a step over the data-parallel ranks (dp x cp), in place.
    Each rank counted its own tokens over all experts (on the source rank under expert
    parallelism; its own positions of every sequence under cp), and tensor-parallel ranks
    route the same tokens: dp x cp is exactly the dimension to sum over."""
    if dp_group is not None:
        dist.all_reduce(counts_LE, group=dp_group)


class Engine:
    """Runs training steps of ``model`` under the layout ``dims`` (``meshes`` None: one
    process, no collectives)."""

    def __init__(
        self,
        cfg: JobConfig,
        model: Transformer,
        dims: ParallelDims,
        meshes: Meshes | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.cfg = cfg
        self.dims = dims
        self.meshes = meshes
        self.device = device
        self.dtype = dtype
        pcfg = cfg.parallel
        self.n_micro = dims.microbatches(cfg)
        # Fast-LLM's split of a step's micro-batches: passes of ``breadth`` micro-batches
        # each (one run of the pipeline schedule, or forwards before backwards), one after
        # the other.
        self.breadth = dims.breadth_first(cfg)
        self.n_layers = cfg.model.n_layers
        # The whole model's MoE layers (this rank's stages may hold none of them).
        self.moe_layer_ids = sorted(model.moe_layers())
        self.coords = (
            dims.coords(dist.get_rank())
            if meshes is not None
            else {name: 0 for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
        )
        # Context parallelism: the positions of every sequence this rank holds.
        self.seq_index = (
            sequence_index(cfg.data.seq_len, dims.cp, self.coords["cp"]) if dims.cp > 1 else None
        )
        self.tp_enabled = dims.tp > 1
        # Aux losses are averaged over a rank's micro-batches like the LM loss (and over dp
        # by the gradient averaging), so each injected gradient is 1 / micro-batches.
        model.set_aux_loss_scale(1.0 / self.n_micro)
        # FSDP2 mixed precision (ZeRO-2/3): parameters all-gathered in the compute dtype, the
        # fp32 shards stay the master weights, gradients reduced in fp32 (gloo and NCCL).
        fsdp_dtype = dtype if dtype != torch.float32 else None
        pm = parallelize(
            model,
            dims,
            meshes,
            pcfg,
            pp_rank=self.coords["pp"],
            compile=cfg.train.compile,
            param_dtype=fsdp_dtype,
            device=device,
            n_microbatches=self.breadth,
            loss_fn=self._pipeline_loss,
            seq_len=cfg.data.seq_len,
        )
        self.parts: list[nn.Module] = [p.to(device) for p in pm.parts]
        self.stage_ids = pm.stage_ids
        self.schedule = pm.schedule
        self.eval_schedule = pm.eval_schedule  # forward-only passes (see ParallelModel)
        self.num_stages = dims.num_stages
        self.moe = moe_layers(self.parts)
        # Expert parallelism: this rank's E / ep experts per MoE layer. They are kept out of
        # the dp reduction (GradientSync skips them, FSDP ignores them) and reduced over the
        # expert-data-parallel group instead (``reduce_expert_grads``, after backward).
        self.expert_params: list[nn.Parameter] = pm.expert_params
        self.ep_mesh = meshes.ep if meshes is not None else None
        self.edp_mesh = meshes.edp if meshes is not None else None
        self.etp_mesh = (
            meshes.tp
            if (meshes is not None and self.expert_params and pcfg.expert_tp and dims.tp > 1)
            else None
        )
        self.params_at_rest = params_before_dp(self.parts)
        self._record_inputs: torch.Tensor | None = None  # forward_backward(record=True)
        # Accounting hook: called with "forward", "backward" and "step" (memory probes).
        self.probe: Callable[[str], None] | None = None
        # Called once per optimizer step with the engine, after the gradients are reduced
        # over every parallel dimension and before clipping: the layout oracle reads the
        # step's full gradients here (``full_grad_dict``), the oracle's own tests alter them.
        self.grad_hook: Callable[[Engine], None] | None = None

        # Groups of the step-level collectives. Losses, gradients and statistics are averaged
        # or summed over dp x cp: cp ranks hold other tokens of the same sequences.
        self.dp_group = _group(meshes.dp_cp) if meshes else None
        # The ranks holding other sequences (dp alone): what gathers whole sequences' records
        # (routing records, eval routing) run over, after the MoE layers gathered them over cp.
        self.seq_group = _group(meshes.dp) if meshes else None
        self.pp_group = _group(meshes.pp) if meshes else None

        # Optimizer(s): one AdamW per chunk (state dicts are per module), or for stages 0/1
        # a GradientSync and, for ZeRO-1, one AdamW over this rank's slices.
        self.zero_stage = pcfg.zero_stage if dims.dp_cp > 1 else 0
        self.grad_sync: GradientSync | None = None
        if self.zero_stage <= 1 and meshes is not None:
            decay, no_decay = [], []
            for part in self.parts:
                d, n = param_groups(part)
                decay += [p for p in d if not is_expert_param(p)]
                no_decay += [p for p in n if not is_expert_param(p)]
            self.grad_sync = GradientSync(
                [decay, no_decay],
                self.zero_stage,
                self.dp_group,
                _group(meshes.dp_shard_cp),
                _group(meshes.dp_replicate),
            )
        if self.zero_stage == 1:
            assert self.grad_sync is not None
            decay_v, no_decay_v = self.grad_sync.optimizer_groups()
            o = cfg.optim
            groups = [(decay_v, no_decay_v)]
            if self.expert_params:
                # Expert parameters differ per EP rank: their optimizer state is not sharded
                # over dp (it already holds 1 / ep of the experts); a second AdamW steps them
                # whole, with the same two groups.
                groups.append(
                    (
                        [p for p in self.expert_params if p.ndim >= 2],
                        [p for p in self.expert_params if p.ndim < 2],
                    )
                )
            self.optimizers = [
                torch.optim.AdamW(
                    [
                        {"params": d, "weight_decay": o.weight_decay},
                        {"params": n, "weight_decay": 0.0},
                    ],
                    lr=o.lr,
                    betas=(o.beta1, o.beta2),
                    eps=o.eps,
                    weight_decay=o.weight_decay,
                )
                for d, n in groups
            ]
        else:
            self.optimizers = [build_optimizer(part, cfg.optim) for part in self.parts]
        self.schedulers = [
            build_scheduler(opt, cfg.optim, cfg.train.steps) for opt in self.optimizers
        ]
        if self.schedule is not None:
            self._warm_up_pipeline(dims.micro_batch_size(cfg), cfg.data.seq_len)

    def _warm_up_pipeline(self, mbs: int, seq_len: int) -> None:
        """One throwaway step through each schedule (training, forward-only) on a dummy batch.

        A schedule's first step infers the shapes that travel between stages by running an
        extra forward (and backward), which would count MoE statistics of a micro-batch
        that is not in the data. Doing it here, then dropping gradients and statistics,
        keeps every real step exact whatever the torch version's inference does."""
        dummy = [{"input_ids": torch.zeros(mbs, seq_len, dtype=torch.long)}] * self.n_micro
        dummy = [{**b, "labels": b["input_ids"]} for b in dummy]
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self._pipeline_step(dummy[: self.breadth], train=True)
            with torch.no_grad():  # the forward-only schedule infers its shapes once too
                self._pipeline_step(dummy[: self.breadth], train=False)
        for part in self.parts:
            part.zero_grad(set_to_none=True)
        for layer in self.moe.values():
            layer.pop_stats()

    # ------------------------------------------------------------------ loss

    def _loss_ctx(self) -> ExitStack:
        stack = ExitStack()
        if self.tp_enabled:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        if self.dtype != torch.float32:
            stack.enter_context(torch.autocast(device_type=self.device.type, dtype=self.dtype))
        return stack

    @staticmethod
    def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=labels.device.type, enabled=False):
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._ce(logits, labels) / self.n_micro

    # ------------------------------------------------------------------ steps

    @property
    def first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def forward_backward(
        self,
        micro_batches: list[Batch],
        replay: dict[int, torch.Tensor] | None = None,
        record: bool = False,
    ) -> float:
        """Forward and backward of this rank's micro-batches; the step's mean loss over the
        global batch (the same value on every rank).

        ``replay``: per MoE layer the step's expert ids, (global batch, S, K), replacing the
        router's choice (``moetrain.train.replay``). ``record``: keep the routing of the step
        for ``routing_record()``."""
        self.train(True)
        self._set_jitter_keys()
        for i, layer in self.moe.items():
            layer.begin_step()
            layer.replay_BSK = None if replay is None else replay[i].to(self.device)
            layer.record_BSK = None
            if record:
                gbs, seq = self.cfg.train.global_batch_size, self.cfg.data.seq_len
                K = self.cfg.moe.top_k
                layer.record_BSK = torch.full((gbs, seq, K), -1, dtype=torch.int64,
                                              device=self.device)
        self._record_inputs = (
            torch.cat([b["input_ids"] for b in micro_batches]) if record else None
        )
        n, breadth = len(micro_batches), self.breadth
        # Decided from the whole model, not this rank's layers: under a pipeline every stage
        # runs the counting pass, including stages without an MoE layer (it is a schedule run).
        needs_counts = self.cfg.moe.global_aux_loss_coef > 0 and bool(self.moe_layer_ids)
        # One forward per step on this rank (no pipeline, one micro-batch or one
        # breadth-first pass): its counts are the step's, summed between forward and backward.
        counted_in_forward = needs_counts and self.schedule is None and n <= breadth
        if needs_counts and not counted_in_forward:
            self._counting_pass(micro_batches)
        total = torch.zeros((), device=self.device)
        for start in range(0, n, breadth):  # depth-first: pass after pass
            group = micro_batches[start : start + breadth]
            if self.schedule is not None:
                total += self._pipeline_step(group, train=True)
                continue
            model = self.parts[0]
            pending = []  # breadth-first: every forward of the pass, then one backward
            for batch in group:
                inputs = self._local_tokens(batch["input_ids"]).to(self.device, non_blocking=True)
                labels = self._local_tokens(batch["labels"]).to(self.device, non_blocking=True)
                with self._loss_ctx():
                    loss = self._ce(model(inputs), labels)
                    if self.probe is not None:
                        self.probe("forward")
                    if breadth == 1:
                        if counted_in_forward:  # the step's only forward
                            self._set_global_counts()
                        (loss / n).backward()
                    else:
                        pending.append(loss / n)
                total += _local(loss).detach() / n
            if pending:
                with self._loss_ctx():
                    if counted_in_forward:  # every forward of the step has run
                        self._set_global_counts()
                    sum(pending).backward()
        for layer in self.moe.values():
            layer.replay_BSK = None
        if self.probe is not None:
            self.probe("backward")
        return self._mean_over_dp(total)

    def _local_tokens(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """This rank's positions of every sequence (context parallelism), or all of them."""
        return tokens_BS if self.seq_index is None else tokens_BS[:, self.seq_index]

    @torch.no_grad()
    def _counting_pass(self, micro_batches: list[Batch]) -> None:
        """The step's expert counts before any backward: a no-grad forward of this rank's
        micro-batches in training mode (the same routing as the training forward: same
        parameters, jitter keys and replayed ids), counted by the MoE layers and summed over
        dp. Nothing else of it is kept: statistics, byte counters and the sequence counter
        are left as they were."""
        sent = {i: layer.dispatcher.bytes_sent for i, layer in self.moe.items()}
        for layer in self.moe.values():
            layer.counting = True
        try:
            for start in range(0, len(micro_batches), self.breadth):
                group = micro_batches[start : start + self.breadth]
                if self.schedule is not None:
                    self._pipeline_step(group, train=False)
                    continue
                for batch in group:
                    inputs = self._local_tokens(batch["input_ids"])
                    with self._loss_ctx():
                        self.parts[0](inputs.to(self.device, non_blocking=True))
        finally:
            for i, layer in self.moe.items():
                layer.counting = False
                layer.dispatcher.bytes_sent = sent[i]
        self._set_global_counts()
        self._set_jitter_keys()  # the training forwards start from the first sequence again
        for layer in self.moe.values():
            layer.route_counts.zero_()

    def _set_global_counts(self) -> None:
        """Sum every MoE layer's counted choices over dp and hand them to the layers."""
        ids = sorted(self.moe)
        if not ids:
            return
        counts = torch.stack([self.moe[i].route_counts for i in ids])
        reduce_route_counts(counts, self.dp_group)
        for i, c in zip(ids, counts, strict=True):
            self.moe[i].set_global_counts(c)

    @torch.no_grad()
    def routing_record(self) -> dict[str, Any] | None:
        """The routing of the last ``forward_backward(..., record=True)`` (collective): on
        every rank ``{"input_ids": (global batch, S), "ids": {layer: (global batch, S, K)}}``
        with every MoE layer of the model, gathered over dp and pp; None if not recorded."""
        if self._record_inputs is None:
            return None
        layers = {i: layer.record_BSK for i, layer in self.moe.items()}
        for rec in layers.values():  # each dp rank wrote its own rows; the others hold -1
            if self.seq_group is not None:
                rec.add_(1)
                dist.all_reduce(rec, group=self.seq_group)
                rec.sub_(1)
        inputs = self._gather_dp(self._record_inputs.to(self.device))
        ids = self._merge_stages({i: r.to("cpu", torch.int16) for i, r in layers.items()})
        for layer in self.moe.values():
            layer.record_BSK = None
        self._record_inputs = None
        return {"input_ids": inputs.cpu(), "ids": dict(sorted(ids.items()))}

    def _gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped per-rank tensors over dp in rank order (collective)."""
        if self.seq_group is None:
            return t
        parts = [torch.empty_like(t) for _ in range(self.dims.dp)]
        dist.all_gather(parts, t.contiguous(), group=self.seq_group)
        return torch.cat(parts)

    def _set_jitter_keys(self) -> None:
        """Tell every MoE layer where this step's tokens are in the run (router jitter is a
        hash of it, ``moetrain.model.jitter``): the optimizer step (the scheduler's count,
        restored on resume) and the global index of this rank's first sequence."""
        c = self.coords
        dp_rank = c["dp_replicate"] * self.dims.dp_shard + c["dp_shard"]
        offset = dp_rank * (self.cfg.train.global_batch_size // self.dims.dp)
        step = self.schedulers[0].last_epoch
        for layer in self.moe.values():
            layer.set_jitter_key(self.cfg.train.seed, step, offset)

    def _pipeline_step(self, micro_batches: list[Batch], train: bool) -> torch.Tensor:
        """One run of the schedule over ``breadth`` micro-batches; the sum of their losses,
        each divided by the step's micro-batch count."""
        inputs = torch.cat([self._local_tokens(b["input_ids"]) for b in micro_batches])
        labels = torch.cat([self._local_tokens(b["labels"]) for b in micro_batches])
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first_stage else ()
        kwargs: dict[str, Any] = {}
        if self.last_stage:
            kwargs.update(target=labels, losses=losses)
        with self._loss_ctx():
            if train:
                self.schedule.step(*args, **kwargs)
            else:
                self.eval_schedule.eval(*args, **kwargs)
        total = torch.zeros((), device=self.device)
        for loss in losses:  # each already divided by the micro-batch count
            total += _local(loss).detach().float()
        # Only the last stage has the loss: share it with every stage.
        if self.pp_group is not None:
            dist.all_reduce(total, group=self.pp_group)
        return total

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        """Mean over dp x cp: every rank's value is the mean over an equal number of tokens
        (its sequences, or its equal share of every sequence under cp)."""
        if self.dp_group is not None:
            value = value.clone()
            dist.all_reduce(value, group=self.dp_group)
            value /= self.dims.dp_cp
        return float(value)

    @torch.no_grad()
    def eval_loss(
        self, micro_batches: list[Batch], routing: dict[str, Any] | None = None
    ) -> float:
        """Mean loss over this rank's eval micro-batches, averaged over dp.

        ``routing``: a dict to fill (collective) with the eval tokens' routing, gathered over
        dp and pp on every rank: ``input_ids`` (sequences, S) in the eval split's order and
        ``ids`` {layer: (sequences * S, K)} for every MoE layer of the model."""
        self.train(False)
        if routing is not None:
            for layer in self.moe.values():
                layer.eval_record = []
        try:
            loss = self._eval_loss(micro_batches)
            if routing is not None:
                routing.update(self._eval_routing(micro_batches))
            return loss
        finally:
            for layer in self.moe.values():
                layer.eval_record = None
            self.train(True)

    def _eval_routing(self, micro_batches: list[Batch]) -> dict[str, Any]:
        mine = {
            i: torch.cat(layer.eval_record or []).to(self.device, torch.int64)
            for i, layer in self.moe.items()
        }
        ids = {i: self._gather_dp(t).to("cpu", torch.int16) for i, t in sorted(mine.items())}
        inputs = torch.cat([b["input_ids"] for b in micro_batches]).to(self.device)
        return {
            "input_ids": self._gather_dp(inputs).cpu(),
            "ids": dict(sorted(self._merge_stages(ids).items())),
        }

    def _eval_loss(self, micro_batches: list[Batch]) -> float:
        if self.schedule is not None:
            total = torch.zeros((), device=self.device)
            n = self.breadth
            for i in range(0, len(micro_batches), n):
                total += self._pipeline_step(micro_batches[i : i + n], train=False)
            # Each loss came divided by the step's micro-batch count.
            total *= self.n_micro / max(len(micro_batches), 1)
        else:
            losses = []
            for batch in micro_batches:
                inputs = self._local_tokens(batch["input_ids"]).to(self.device)
                labels = self._local_tokens(batch["labels"]).to(self.device)
                with self._loss_ctx():
                    losses.append(_local(self._ce(self.parts[0](inputs), labels)))
            total = torch.stack(losses).float().mean()
        return self._mean_over_dp(total)

    # ------------------------------------------------------------------ optimizer

    def _grad_pieces(self) -> list[tuple[torch.Tensor, frozenset[str]]]:
        """(local gradient, mesh dims it is sharded over) for this rank's share of the
        gradient norm."""
        out = []
        if self.grad_sync is not None:
            zero1 = self.zero_stage == 1
            for grad, param in self.grad_sync.grad_pieces():
                dims = set(_shard_dims(param))
                if zero1:  # sharded over dp_shard (x cp)
                    dims.add("dp_shard_cp" if self.dims.cp > 1 else "dp_shard")
                out.append((_local(grad), frozenset(dims)))
            return out
        for part in self.parts:
            for p in part.parameters():
                if p.grad is not None and not is_expert_param(p):
                    out.append((_local(p.grad), frozenset(_shard_dims(p.grad))))
        return out

    def _expert_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.expert_params if p.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients: squares summed locally per sharding class, then
        over exactly the mesh dims each class is sharded over, then over pipeline stages."""
        # ZeRO shards over dp_shard x cp under context parallelism (one flattened dim).
        norm_dims = tuple("dp_shard_cp" if d == "dp_shard" and self.dims.cp > 1 else d
                          for d in _NORM_DIMS)  # fmt: skip
        classes = [frozenset(c) for c in _subsets(norm_dims)]
        sq = torch.zeros(len(classes), dtype=torch.float64, device=self.device)
        for grad, dims in self._grad_pieces():
            sq[classes.index(dims)] += grad.detach().double().pow(2).sum()
        if self.meshes is not None:
            for name in norm_dims:
                group = _group(getattr(self.meshes, name))
                if group is None:
                    continue
                mask = torch.tensor([name in c for c in classes], device=self.device)
                part = torch.where(mask, sq, torch.zeros_like(sq))
                dist.all_reduce(part, group=group)
                sq = torch.where(mask, part, sq)
        total = sq.sum()
        if self.expert_params:
            # Every expert once: summed over the EP group (and the TP group under expert TP),
            # never over edp (identical replicas) nor over tp with replicated experts.
            sq_e = expert_grad_sq_norm(self.expert_params, self.ep_mesh, self.etp_mesh)
            total = total + sq_e.to(total.dtype)
        if self.pp_group is not None:
            dist.all_reduce(total, group=self.pp_group)
        return total.sqrt()

    @torch.no_grad()
    def optimizer_step(self, max_norm: float | None, loss: float = 0.0) -> float:
        """Reduce gradients (stages 0/1), clip to ``max_norm``, step, all-gather (ZeRO-1),
        zero the gradients. Returns the global gradient norm before clipping.

        When the norm or ``loss`` is not finite the update is skipped on every rank (the norm
        and loss are global, so all ranks agree): parameters and optimizer state stay as
        they were, the gradients are dropped and the schedule advances."""
        self._match_grad_placements()
        if self.grad_sync is not None:
            self.grad_sync.reduce()
        if self.expert_params:
            reduce_expert_grads(self.expert_params, self.edp_mesh, self.dims.dp_cp)
        if self.grad_hook is not None:
            self.grad_hook(self)
        norm = self.grad_norm()
        norm_f = float(norm)
        update = math.isfinite(norm_f) and math.isfinite(loss)
        if update and max_norm is not None:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for grad, _ in self._grad_pieces():
                grad.mul_(coef.to(grad.dtype))
            for grad in self._expert_grads():
                grad.mul_(coef.to(grad.dtype))
        if update:
            for opt in self.optimizers:
                opt.step()
            if self.grad_sync is not None:
                self.grad_sync.gather_params()
        self.after_step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        for part in self.parts:
            part.zero_grad(set_to_none=True)
        if self.grad_sync is not None:
            self.grad_sync.zero_grad()
        for sched in self.schedulers:
            sched.step()
        return norm_f

    def _match_grad_placements(self) -> None:
        """Give every DTensor gradient its parameter's placements. Some ops return a
        gradient in another layout (the vocabulary-parallel embedding's comes back
        replicated); Replicate -> Shard is a local slice, no communication."""
        for part in self.parts:
            for p in part.parameters():
                g = p.grad
                if (
                    isinstance(g, DTensor)
                    and isinstance(p, DTensor)
                    and (g.placements != p.placements)
                ):
                    p.grad = g.redistribute(p.device_mesh, p.placements)

    def after_step(self) -> None:
        """Between the optimizer step and zeroing the gradients."""
        if self.probe is not None:
            self.probe("step")

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    # ------------------------------------------------------------------ MoE statistics

    @torch.no_grad()
    def moe_stats(self) -> dict[int, dict[str, torch.Tensor]]:
        """Pop every MoE layer's statistics and return them for all layers, summed over dp
        and pp (each layer lives on one pp rank; tp ranks hold identical copies, not summed).
        Token counts are counted on the source rank over all experts, so summing over dp
        counts each assignment once under expert parallelism too; ``a2a_bytes`` (token bytes
        sent to other EP ranks in forward) is summed over dp and pp but not tp: under tp > 1
        it is the bytes of one tp index (every tp rank sends the same). The expert bias is a
        state,
        identical over dp: returned as is."""
        moe_ids = self.moe_layer_ids
        if not moe_ids:
            return {}
        E = self.cfg.moe.num_experts
        H = SCORE_HIST_BINS  # router-score histogram (metrics: TensorBoard histograms)
        width = len(STAT_NAMES) + 4 + 3 * E + H
        packed = torch.zeros(len(moe_ids), width, dtype=torch.float64, device=self.device)
        for row, i in enumerate(moe_ids):
            if i not in self.moe:
                continue
            s = self.moe[i].pop_stats()
            packed[row] = torch.cat(
                [
                    torch.stack([s[n] for n in STAT_NAMES]).double(),
                    s["tokens_per_expert"].double(),
                    torch.stack(
                        [s["calls"], s["assignments"], s["dropped"], s["a2a_bytes"]]
                    ).double(),
                    s["score_hist"].double(),
                    s["probs_sum"].double(),
                    s["expert_bias"].double(),  # last: the slice divided by dp below
                ]
            )
        if self.dp_group is not None:  # dp x cp: cp ranks count their own tokens
            dist.all_reduce(packed, group=self.dp_group)
            packed[:, -E:] /= self.dims.dp_cp
        if self.pp_group is not None:
            dist.all_reduce(packed, group=self.pp_group)
        out: dict[int, dict[str, torch.Tensor]] = {}
        k = len(STAT_NAMES)
        for row, i in enumerate(moe_ids):
            v = packed[row].float().cpu()
            d = {n: v[j] for j, n in enumerate(STAT_NAMES)}
            d["tokens_per_expert"] = v[k : k + E]
            d["calls"], d["assignments"], d["dropped"], d["a2a_bytes"] = v[
                k + E : k + E + 4
            ].unbind()
            d["score_hist"] = v[k + E + 4 : k + E + 4 + H]
            d["probs_sum"] = v[k + E + 4 + H : k + 2 * E + 4 + H]
            d["expert_bias"] = v[k + 2 * E + 4 + H :]
            out[i] = d
        return out

    def update_expert_bias(self, stats: dict[int, dict[str, torch.Tensor]]) -> None:
        """Aux-loss-free balancing from the GLOBAL token counts: every rank moves the bias of
        the layers it holds identically."""
        for i, layer in self.moe.items():
            layer.update_expert_bias(stats[i]["tokens_per_expert"].to(self.device))

    # ------------------------------------------------------------------ state

    def _zero1_shadow(self) -> list[torch.optim.Optimizer]:
        """ZeRO-1: full-size AdamW optimizers per chunk holding the gathered state, so that
        checkpoints have the layout-independent format of every other stage."""
        assert self.grad_sync is not None
        sharded = self.optimizers[0]
        shadows = [build_optimizer(part, self.cfg.optim) for part in self.parts]
        if self.expert_params:  # the experts' optimizer is whole: its state as it is
            experts = self.optimizers[1]
            for shadow in shadows:
                for group in shadow.param_groups:
                    for p in group["params"]:
                        if p in experts.state:
                            shadow.state[p] = {k: v.clone() for k, v in experts.state[p].items()}
        for shadow in shadows:  # lr, initial_lr (the scheduler's), betas...: the live values
            for group, live in zip(shadow.param_groups, sharded.param_groups, strict=True):
                group.update({k: v for k, v in live.items() if k != "params"})
        owner = {}
        for shadow in shadows:
            for group in shadow.param_groups:
                for p in group["params"]:
                    owner[id(p)] = shadow
        step = None
        for v in (v for s in self.grad_sync.shards for v in s.views):
            if v in sharded.state:
                step = sharded.state[v]["step"]
                break
        for shard in self.grad_sync.shards:
            for key in ("exp_avg", "exp_avg_sq"):
                mine = torch.zeros(shard.size, device=self.device)
                pos = 0
                for v in shard.views:
                    if v in sharded.state:
                        mine[pos : pos + v.numel()] = sharded.state[v][key]
                    pos += v.numel()
                pieces = shard.gather_flat(mine, self.grad_sync.shard_group)
                for p, piece in zip(shard.params, pieces, strict=True):
                    st = owner[id(p)].state.setdefault(p, {})
                    st[key] = torch.zeros_like(p)
                    _local(st[key]).view(-1).copy_(piece)
                    st["step"] = (
                        step.clone() if step is not None else torch.zeros((), dtype=torch.float32)
                    )
        return shadows

    def _zero1_restore(self, shadows: list[torch.optim.Optimizer]) -> None:
        assert self.grad_sync is not None
        sharded = self.optimizers[0]
        owner = {id(p): sh for sh in shadows for g in sh.param_groups for p in g["params"]}
        for group, loaded in zip(sharded.param_groups, shadows[0].param_groups, strict=True):
            group.update({k: v for k, v in loaded.items() if k != "params"})
        if self.expert_params:
            experts = self.optimizers[1]
            for group, loaded in zip(experts.param_groups, shadows[0].param_groups, strict=True):
                group.update({k: v for k, v in loaded.items() if k != "params"})
            for shadow in shadows:
                for p, st in shadow.state.items():
                    if is_expert_param(p):
                        experts.state[p] = {k: v.clone() for k, v in st.items()}
        for shard in self.grad_sync.shards:
            for v, (i, start, length) in zip(shard.views, shard.pieces, strict=True):
                p = shard.params[i]
                st = owner[id(p)].state[p]
                sharded.state[v] = {
                    "step": st["step"].clone(),
                    **{
                        k: _local(st[k]).reshape(-1)[start : start + length].clone()
                        for k in ("exp_avg", "exp_avg_sq")
                    },
                }

    def _part_optimizers(self) -> list[torch.optim.Optimizer]:
        return self._zero1_shadow() if self.zero_stage == 1 else self.optimizers

    def app_state(self) -> dict[str, Any]:
        """Model and optimizer state keyed by full-model names (flattened optimizer state), the
        same keys under every layout: DCP reshards them on load."""
        model_sd: dict[str, Any] = {}
        optim_sd: dict[str, Any] = {}
        self._shadows = self._part_optimizers()
        for part, opt in zip(self.parts, self._shadows, strict=True):
            model_sd.update(get_model_state_dict(part))
            optim_sd.update(get_optimizer_state_dict(part, opt, options=_FLAT))
        # Expert parallelism: each rank holds a slice of every expert tensor under the full
        # model's name. Saved as DTensor views (no copy) sharded over the EP mesh (and the
        # FFN width over TP under expert TP), DCP writes each slice at its offset in the
        # full (E, ...) tensor and reads any other slicing back: the checkpoint loads under
        # any ep (ep = 1 included, where these are plain full tensors).
        for fqn, mesh, placements in self._expert_layouts():
            for sd, key in ((model_sd, fqn), *((optim_sd, f"state.{fqn}.{k}") for k in _MOMENTS)):
                if key in sd and not isinstance(sd[key], DTensor):
                    sd[key] = DTensor.from_local(sd[key], mesh, placements, run_check=False)
        return {"model": model_sd, "optim": optim_sd}

    def _expert_layouts(self) -> list[tuple[str, Any, tuple[Any, ...]]]:
        """(full-model name, mesh, placements) of each expert parameter of this rank."""
        if not self.expert_params:
            return []
        out = []
        for part in self.parts:
            for name, p in part.named_parameters():
                if not is_expert_param(p):
                    continue
                if self.etp_mesh is not None:
                    ffn_dim = 1 if name.endswith("w2") else 2
                    mesh = self.meshes.ep_root["ep", "tp"]
                    out.append((_fqn(name), mesh, (Shard(0), Shard(ffn_dim))))
                else:
                    out.append((_fqn(name), self.ep_mesh, (Shard(0),)))
        return out

    def load_app_state(self, state: dict[str, Any]) -> None:
        """Load what ``app_state()`` returned after DCP filled it."""
        shadows = self._shadows
        experts = {fqn for fqn, _, _ in self._expert_layouts()}
        expert_keys = experts | {f"state.{f}.{k}" for f in experts for k in _MOMENTS}
        for sd in (state["model"], state["optim"]):  # the expert DTensor views: local again
            for key, value in sd.items():
                if key in expert_keys and isinstance(value, DTensor):
                    # A copy: DCP may hand back a view that partly overlaps the parameter it
                    # is loaded into (seen with one expert per rank sharded over ep and the
                    # FFN width over tp), which the copy into the parameter refuses.
                    sd[key] = value.to_local().clone()
        for part, opt in zip(self.parts, shadows, strict=True):
            keys = set(get_model_state_dict(part))
            set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in keys})
            set_optimizer_state_dict(part, opt, state["optim"], options=_FLAT)
        if self.zero_stage == 1:
            self._zero1_restore(shadows)
        self._shadows = None

    def model_state(self) -> dict[str, Any]:
        """The model half of ``app_state()``: this rank's tensors under full-model names
        (expert slices as DTensor views), for DCP to fill in place from any source (the
        interop layer reads Hugging Face weights into it); then ``load_model_state``."""
        sd: dict[str, Any] = {}
        for part in self.parts:
            sd.update(get_model_state_dict(part))
        for fqn, mesh, placements in self._expert_layouts():
            if fqn in sd and not isinstance(sd[fqn], DTensor):
                sd[fqn] = DTensor.from_local(sd[fqn], mesh, placements, run_check=False)
        return sd

    def load_model_state(self, sd: dict[str, Any]) -> None:
        """Apply a ``model_state()`` that DCP filled."""
        experts = {fqn for fqn, _, _ in self._expert_layouts()}
        sd = {k: v.to_local() if k in experts and isinstance(v, DTensor) else v
              for k, v in sd.items()}  # fmt: skip
        for part in self.parts:
            keys = set(get_model_state_dict(part))
            set_model_state_dict(part, {k: v for k, v in sd.items() if k in keys})

    def scheduler_state(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_scheduler_state(self, state: dict[str, Any]) -> None:
        for sched in self.schedulers:
            sched.load_state_dict(state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and persistent buffers as CPU tensors, gathered over
        every dimension (collective; every rank gets it). For tests and tools."""
        mine: dict[str, torch.Tensor] = {}
        for part in self.parts:
            sd = get_model_state_dict(
                part, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
            )
            mine.update({k: _local(v).detach().cpu().clone() for k, v in sd.items()})
            if self.expert_params:  # the experts, gathered over EP (and TP under expert TP)
                full = gather_experts(part, self.ep_mesh, self.etp_mesh)
                mine.update({_fqn(k): v.cpu().clone() for k, v in full.items()})
        if self.pp_group is None:
            return mine
        gathered: list[Any] = [None] * self.dims.pp
        dist.all_gather_object(gathered, mine, group=self.pp_group)
        return {k: v for d in gathered for k, v in d.items()}

    @torch.no_grad()
    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's reduced gradient (the global-batch mean loss's), gathered to full
        size as CPU tensors under the single-process names (collective: every rank calls it
        and gets it). Valid between the reduction and the optimizer step (``grad_hook``)."""
        mine: dict[str, torch.Tensor] = {}
        zero1: dict[int, torch.Tensor] = {}
        if self.zero_stage == 1:
            assert self.grad_sync is not None
            for shard in self.grad_sync.shards:  # ZeRO-1 holds reduce-scattered slices only
                if not shard.params:
                    continue
                mine_flat = shard.grad_shard
                if mine_flat is None:
                    mine_flat = torch.zeros(shard.size, device=self.device)
                pieces = shard.gather_flat(mine_flat, self.grad_sync.shard_group)
                for p, piece in zip(shard.params, pieces, strict=True):
                    zero1[id(p)] = piece.view_as(_local(p))
        for part in self.parts:
            experts: dict[str, torch.Tensor] = {}
            for name, p in part.named_parameters():
                if is_expert_param(p):
                    experts[name] = p.grad if p.grad is not None else torch.zeros_like(p)
                    continue
                g = zero1.get(id(p), p.grad)
                if g is None:
                    g = torch.zeros_like(_local(p))
                if isinstance(p, DTensor) and not isinstance(g, DTensor):
                    g = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False)
                mine[_fqn(name)] = _full(g)
            if experts:  # gathered over EP (and TP under expert TP), like the weights
                full = gather_expert_tensors(experts, self.ep_mesh, self.etp_mesh)
                mine.update({_fqn(k): _full(v) for k, v in full.items()})
        return self._merge_stages(mine)

    @torch.no_grad()
    def full_optimizer_state(self) -> dict[str, torch.Tensor]:
        """AdamW's ``exp_avg`` and ``exp_avg_sq`` of every parameter, full size, on CPU, keyed
        ``<single-process name>.<moment>`` (collective; every rank gets it)."""
        state = self.app_state()["optim"]
        self._shadows = None
        mine: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if not key.startswith("state.") or not key.endswith(_MOMENTS):
                continue
            if isinstance(value, torch.Tensor):
                mine[_fqn(key.removeprefix("state."))] = _full(value)
        return self._merge_stages(mine)

    def _merge_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.pp_group is None:
            return mine
        gathered: list[Any] = [None] * self.dims.pp
        dist.all_gather_object(gathered, mine, group=self.pp_group)
        return {k: v for d in gathered for k, v in d.items()}


_MOMENTS = ("exp_avg", "exp_avg_sq")


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to full size (collective), or a plain tensor, as a CPU fp32 copy."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().float().cpu().clone()


def _fqn(name: str) -> str:
    """A parameter's name as state dicts spell it (wrapper prefixes removed)."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _shard_dims(t: torch.Tensor) -> list[str]:
    if not isinstance(t, DTensor):
        return []
    names = t.device_mesh.mesh_dim_names or ()
    out = []
    for name, placement in zip(names, t.placements, strict=True):
        if placement.is_partial():
            raise RuntimeError(f"gradient with a Partial placement on mesh dim {name!r}")
        if not placement.is_replicate():  # Shard, or FSDP's _StridedShard over a TP shard
            out.append(name)
    return out


def _subsets(names: tuple[str, ...]) -> list[set[str]]:
    out: list[set[str]] = [set()]
    for name in names:
        out += [s | {name} for s in out]
    return out


__all__ = ["Engine"]
