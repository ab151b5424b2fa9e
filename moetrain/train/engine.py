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

The step is this file: the micro-batch loop and the pipeline step, the loss, the order of
the optimizer step. What surrounds it are collaborators, each a class beside it handed what
it reads (constructor arguments; the step's process groups as one ``StepGroups``), never the
engine itself:

    routing    ``routing_passes.RoutingPasses``: the MoE layers' step context (routing
               replay and record, eval routing, the counting pass), the global-batch
               balancing loss's step counts, the routing records
    stats      ``layer_stats.LayerStats``: every MoE layer's statistics summed over the job,
               the expert-bias update
    qk_clip    ``qk_clip.QKClip`` (``optim.qk_clip``): the attention heads' largest logits
               over the job, and the rescale of the heads above the threshold
    grads      ``gradients.Gradients``: reduction, norm and clipping of the gradients
    views      ``state_views.CheckpointViews``: checkpoint views (ZeRO-1's shadows from
               ``zero1_state``)
    full       ``full_state.FullStateGather``: full-size gathers for the layout oracle and
               export
    inputs     ``batches.MicroBatchInputs``: a micro-batch as this rank feeds it to the
               model, and the loss scale of document masking

The model reads the step through its ``StepContext`` (``moetrain.model.step_context``), which
the engine takes from the model before parallelizing it and alone writes: the aux-loss scale
and the sequence shard once, the routing fields around each step (through ``routing``).
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

from moetrain.config import JobConfig
from moetrain.model import Transformer
from moetrain.model.moe import quantile_bins
from moetrain.model.mtp import IGNORE_INDEX
from moetrain.model.precision import Precision, fp32_region
from moetrain.parallel.accounting import params_before_dp
from moetrain.parallel.context_parallel import sequence_index
from moetrain.parallel.data_parallel import moe_layers
from moetrain.parallel.dims import Meshes, ParallelDims
from moetrain.parallel.expert_parallel import expert_layouts
from moetrain.parallel.materialize import materialize
from moetrain.parallel.parallelize import parallelize
from moetrain.parallel.pipeline import embedding_group
from moetrain.train.batches import Batch, MicroBatchInputs
from moetrain.train.full_state import FullStateGather
from moetrain.train.gradients import GradientLayout, Gradients
from moetrain.train.layer_stats import LayerStats
from moetrain.train.optim import build_scheduler
from moetrain.train.optimizers import build_optimizers
from moetrain.train.qk_clip import QKClip
from moetrain.train.routing_passes import RoutingPasses, RoutingShape
from moetrain.train.state_views import CheckpointViews
from moetrain.train.step_groups import StepGroups
from moetrain.train.tensors import local, process_group


