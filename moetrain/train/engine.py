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

The step is this file; what surrounds it lives beside it, mixed into ``Engine``:
``routing_passes`` (the global-batch balancing loss's counting pass, routing records),
``state_views`` (checkpoint views, with ZeRO-1's shadows from ``zero1_state``) and
``full_state`` (full-size gathers for the layout oracle and export).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.config import JobConfig
from moetrain.model import Transformer
from moetrain.model.masks import document_ids
from moetrain.model.moe import SCORE_HIST_BINS, STAT_NAMES
from moetrain.model.mtp import IGNORE_INDEX
from moetrain.model.precision import Precision, fp32_region
from moetrain.parallel.accounting import params_before_dp
from moetrain.parallel.context_parallel import sequence_index
from moetrain.parallel.data_parallel import GradientSync, moe_layers
from moetrain.parallel.dims import Meshes, ParallelDims
from moetrain.parallel.expert_parallel import (
    expert_grad_sq_norm,
    expert_layouts,
    is_expert_param,
    reduce_expert_grads,
    sum_of_squares,
)
from moetrain.parallel.materialize import materialize
from moetrain.parallel.parallelize import parallelize
from moetrain.parallel.pipeline import embedding_copy, embedding_group
from moetrain.train.full_state import FullStateGather
from moetrain.train.muon import expert_matrices
from moetrain.train.optim import build_optimizer, build_scheduler, optimizer_groups
from moetrain.train.routing_passes import Batch, RoutingPasses
from moetrain.train.state_views import StateViews
from moetrain.train.tensors import local, process_group, shard_dims
from moetrain.train.zero1_state import build_zero1_optimizers

_NORM_DIMS = ("dp_replicate", "dp_shard", "tp")


def counted_labels(batch: Batch, document_mask: bool) -> torch.Tensor:
    """A micro-batch's labels with the positions left out of the loss set to
    ``IGNORE_INDEX``: those already so (padding) and, under document masking, every
    document's separator (``doc_ends``)."""
    labels = batch["labels"]
    ends = batch.get("doc_ends")
    if document_mask and ends is not None:
        labels = labels.masked_fill(ends.to(labels.device, torch.bool), IGNORE_INDEX)
    return labels


def build_optimizers(
    cfg: JobConfig,
    dims: ParallelDims,
    meshes: Meshes | None,
    parts: list[nn.Module],
    expert_params: list[nn.Parameter],
) -> tuple[GradientSync | None, list[torch.optim.Optimizer]]:
    """The optimizer(s) of this rank's model chunks (``parallelize``'s parts): one AdamW (or
    Muon + AdamW, ``optim.name``) per chunk (state dicts are per module), or for ZeRO stages
    0/1 a ``GradientSync`` and, for ZeRO-1, one optimizer over this rank's slices (and one
    over its experts). The engine steps
    them; ``moetrain plan`` builds the same ones on the meta device and reads the state they
    create (the optimizer decides its states' shapes and dtypes, not a formula)."""
    zero_stage = cfg.parallel.zero_stage if dims.dp_cp > 1 else 0
    grad_sync: GradientSync | None = None
    # optimizer_groups of every chunk, merged by index, experts apart (reduced over edp)
    groups: list[list[nn.Parameter]] = []
    expert_groups: list[list[nn.Parameter]] = []
    for part in parts:
        for i, group in enumerate(optimizer_groups(part, cfg.optim)):
            if i == len(groups):
                groups.append([])
                expert_groups.append([])
            groups[i] += [p for p in group if not is_expert_param(p)]
            expert_groups[i] += [p for p in group if is_expert_param(p)]
    if zero_stage <= 1 and meshes is not None:
        grad_sync = GradientSync(
            groups,
            zero_stage,
            process_group(meshes.dp_cp),
            process_group(meshes.dp_shard_cp),
            process_group(meshes.dp_replicate),
        )
    # Muon: where each expert slice sits in its full tensor (moetrain.train.muon)
    muon = {}
    if cfg.optim.name == "muon":
        muon["whole_matrices"] = expert_matrices(parts, meshes, cfg)
    if zero_stage == 1:
        assert grad_sync is not None
        return grad_sync, build_zero1_optimizers(grad_sync, expert_groups, cfg.optim, **muon)
    return grad_sync, [build_optimizer(part, cfg.optim, **muon) for part in parts]


class Engine(RoutingPasses, StateViews, FullStateGather):
    """Runs training steps of ``model`` under the layout ``dims`` (``meshes`` None: one
    process, no collectives).

    ``model`` is built on the meta device (``moetrain.model.meta_model``): the layout is
    applied to it there, then this rank's shards alone get storage on ``device`` and their
    initial values from ``train.seed``, the same under every layout
    (``moetrain.parallel.materialize``). ``skip_init``: full-model names whose random
    initialisation is left out, because a start (``model.init_from``) loads them next."""

    def __init__(
        self,
        cfg: JobConfig,
        model: Transformer,
        dims: ParallelDims,
        meshes: Meshes | None,
        device: torch.device,
        precision: Precision,
        skip_init: Collection[str] = (),
    ) -> None:
        if not all(p.is_meta for p in model.parameters()):
            raise ValueError("Engine: the model must be built on the meta device (meta_model)")
        self.cfg = cfg
        self.dims = dims
        self.meshes = meshes
        self.device = device
        self.precision = precision
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
        pm = parallelize(
            model,
            dims,
            meshes,
            pcfg,
            pp_rank=self.coords["pp"],
            compile=cfg.train.compile,
            precision=precision,
            device=device,
            n_microbatches=self.breadth,
            loss_fn=self._pipeline_loss,
            seq_len=cfg.data.seq_len,
        )
        self.parts: list[nn.Module] = pm.parts
        for part in self.parts:  # autocast around each forward (none in an fp32 run)
            precision.wrap_forward(part)
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
        # This rank's shards made real and initialised (the largest generator block drawn is
        # what the plan adds to them as the start-up's workspace).
        layouts = expert_layouts(self.parts, meshes, pcfg)
        self.init_block = materialize(
            self.parts, device, cfg.model, cfg.train.seed, layouts, skip_init
        )
        self.params_at_rest = params_before_dp(self.parts)
        self._record_inputs: torch.Tensor | None = None  # forward_backward(record=True)
        # The last ``moe_stats`` result and its token counts on the device.
        self._loads_on_device: tuple[Any, dict[int, torch.Tensor]] = (None, {})
        # Under document masking: the step's share of its mean over counted labels that a
        # micro-batch's summed cross-entropy is multiplied by (``_set_loss_scale``).
        self._loss_scale: float | None = None
        # Accounting hook: called with "forward", "backward" and "step" (memory probes).
        self.probe: Callable[[str], None] | None = None
        # Called once per optimizer step with the engine, after the gradients are reduced
        # over every parallel dimension and before clipping: the layout oracle reads the
        # step's full gradients here (``full_grad_dict``), the oracle's own tests alter them.
        self.grad_hook: Callable[[Engine], None] | None = None

        # Groups of the step-level collectives. Losses, gradients and statistics are averaged
        # or summed over dp x cp: cp ranks hold other tokens of the same sequences.
        self.dp_group = process_group(meshes.dp_cp) if meshes else None
        # The ranks holding other sequences (dp alone): what gathers whole sequences' records
        # (routing records, eval routing) run over, after the MoE layers gathered them over cp.
        self.seq_group = process_group(meshes.dp) if meshes else None
        self.pp_group = process_group(meshes.pp) if meshes else None
        # Multi-token prediction under a pipeline: the ranks of the first stage's embedding
        # and the last stage's copy of it (None: one rank holds both, or no pipeline).
        self.embedding_group = (
            embedding_group(meshes, dims, pcfg.pp_schedule)
            if meshes is not None and cfg.model.mtp_depth and dims.pp > 1
            else None
        )

        self.zero_stage = pcfg.zero_stage if dims.dp_cp > 1 else 0
        self.grad_sync, self.optimizers = build_optimizers(
            cfg, dims, meshes, self.parts, self.expert_params
        )
        self.schedulers = [
            build_scheduler(opt, cfg.optim, max(1, cfg.train.steps)) for opt in self.optimizers
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
        dummy = [
            {**b, "labels": b["input_ids"], "doc_ends": torch.zeros(mbs, seq_len, dtype=torch.bool)}
            for b in dummy
        ]
        for part in self.parts:
            part.zero_stage_input = True  # deterministic inputs for the shape inference
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self._pipeline_step(dummy[: self.breadth], train=True)
            with torch.no_grad():  # the forward-only schedule infers its shapes once too
                self._pipeline_step(dummy[: self.breadth], train=False)
        for part in self.parts:
            part.zero_stage_input = False
        for part in self.parts:
            part.zero_grad(set_to_none=True)
            part.pop_mtp_loss()
        for layer in self.moe.values():
            layer.pop_stats()

    # ------------------------------------------------------------------ loss

    def _loss_ctx(self) -> ExitStack:
        """Around a loss and its backward: tensor parallelism's vocabulary-parallel loss.
        Autocast is not here: it wraps the model parts' forwards (``Precision.wrap_forward``)."""
        stack = ExitStack()
        if self.tp_enabled:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        return stack

    def _ce(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss: the mean cross-entropy over its counted labels, or, under
        document masking, their sum times ``_loss_scale`` (its share of the step's mean over
        every counted label: micro-batches and cp shards count different numbers)."""
        region = fp32_region("loss", labels.device.type)  # fp32 logits (model.precision)
        with region.autocast_off():
            logits, labels = region.cast(logits).flatten(0, 1), labels.flatten()
            if self._loss_scale is None:
                return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
            ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
            return ce * self._loss_scale

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._ce(logits, labels) / self.n_micro

    def _batch_inputs(
        self, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(this rank's input tokens, its labels, the model's keyword inputs) of a
        micro-batch, on the device. Keyword inputs cover the whole sequences (every cp rank
        needs the keys' documents): ``documents`` under document masking, and ``valid``
        (the labels that count) when some do not."""
        document_mask = self.cfg.model.document_mask
        labels = counted_labels(batch, document_mask)
        kwargs: dict[str, torch.Tensor] = {}
        ends = batch.get("doc_ends")
        if document_mask and ends is not None:
            kwargs["documents"] = document_ids(ends).to(self.device, non_blocking=True)
        valid = labels != IGNORE_INDEX
        if document_mask or not bool(valid.all()):
            kwargs["valid"] = valid.to(self.device, non_blocking=True)
        inputs = self._local_tokens(batch["input_ids"]).to(self.device, non_blocking=True)
        return inputs, self._local_tokens(labels).to(self.device, non_blocking=True), kwargs

    def _set_loss_scale(self, micro_batches: list[Batch]) -> None:
        """Under document masking, each micro-batch's summed cross-entropy times
        ``len(micro_batches) * dp_cp / V`` (V: the counted labels of the whole step, over
        every data-parallel rank; collective) makes the step's loss and gradient the mean
        over its counted labels, whatever the layout: the usual averaging over
        micro-batches and dp x cp ranks then sums the shares. Otherwise None: a micro-batch's
        loss is the mean over its counted labels (all of them unless the batch pads)."""
        if not self.cfg.model.document_mask:
            self._loss_scale = None
            return
        count = sum(int((counted_labels(b, True) != IGNORE_INDEX).sum()) for b in micro_batches)
        total = torch.tensor(float(count), dtype=torch.float64, device=self.device)
        if self.seq_group is not None:  # whole sequences: cp ranks counted the same ones
            dist.all_reduce(total, group=self.seq_group)
        n = float(total)
        self._loss_scale = len(micro_batches) * self.dims.dp_cp / n if n else 0.0

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
                layer.record_BSK = torch.full(
                    (gbs, seq, K), -1, dtype=torch.int64, device=self.device
                )
        self._record_inputs = torch.cat([b["input_ids"] for b in micro_batches]) if record else None
        self._set_loss_scale(micro_batches)
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
                inputs, labels, kwargs = self._batch_inputs(batch)
                with self._loss_ctx():
                    loss = self._ce(self._forward(model, inputs, labels, kwargs), labels)
                    if self.probe is not None:
                        self.probe("forward")
                    if breadth == 1:
                        if counted_in_forward:  # the step's only forward
                            self._set_global_counts()
                        (loss / n).backward()
                    else:
                        pending.append(loss / n)
                total += local(loss).detach() / n
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

    def _forward(
        self,
        model: Any,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        kwargs: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The model's logits (``kwargs``: its keyword inputs, ``_batch_inputs``); with
        multi-token prediction its modules see the labels."""
        if self.cfg.model.mtp_depth:
            return model(inputs, labels=labels, **kwargs)
        return model(inputs, **kwargs)

    def pop_mtp_loss(self) -> float:
        """The step's multi-token-prediction loss (lambda / D * sum_k L^k, mean over its
        forwards and dp ranks); nan without it."""
        if not self.cfg.model.mtp_depth:
            return float("nan")
        sums = sum(part.pop_mtp_loss() for part in self.parts)
        if self.pp_group is not None:  # the last stage's
            dist.all_reduce(sums, group=self.pp_group)
        mean = sums[0] / sums[1].clamp_min(1)
        return float(self._mean_over_dp(mean))

    def _local_tokens(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """This rank's positions of every sequence (context parallelism), or all of them."""
        return tokens_BS if self.seq_index is None else tokens_BS[:, self.seq_index]

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
        parts = [self._batch_inputs(b) for b in micro_batches]
        inputs = torch.cat([p[0] for p in parts])
        labels = torch.cat([p[1] for p in parts])
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first_stage else ()
        # The model's keyword inputs reach every stage (the schedule splits them by
        # micro-batch like the inputs); a micro-batch whose labels all count has no
        # ``valid`` of its own when another one has.
        keys = {k for p in parts for k in p[2]}
        for p, b in zip(parts, micro_batches, strict=True):
            if "valid" in keys and "valid" not in p[2]:  # whole sequences, like the others
                p[2]["valid"] = torch.ones(b["labels"].shape, dtype=torch.bool, device=self.device)
        kwargs: dict[str, Any] = {k: torch.cat([p[2][k] for p in parts]) for k in sorted(keys)}
        if self.cfg.model.mtp_depth and self.parts[0].training:
            # Training forwards (and the counting pass) run the multi-token-prediction
            # modules of the last stage: they read the labels (``_forward``).
            kwargs["labels"] = labels
        if self.last_stage:
            kwargs.update(target=labels, losses=losses)
        with self._loss_ctx():
            if train:
                self.schedule.step(*args, **kwargs)
            else:
                self.eval_schedule.eval(*args, **kwargs)
        total = torch.zeros((), device=self.device)
        for loss in losses:  # each already divided by the micro-batch count
            total += local(loss).detach().float()
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
    def eval_loss(self, micro_batches: list[Batch], routing: dict[str, Any] | None = None) -> float:
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

    def _eval_loss(self, micro_batches: list[Batch]) -> float:
        self._set_loss_scale(micro_batches)
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
                inputs, labels, kwargs = self._batch_inputs(batch)
                with self._loss_ctx():
                    losses.append(local(self._ce(self.parts[0](inputs, **kwargs), labels)))
            total = torch.stack(losses).float().mean()
        return self._mean_over_dp(total)

    # ------------------------------------------------------------------ optimizer

    def _grad_pieces(self, norm: bool = False) -> list[tuple[torch.Tensor, frozenset[str]]]:
        """(local gradient, mesh dims it is sharded over) of this rank's non-expert
        gradients; ``norm``: only its share of the gradient norm (the last stage's copy of the
        embedding, whose gradient equals the first stage's, left out)."""
        out = []
        copies = {id(c) for c in self._embedding_copies()} if norm else set()
        if self.grad_sync is not None:
            zero1 = self.zero_stage == 1
            for grad, param in self.grad_sync.grad_pieces():
                if id(param) in copies:
                    continue
                dims = set(shard_dims(param))
                if zero1:  # sharded over dp_shard (x cp)
                    dims.add("dp_shard_cp" if self.dims.cp > 1 else "dp_shard")
                out.append((local(grad), frozenset(dims)))
            return out
        for part in self.parts:
            for p in part.parameters():
                if p.grad is not None and not is_expert_param(p) and id(p) not in copies:
                    out.append((local(p.grad), frozenset(shard_dims(p.grad))))
        return out

    def _embedding_copies(self) -> list[nn.Parameter]:
        """The last stage's copy of the embedding, when this rank holds it (multi-token
        prediction under a pipeline, ``moetrain.parallel.pipeline.embedding_copy``)."""
        return [c for c in map(embedding_copy, self.parts) if c is not None]

    @torch.no_grad()
    def _sync_embedding_copies(self) -> None:
        """Sum the gradients of the first stage's embedding and the last stage's copy (both
        this rank's, or over ``embedding_group``), before any other reduction: both copies
        then take the same step. Each has the gradient of its own uses (the main model's
        input, the multi-token-prediction modules' inputs); the embedding's is their sum."""
        if not self.cfg.model.mtp_depth or self.dims.pp == 1:
            return
        mine = self._embedding_copies()
        mine += [part.tok_embeddings.weight for part in self.parts
                 if part.embeds_input and part.tok_embeddings is not None]  # fmt: skip
        if not mine:
            return  # a stage in the middle
        for p in mine:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local(p.grad) for p in mine]
        total = torch.stack(grads).sum(0)
        if self.embedding_group is not None:
            dist.all_reduce(total, group=self.embedding_group)
        for g in grads:
            g.copy_(total)

    def _expert_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.expert_params if p.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients: squares summed locally per sharding class, then
        over exactly the mesh dims each class is sharded over, then over pipeline stages."""
        # ZeRO shards over dp_shard x cp under context parallelism (one flattened dim).
        norm_dims = tuple("dp_shard_cp" if d == "dp_shard" and self.dims.cp > 1 else d
                          for d in _NORM_DIMS)  # fmt: skip
        classes = [frozenset(c) for c in _subsets(norm_dims)]
        pieces: list[list[torch.Tensor]] = [[] for _ in classes]
        for grad, dims in self._grad_pieces(norm=True):
            pieces[classes.index(dims)].append(grad.detach())
        sq = [sum_of_squares(p, self.device) for p in pieces]
        if self.meshes is not None:
            for name in norm_dims:
                group = process_group(getattr(self.meshes, name))
                if group is None:
                    continue
                sharded = [i for i, c in enumerate(classes) if name in c]
                part = torch.stack([sq[i] for i in sharded])
                dist.all_reduce(part, group=group)
                for j, i in enumerate(sharded):
                    sq[i] = part[j]
        total = torch.stack(sq).sum()
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
        self._sync_embedding_copies()
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
        # The expert-bias update reads the counts where they are (``update_expert_bias``).
        loads = {i: packed[row, k : k + E].float() for row, i in enumerate(moe_ids)}
        packed = packed.float().cpu()  # every layer's statistics in one read (a host sync)
        self._loads_on_device = (out, loads)
        for row, i in enumerate(moe_ids):
            v = packed[row]
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
        last, loads = self._loads_on_device
        for i, layer in self.moe.items():
            # ``moe_stats``'s own result: its counts still on the device (a copy back from
            # the host would wait for the device to finish).
            load_E = loads[i] if stats is last else stats[i]["tokens_per_expert"].to(self.device)
            layer.update_expert_bias(load_E)


def _subsets(names: tuple[str, ...]) -> list[set[str]]:
    out: list[set[str]] = [set()]
    for name in names:
        out += [s | {name} for s in out]
    return out


__all__ = ["Engine", "build_optimizers"]