class Engine:
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
        # What the model reads of the step (``moetrain.model.step_context``); its pipeline
        # chunks share it. Aux losses are averaged over a rank's micro-batches like the LM
        # loss (and over dp by the gradient averaging): each injected gradient is
        # 1 / micro-batches.
        self.step_context = model.step_context
        self.step_context.aux_loss_scale = 1.0 / self.n_micro
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
        self.step_context.seq_shard = pm.seq_shard  # context parallelism (None at cp = 1)
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
        etp_mesh = (
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
        # Under document masking: the step's share of its mean over counted labels that a
        # micro-batch's summed cross-entropy is multiplied by (``_set_loss_scale``).
        self._loss_scale: float | None = None
        # Accounting hook: called with "forward", "backward" and "step" (memory probes).
        self.probe: Callable[[str], None] | None = None
        # Called once per optimizer step with the engine, after the gradients are reduced
        # over every parallel dimension and before clipping: the layout oracle reads the
        # step's full gradients here (``full_grad_dict``), the oracle's own tests alter them.
        self.grad_hook: Callable[[Engine], None] | None = None

        # Groups of the step-level collectives (``StepGroups``): dp x cp, dp, pp.
        self.groups = StepGroups(
            dp=process_group(meshes.dp_cp) if meshes else None,
            seq=process_group(meshes.dp) if meshes else None,
            pp=process_group(meshes.pp) if meshes else None,
            dp_size=dims.dp, dp_cp_size=dims.dp_cp, pp_size=dims.pp,
        )  # fmt: skip
        self.pp_group = self.groups.pp
        self.zero_stage = pcfg.zero_stage if dims.dp_cp > 1 else 0
        self.grad_sync, self.optimizers = build_optimizers(
            cfg, dims, meshes, self.parts, self.expert_params
        )
        self.schedulers = [
            build_scheduler(opt, cfg.optim, max(1, cfg.train.steps)) for opt in self.optimizers
        ]
        self._collaborators(cfg, meshes, etp_mesh)
        if self.schedule is not None:
            self._warm_up_pipeline(dims.micro_batch_size(cfg), cfg.data.seq_len)

    def _collaborators(self, cfg: JobConfig, meshes: Meshes | None, etp_mesh: Any) -> None:
        """The engine's parts, each handed what it reads (module doc)."""
        dims, pcfg = self.dims, cfg.parallel
        # The global index of this rank's first sequence of a step (router jitter, routing
        # replay and record are keyed by it).
        dp_rank = self.coords["dp_replicate"] * dims.dp_shard + self.coords["dp_shard"]
        shape = RoutingShape(cfg.train.global_batch_size, cfg.data.seq_len, cfg.moe.top_k,
                             cfg.model.n_layers, cfg.moe.global_aux_loss_coef > 0,
                             cfg.train.seed, dp_rank * (cfg.train.global_batch_size // dims.dp))
        self.inputs = MicroBatchInputs(cfg.model.document_mask, self.seq_index, self.device,
                                       self.groups)  # fmt: skip
        self.routing = RoutingPasses(self.step_context, self.moe, bool(self.moe_layer_ids),
                                     self.groups, shape, self.device)  # fmt: skip
        self.stats = LayerStats(self.moe, self.moe_layer_ids, cfg.moe.num_experts, self.groups,
                                self.device, quantile_bins(cfg.moe))  # fmt: skip
        self.qk_clip: QKClip | None = None
        if cfg.optim.qk_clip is not None:
            attention_ids = range(cfg.model.n_layers + cfg.model.mtp_depth)
            self.qk_clip = QKClip(self.parts, attention_ids, cfg.model.n_heads,
                                  cfg.optim.qk_clip, self.coords["tp"], self.device)  # fmt: skip
            self.step_context.max_logits = True
        pipelined_mtp = bool(cfg.model.mtp_depth) and dims.pp > 1
        # Multi-token prediction under a pipeline: the ranks of the first stage's embedding
        # and the last stage's copy of it (None: one rank holds both, or no pipeline).
        emb_group = embedding_group(meshes, dims, pcfg.pp_schedule) if (
            meshes is not None and pipelined_mtp) else None  # fmt: skip
        layout = GradientLayout(self.zero_stage, dims.cp, dims.dp_cp, pipelined_mtp)
        self.grads = Gradients(self.parts, self.grad_sync, meshes, self.expert_params, etp_mesh,
                               emb_group, layout, self.device)  # fmt: skip
        self.views = CheckpointViews(
            self.parts, self.optimizers, self.schedulers, self.grad_sync, self.zero_stage,
            meshes, bool(self.expert_params), pcfg, cfg.optim, self.device)  # fmt: skip
        zero1 = self.grad_sync if self.zero_stage == 1 else None
        self.full = FullStateGather(
            self.parts, self.expert_params, meshes.ep if meshes is not None else None, etp_mesh,
            self.groups, zero1, self.views.optimizer_state, self.device)  # fmt: skip

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
        self.step_context.zero_stage_input = True  # deterministic inputs for shape inference
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self._pipeline_step(dummy[: self.breadth], train=True)
            with torch.no_grad():  # the forward-only schedule infers its shapes once too
                self._pipeline_step(dummy[: self.breadth], train=False)
        self.step_context.zero_stage_input = False
        for part in self.parts:
            part.zero_grad(set_to_none=True)
            part.pop_mtp_loss()
        for layer in self.moe.values():
            layer.pop_stats()
        if self.qk_clip is not None:
            self.qk_clip.reset()

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
        micro-batch, on the device (``MicroBatchInputs.of``)."""
        return self.inputs.of(batch)

    def _set_loss_scale(self, micro_batches: list[Batch]) -> None:
        """The step's ``_loss_scale`` (collective; ``MicroBatchInputs.loss_scale``)."""
        self._loss_scale = self.inputs.loss_scale(micro_batches)

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
        # The optimizer step (the scheduler's count, restored on resume) keys router jitter.
        self.routing.begin_step(micro_batches, self.schedulers[0].last_epoch, replay, record)
        self._set_loss_scale(micro_batches)
        n, breadth = len(micro_batches), self.breadth
        # The global-batch balancing loss's step counts: from a counting pass first, or
        # between the step's one forward per rank and its backward.
        counted = self.routing.when_counted(n, breadth, self.schedule is not None)
        if counted == "pass":
            self.routing.counting_pass(micro_batches, breadth, self._forwards)
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
                        if counted == "forward":  # the step's only forward
                            self.routing.hand_over_counts()
                        (loss / n).backward()
                    else:
                        pending.append(loss / n)
                total += local(loss).detach() / n
            if pending:
                with self._loss_ctx():
                    if counted == "forward":  # every forward of the step has run
                        self.routing.hand_over_counts()
                    sum(pending).backward()
        self.routing.end_step()
        if self.probe is not None:
            self.probe("backward")
        return self.groups.mean_over_dp(total)

    def _forwards(self, micro_batches: list[Batch]) -> None:
        """Forwards of one pass of micro-batches, nothing kept (the counting pass; no grad):
        through the forward-only schedule, or the local model."""
        if self.schedule is not None:
            self._pipeline_step(micro_batches, train=False)
            return
        for batch in micro_batches:
            inputs, labels, kwargs = self._batch_inputs(batch)
            with self._loss_ctx():
                self._forward(self.parts[0], inputs, labels, kwargs)

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
        return float(self.groups.mean_over_dp(mean))

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

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[Batch], routing: dict[str, Any] | None = None) -> float:
        """Mean loss over this rank's eval micro-batches, averaged over dp.

        ``routing``: a dict to fill (collective) with the eval tokens' routing, gathered over
        dp and pp on every rank: ``input_ids`` (sequences, S) in the eval split's order and
        ``ids`` {layer: (sequences * S, K)} for every MoE layer of the model."""
        self.train(False)
        if routing is not None:
            self.routing.start_eval_record()
        try:
            loss = self._eval_loss(micro_batches)
            if routing is not None:
                routing.update(self.routing.eval_routing(micro_batches))
            return loss
        finally:
            self.routing.stop_eval_record()
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
        return self.groups.mean_over_dp(total)

    # ------------------------------------------------------------------ optimizer

    def _sync_embedding_copies(self) -> None:
        """Multi-token prediction under a pipeline: the embedding's two copies get the sum
        of their gradients (``Gradients.sync_embedding_copies``)."""
        self.grads.sync_embedding_copies()

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients (``Gradients.norm``)."""
        return self.grads.norm()

    @torch.no_grad()
    def optimizer_step(self, max_norm: float | None, loss: float = 0.0) -> float:
        """Give unused parameters a zero gradient, reduce gradients (stages 0/1), clip to
        ``max_norm``, step, all-gather (ZeRO-1), zero the gradients. Returns the global
        gradient norm before clipping.

        When the norm or ``loss`` is not finite the update is skipped on every rank (the norm
        and loss are global, so all ranks agree): parameters and optimizer state stay as
        they were, the gradients are dropped and the schedule advances."""
        self.grads.fill_unused()
        self.grads.match_placements()
        self._sync_embedding_copies()
        self.grads.reduce()
        if self.grad_hook is not None:
            self.grad_hook(self)
        norm = self.grad_norm()
        norm_f = float(norm)
        update = math.isfinite(norm_f) and math.isfinite(loss)
        if update and max_norm is not None:
            self.grads.clip(norm, max_norm)
        if update:
            for opt in self.optimizers:
                opt.step()
            if self.grad_sync is not None:
                self.grad_sync.gather_params()
        if self.qk_clip is not None:  # the logits' maxima of this step, and the rescale
            self.qk_clip.step(update)
        self.after_step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.grads.zero()
        for sched in self.schedulers:
            sched.step()
        return norm_f

    def after_step(self) -> None:
        """Between the optimizer step and zeroing the gradients."""
        if self.probe is not None:
            self.probe("step")

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    # ------------------------------------------------------------------ the collaborators'
    # The trainer's, the checkpoints' and the oracle's entry points, each one collaborator's
    # method (module doc).

    def moe_stats(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every MoE layer's statistics of the step, summed over the job (``LayerStats.pop``)."""
        return self.stats.pop()

    def update_expert_bias(self, stats: dict[int, dict[str, torch.Tensor]]) -> None:
        self.stats.update_expert_bias(stats)

    def max_logits(self) -> dict[int, float]:
        """QK-clip: the last step's largest attention logit per layer over the job (empty
        without ``optim.qk_clip``)."""
        return self.qk_clip.per_layer() if self.qk_clip is not None else {}

    def routing_record(self) -> dict[str, Any] | None:
        return self.routing.routing_record()

    def app_state(self) -> dict[str, Any]:
        return self.views.app_state()

    def load_app_state(self, state: dict[str, Any]) -> None:
        self.views.load_app_state(state)

    def model_state(self) -> dict[str, Any]:
        return self.views.model_state()

    def load_model_state(self, sd: dict[str, Any]) -> None:
        self.views.load_model_state(sd)

    def scheduler_state(self) -> dict[str, Any]:
        return self.views.scheduler_state()

    def load_scheduler_state(self, state: dict[str, Any]) -> None:
        self.views.load_scheduler_state(state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.full.full_state_dict()

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        return self.full.full_grad_dict()

    def full_optimizer_state(self) -> dict[str, torch.Tensor]:
        return self.full.full_optimizer_state()


__all__ = ["Engine", "build_optimizers"]
