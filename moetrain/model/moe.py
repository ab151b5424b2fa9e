"""The MoE feed-forward layer, read as its phases:

    route -> plan (capacity) -> dispatch (permute) -> experts -> combine (unpermute)
    (+ shared experts) -> balancing losses

What reaches the layer from outside is explicit: its config section at construction, the
``StepContext`` it reads (``moetrain.model.step_context``: routing replay and record, eval
routing, the engine's counting pass, the aux-loss scale, the sequence shard; set by whoever
runs the steps, never by the layer), the jitter key of the step (``set_jitter_key``) and the
dispatcher (``install_dispatcher``: the seam of expert parallelism). What it accumulates
lives in two objects others read by name: its statistics (``stats``, a ``MoEStats``, popped
with ``pop_stats()``) and the global-batch balancing loss with its step counts
(``global_balance``, a ``GlobalBalanceLoss``). Aux losses reach the optimizer through
``AuxLossInjector`` (their gradient rides on the layer output): nothing goes through
globals. Offline ablation changes routing at eval time through ``Router.routing_override``.

Shape legend: B batch, S sequence, T = B*S tokens, D model dim, E experts, K top-k,
N buffer rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from moetrain.config import MoEConfig
from moetrain.kernels import RouteResult, combine_weights, route, select_kernels
from moetrain.kernels.common import bin_counts
from moetrain.model.dispatch import (
    Dispatcher,
    DispatchPlan,
    Flight,
    LocalDispatcher,
    plan_dispatch,
    plan_dispatch_sharded,
)
from moetrain.model.experts import FeedForward, GroupedExperts
from moetrain.model.jitter import feature_hashes, jitter_factors
from moetrain.model.losses import (
    AuxLossInjector,
    GlobalBalanceLoss,
    balance_probs,
    load_balancing_loss,
    router_entropy,
    token_mean,
    token_weights,
    z_loss,
)
from moetrain.model.moe_stats import SCORE_HIST_BINS, STAT_NAMES, MoEStats
from moetrain.model.precision import as_compute, fp32_region
from moetrain.model.quantile_balance import quantile_bias, required_bias_histogram
from moetrain.model.sequence_shard import SequenceShard
from moetrain.model.step_context import StepContext

__all__ = ["SCORE_HIST_BINS", "STAT_NAMES", "MoELayer", "Router", "RoutingOverride"]


@dataclass
class RoutingOverride:
    """Eval-only routing changes for offline ablation (``tools/offline_ablation.py``).

    Set ``Router.routing_override`` and run the model in eval mode; a training forward with an
    override raises. Applied in field order: replay, then top-1, then zeroing.
    """

    replay_ids_TK: torch.Tensor | None = None
    """Expert ids to use instead of the router's choice (a recorded routing, (T, K))."""
    top1: bool = False
    """Keep only each token's first choice (its combine weight renormalised as configured)."""
    zero_experts: tuple[int, ...] = ()
    """Experts whose output is zeroed: their combine weights become 0. Their tokens still take
    their capacity slots, so every other expert sees exactly the tokens it saw before."""

    def apply(self, r: RouteResult, renormalize: bool, score_func: str) -> RouteResult:
        ids_TK, weights_TK = r.ids_TK, r.weights_TK
        if self.replay_ids_TK is not None:
            if tuple(self.replay_ids_TK.shape) != tuple(ids_TK.shape):
                raise ValueError(f"routing_override.replay_ids_TK: shape "
                                 f"{tuple(self.replay_ids_TK.shape)}, the router chose "
                                 f"{tuple(ids_TK.shape)}")
            ids_TK = self.replay_ids_TK.to(ids_TK.device, torch.int64)
        if self.top1:
            ids_TK = ids_TK[:, :1]
        if ids_TK is not r.ids_TK:
            weights_TK = combine_weights(r.scores_TE, ids_TK, renormalize, score_func)
        if self.zero_experts:
            zero_E = torch.zeros(r.scores_TE.shape[1], dtype=torch.bool, device=ids_TK.device)
            zero_E[list(self.zero_experts)] = True
            weights_TK = weights_TK.masked_fill(zero_E[ids_TK], 0.0)
        counts_E = bin_counts(ids_TK, r.scores_TE.shape[1])
        return RouteResult(weights_TK, ids_TK, r.scores_TE, r.lse_T, counts_E)


def quantile_bins(cfg: MoEConfig) -> int:
    """Quantile balancing's histogram bins per expert: 0 when it is off."""
    return cfg.quantile_balancing_bins if cfg.quantile_balancing else 0


class Router(nn.Module):
    """fp32 linear gate, scores, (biased) top-k selection and combine weights."""

    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        # gpt-oss: a trained bias on the logits (``moe.router_bias``).
        self.gate = nn.Linear(dim, cfg.num_experts, bias=cfg.router_bias)
        # Aux-loss-free balancing: added to the scores for selection only, never to the
        # combine weights. A persistent buffer (saved in checkpoints), not a parameter.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        # The jitter's hash of each feature index (``feature_hashes``), computed once: a
        # compiled router reads it instead of computing it in its graph (see
        # ``jitter_factors``).
        self.register_buffer("jitter_hashes", feature_hashes(dim), persistent=False)
        # Eval-only routing change for offline ablation; always None in training.
        self.routing_override: RoutingOverride | None = None

    def init_buffers(self) -> None:
        """The expert bias starts at zero; the feature hashes are recomputed
        (``moetrain.model.init.init_buffers``)."""
        self.expert_bias.zero_()
        self.jitter_hashes.copy_(feature_hashes(self.jitter_hashes.numel(), "cpu"))

    def forward(
        self,
        x_TD: torch.Tensor,
        backend: str,
        jitter_at: tuple[tuple[int | torch.Tensor, ...], torch.Tensor, torch.Tensor] | None = None,
        replay_ids_TK: torch.Tensor | None = None,
    ) -> RouteResult:
        """``jitter_at``: (key, seq_T, pos_T) of ``jitter_factors`` -- where these tokens are
        in the run, so that the jitter does not depend on the layout. None: key (0, 0, 0) and
        the local row as the sequence index (a router used on its own).

        ``replay_ids_TK`` (routing replay in training): the expert ids to use instead of the
        router's top-k; the combine weights are the router's scores of those experts
        (renormalised as configured), so the router keeps its gradient."""
        if self.training and self.cfg.jitter_eps > 0:
            if jitter_at is None:
                rows_T = torch.arange(x_TD.shape[0], device=x_TD.device)
                jitter_at = ((0, 0, 0), rows_T, torch.zeros_like(rows_T))
            key, seq_T, pos_T = jitter_at
            factors_TD = jitter_factors(
                self.cfg.jitter_eps, key, seq_T, pos_T, x_TD.shape[1], self.jitter_hashes
            )
            x_TD = x_TD * factors_TD.to(x_TD.dtype)
        # The gate runs in fp32 even under bf16 autocast (moetrain.model.precision).
        gate = fp32_region("router_gate", x_TD.device.type)
        with gate.autocast_off():
            bias_E = gate.cast(self.gate.bias) if self.gate.bias is not None else None
            logits_TE = nn.functional.linear(gate.cast(x_TD), gate.cast(self.gate.weight), bias_E)
        # The scores and top-k take fp32 logits (``route``'s contract): the gate's are.
        logits_TE = logits_TE.float()
        cfg = self.cfg
        bias = self.expert_bias if cfg.selects_with_bias else None
        # Group-limited routing has no Triton kernel: that one step runs the torch router.
        route_backend = "torch" if cfg.n_groups > 1 else backend
        r = route(logits_TE, cfg.top_k, score_func=cfg.score_func, expert_bias_E=bias,
                  renormalize=cfg.renormalize, backend=route_backend, n_groups=cfg.n_groups,
                  topk_groups=cfg.topk_groups, group_score=cfg.group_score)
        if replay_ids_TK is not None:
            ids_TK = replay_ids_TK.to(r.ids_TK.device, torch.int64)
            weights_TK = combine_weights(r.scores_TE, ids_TK, cfg.renormalize, cfg.score_func)
            counts_E = bin_counts(ids_TK, cfg.num_experts)
            r = RouteResult(weights_TK, ids_TK, r.scores_TE, r.lse_T, counts_E)
        if self.routing_override is not None:
            if self.training:
                raise RuntimeError("Router.routing_override is eval-only: call model.eval()")
            r = self.routing_override.apply(r, cfg.renormalize, cfg.score_func)
        if cfg.routed_scaling_factor != 1.0:
            r = r._replace(weights_TK=r.weights_TK * cfg.routed_scaling_factor)
        return r


@dataclass
class LayerPass:
    """One forward of an MoE layer between its phases (``MoELayer.begin`` / ``exchange`` /
    ``end``): what a phase hands the next."""

    shape: tuple[int, int, int]
    backend: str
    r: RouteResult
    plan: DispatchPlan
    ids_all_TK: torch.Tensor | None
    valid_T: torch.Tensor | None
    valid_all_T: torch.Tensor | None
    xc_TD: torch.Tensor
    flight: Flight
    share: float = 1.0
    """The fraction of the micro-batch this forward holds (``MoELayer.begin``)."""
    shared_TD: torch.Tensor | None = None
    received: torch.Tensor | None = None
    """Rows this rank's experts received (the statistics' ``recv_rows``)."""


class MoELayer(nn.Module):
    """An MoE feed-forward layer (module doc). ``context``: the step context it reads (a
    ``Transformer`` hands all its layers its one context; None: a context of its own, for a
    layer used alone)."""

    def __init__(
        self, dim: int, cfg: MoEConfig, layer_id: int = 0, context: StepContext | None = None
    ):
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.num_experts = cfg.num_experts
        self.step_context = context if context is not None else StepContext()
        self.router = Router(dim, cfg)
        self.experts = GroupedExperts(
            cfg.num_experts, dim, cfg.expert_ffn_dim, cfg.top_k, bias=cfg.expert_ffn_bias,
            activation=cfg.expert_activation, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
        )
        self.shared_experts: FeedForward | None = None
        if cfg.num_shared_experts > 0:
            hidden = cfg.shared_expert_ffn_dim or cfg.num_shared_experts * cfg.expert_ffn_dim
            self.shared_experts = FeedForward(dim, hidden)
        # Qwen2-MoE: a per-token sigmoid gate on the shared experts' output.
        self.shared_expert_gate: nn.Linear | None = (
            nn.Linear(dim, 1, bias=False) if cfg.shared_expert_gate else None
        )
        # Where parallelism may transform the layer's input and output (sequence parallelism
        # gathers the sequence and cuts it back: ``moetrain.parallel.tensor_parallel``): hooks
        # on these run however the layer runs, whole (``forward``) or in phases.
        self.input_seam = nn.Identity()
        self.output_seam = nn.Identity()
        # The seam for expert parallelism (``install_dispatcher``).
        self.dispatcher: Dispatcher = LocalDispatcher()
        # Shared experts computed while the dispatcher's all-to-all is in flight.
        self.overlap_shared = False
        # Where this step's tokens are in the run, for layout-independent router jitter
        # (``set_jitter_key``): (seed, optimizer step, this layer, the global index of this
        # rank's first sequence of the step). A tensor, not ints: a compiled layer reads it
        # as an input, where ints would be compiled in as constants and recompiled for every
        # step and every layer.
        self.register_buffer("jitter_key", torch.tensor([0, 0, layer_id, 0]), persistent=False)
        # What training forwards count since the last pop_stats(), the sequence counter too
        # (the next micro-batch's first sequence).
        self.stats = MoEStats(cfg.num_experts, quantile_bins(cfg))
        # The global-batch balancing loss and this step's expert counts.
        self.global_balance = GlobalBalanceLoss(cfg.num_experts, cfg.global_aux_loss_coef)

    @property
    def seq_shard(self) -> SequenceShard | None:
        """Context parallelism: this process's positions of every sequence (the context's)."""
        return self.step_context.seq_shard

    def init_buffers(self) -> None:
        """The jitter key's layer (``moetrain.model.init.init_buffers``; the statistics and
        counts are their own objects')."""
        self.jitter_key.zero_()
        self.jitter_key[2] = self.layer_id

    def keep_counters(self) -> tuple[dict[str, torch.Tensor], float]:
        """What forwards count, as it is now: the statistics (``MoEStats``) and the
        dispatcher's bytes sent; ``restore_counters`` puts it back after forwards that must
        not count (a recompute in backward, the engine's counting pass)."""
        return self.stats.snapshot(), self.dispatcher.bytes_sent

    def restore_counters(self, kept: tuple[dict[str, torch.Tensor], float]) -> None:
        stats, bytes_sent = kept
        self.stats.restore(stats)
        self.dispatcher.bytes_sent = bytes_sent

    def install_dispatcher(self, dispatcher: Dispatcher, overlap_shared: bool = False) -> None:
        """The seam of expert parallelism (``moetrain.parallel.expert_parallel``): the
        dispatcher that moves token rows to the experts and back. ``overlap_shared``: compute
        the shared experts while its all-to-all is in flight (``exchange``; the same
        numbers)."""
        self.dispatcher = dispatcher
        self.overlap_shared = overlap_shared and self.shared_experts is not None

    def set_jitter_key(self, seed: int, step: int, seq_offset: int) -> None:
        """Before a step's forwards: the run's seed, the optimizer step, and the global index
        (in the step's global batch) of this rank's first sequence."""
        # Filled from host scalars: a copy from a host tensor would wait for the device.
        for i, value in enumerate((seed, step, self.layer_id, seq_offset)):
            self.jitter_key[i] = value
        self.stats.rows.zero_()

    def _first_row(self, device: torch.device) -> torch.Tensor:
        """Global index, in the step's global batch, of this forward's first sequence."""
        return (self.jitter_key[3] + self.stats.rows).to(device)

    def _token_coords(self, B: int, S: int, device: torch.device):
        """(sequence index in the step's global batch, position) of each of this forward's
        T tokens: where they are in the run, whatever the layout."""
        first = self._first_row(device)
        seq_T = (first + torch.arange(B, device=device)).repeat_interleave(S)
        if self.seq_shard is not None:  # this process's positions of every sequence
            pos_T = self.seq_shard.positions(device).repeat(B)
        else:
            pos_T = torch.arange(S, device=device).repeat(B)
        return seq_T, pos_T

    def _jitter_at(self, B: int, S: int, device: torch.device):
        if not (self.training and self.cfg.jitter_eps > 0):
            return None
        seq_T, pos_T = self._token_coords(B, S, device)
        return tuple(self.jitter_key[:3].unbind()), seq_T, pos_T

    def _balanced_ids(self, B: int, S: int, device: torch.device) -> torch.Tensor:
        """``moe.force_load_balancing``: token t of the step's global batch (sequence x
        seq_len + position) goes to experts (t K + j) mod E, j < K -- K distinct experts,
        every expert the same share of each sequence's assignments when seq_len K divides
        by E, and the same choice under every layout."""
        seq_T, pos_T = self._token_coords(B, S, device)
        seq_len = self.seq_shard.seq_len if self.seq_shard is not None else S
        K = self.cfg.top_k
        t_T = seq_T * seq_len + pos_T
        return (t_T[:, None] * K + torch.arange(K, device=device)) % self.num_experts

    def token_groups(self, batch: int) -> int:
        n = self.cfg.token_group_seqs
        if n is None:
            return 1
        if batch % n:
            raise ValueError(f"moe.token_group_seqs={n} does not divide the micro-batch of {batch}")
        return batch // n

    def forward(self, x_BSD: torch.Tensor, valid_BS: torch.Tensor | None = None) -> torch.Tensor:
        """``valid_BS``: bool (B, S) over the whole sequences (every position, also under
        context parallelism): False marks tokens left out of the LM loss (padding, a
        document's separator under document masking), which are routed and computed like
        any other but left out of every balancing loss and router statistic. None: all
        count. The three phases back to back; ``moetrain.model.transformer`` interleaves
        two token sets' phases instead (``parallel.ep_overlap=halves``)."""
        p = self.begin(x_BSD, valid_BS)
        self.exchange(p)
        return self.end(p)

    def begin(
        self, x_BSD: torch.Tensor, valid_BS: torch.Tensor | None = None, share: float = 1.0
    ) -> LayerPass:
        """Phase 1 of 3: route the tokens, plan the dispatch and issue the rows. ``share``:
        the fraction of the micro-batch these sequences are (their balancing losses count
        that much of its), when a block cuts it into token sets."""
        x_BSD = self.input_seam(x_BSD)
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        # moe.kernels=auto on CUDA: each op on the implementation measured faster there.
        backend = select_kernels(self.cfg.kernels, x_TD, experts=self.num_experts,
                                 top_k=self.cfg.top_k, ffn=self.cfg.expert_ffn_dim,
                                 score_func=self.cfg.score_func)  # fmt: skip
        valid_T, valid_all_T = self._valid(valid_BS, x_TD.device)

        ctx = self.step_context
        replay_TK = self._replayed(B, S) if self.training and ctx.replay is not None else None
        if self.cfg.force_load_balancing:
            replay_TK = self._balanced_ids(B, S, x_TD.device)
        r = self.router(x_TD, backend, self._jitter_at(B, S, x_TD.device), replay_TK)
        self._record(r.ids_TK, B)
        ids_all_TK, plan = self._plan(r, B)
        # The routed tokens in the compute dtype (moetrain.model.precision): cast once,
        # before the dispatch, so that an expert-parallel all-to-all carries them in it and
        # the experts compute in it. The router above read the fp32 rows.
        xc_TD = as_compute(x_TD)
        flight = self.dispatcher.start_dispatch(xc_TD, plan, backend)
        if self.training or ctx.counting:  # the next token set's sequences start after these
            with torch.no_grad():
                self.stats.rows += B
        return LayerPass((B, S, D), backend, r, plan, ids_all_TK, valid_T, valid_all_T, xc_TD,
                         flight, share)  # fmt: skip

    def exchange(self, p: LayerPass) -> None:
        """Phase 2: receive the rows (the shared experts computed meanwhile when
        ``overlap_shared``: the same numbers), run the experts, issue their outputs back."""
        side = None
        if self.shared_experts is not None and self.overlap_shared:
            side = functools.partial(self._shared, p.xc_TD)
        x_ND, offs_E, p.shared_TD = self.dispatcher.finish_dispatch(p.flight, side)
        self.dispatcher.start_combine(p.flight, self.experts(x_ND, offs_E, p.backend))
        p.received = offs_E[-1].float()

    def end(self, p: LayerPass) -> torch.Tensor:
        """Phase 3: first what does not need the returned rows (the output bias, the shared
        experts unless ``exchange`` computed them, the counts), while the rows travel back;
        then the weighted sum of the returned rows plus those; the balancing losses and
        statistics. Under ``parallel.ep_overlap=halves`` the second half's return is the one
        transfer of a block's forward that nothing else covers, and this work is created
        before its await node, so it runs before its wait in backward too."""
        B, S, D = p.shape
        r, plan = p.r, p.plan
        bias_TD = shared_TD = None
        if self.experts.b2 is not None:  # every expert's, whole, once
            bias_TD = self.experts.output_bias(r.ids_TK, r.weights_TK, plan.dest_TK)
        if self.shared_experts is not None:
            shared_TD = p.shared_TD if p.shared_TD is not None else self._shared(p.xc_TD)
        counts_E = self._counted(r.ids_TK, plan, p.valid_T)
        if self.training:
            self.global_balance.count(counts_E)

        y_TD = self.dispatcher.finish_combine(p.flight, r.weights_TK)
        if bias_TD is not None:
            y_TD = y_TD + bias_TD.to(y_TD.dtype)
        if shared_TD is not None:
            y_TD = y_TD + shared_TD
        if not self.step_context.counting:  # the engine's counting pass: counted, nothing else
            y_TD = self._balance(y_TD, r, plan, B, p.ids_all_TK, counts_E, p.valid_T,
                                 p.valid_all_T, p.received, p.share)  # fmt: skip
        return self.output_seam(y_TD.view(B, S, D))

    def _replayed(self, B: int, S: int) -> torch.Tensor:
        """This forward's (T, K) rows of the step's replayed routing (``StepContext.replay``),
        by the global index of its sequences (and under context parallelism this process's
        positions of them)."""
        replay_GSK = self.step_context.replay[self.layer_id]
        dev = replay_GSK.device
        rows_B = self._first_row(dev) + torch.arange(B, device=dev)
        replay_BSK = replay_GSK.index_select(0, rows_B)
        if self.seq_shard is not None:  # this process's positions of every sequence
            replay_BSK = replay_BSK[:, self.seq_shard.positions(dev)]
        return replay_BSK.reshape(B * S, -1)

    def _record(self, ids_TK: torch.Tensor, B: int) -> None:
        """Write this forward's expert choices where the context asks: a training forward
        into the step's record (its sequences' rows, whole sequences), an eval forward onto
        the eval routing list. The counting pass records nothing."""
        ctx = self.step_context
        if self.training and ctx.record is not None and not ctx.counting:
            record_GSK = ctx.record[self.layer_id]
            dev = record_GSK.device
            rows_B = self._first_row(dev) + torch.arange(B, device=dev)
            record_GSK.index_copy_(0, rows_B, self._whole_sequences(ids_TK, B).to(dev))
        if not self.training and ctx.eval_record is not None:
            ids_BSK = self._whole_sequences(ids_TK.detach(), B)
            ctx.eval_record[self.layer_id].append(ids_BSK.flatten(0, 1).to("cpu", torch.int16))

    def _valid(
        self, valid_BS: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(validity of this process's tokens (T,), of the whole sequences' tokens under
        context parallelism, else None); (None, None) when every token counts."""
        if valid_BS is None:
            return None, None
        valid_BS = valid_BS.to(device, torch.bool)
        if self.seq_shard is None:
            return valid_BS.reshape(-1), None
        return valid_BS[:, self.seq_shard.positions(device)].reshape(-1), valid_BS.reshape(-1)

    def _counted(
        self, ids_TK: torch.Tensor, plan: DispatchPlan, valid_T: torch.Tensor | None
    ) -> torch.Tensor:
        """Assignments per expert of the tokens that count (before dropping)."""
        if valid_T is None:
            return plan.tokens_per_expert_E
        return bin_counts(ids_TK, self.num_experts, valid_T[:, None].expand_as(ids_TK))

    def _whole_sequences(self, ids_TK: torch.Tensor, batch: int) -> torch.Tensor:
        """(batch, S, K) expert ids of the whole sequences: gathered over the processes that
        hold other positions of them (context parallelism), in position order."""
        ids_BsK = ids_TK.view(batch, -1, ids_TK.shape[1])
        return ids_BsK if self.seq_shard is None else self.seq_shard.gather(ids_BsK)

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor:
        assert self.shared_experts is not None
        shared_TD = self.shared_experts(x_TD)
        if self.shared_expert_gate is not None:
            shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
        return shared_TD

    def _plan(self, r: RouteResult, batch: int) -> tuple[torch.Tensor | None, DispatchPlan]:
        """The dispatch plan, and under context parallelism the expert choices of the whole
        sequences (gathered: capacity and the balancing statistics are theirs)."""
        cfg = self.cfg
        scores_TK = r.scores_TE.gather(1, r.ids_TK)
        if self.seq_shard is None:
            return None, plan_dispatch(r.ids_TK, scores_TK, self.num_experts,
                                       self.token_groups(batch), cfg.capacity_factor,
                                       cfg.drop_policy, cfg.pad_to_capacity)
        K = r.ids_TK.shape[1]
        ids_all_TK = self.seq_shard.gather(r.ids_TK.view(batch, -1, K)).reshape(-1, K)
        scores_all_TK = None
        if cfg.capacity_factor is not None and cfg.drop_policy == "probs":
            scores_all_TK = self.seq_shard.gather(
                scores_TK.detach().view(batch, -1, K)).reshape(-1, K)
        plan = plan_dispatch_sharded(
            r.ids_TK, ids_all_TK, scores_all_TK, self.seq_shard.positions(r.ids_TK.device),
            self.num_experts, self.token_groups(batch), cfg.capacity_factor, cfg.drop_policy,
            cfg.pad_to_capacity)
        return ids_all_TK, plan

    def _balance(self, y_TD: torch.Tensor, r: RouteResult, plan: DispatchPlan,
                 batch: int, ids_all_TK: torch.Tensor | None, counts_E: torch.Tensor,
                 valid_T: torch.Tensor | None = None,
                 valid_all_T: torch.Tensor | None = None,
                 received: torch.Tensor | None = None, share: float = 1.0) -> torch.Tensor:
        """Compute the balancing losses, inject their gradient, record their values.
        ``ids_all_TK``: the choices of the whole sequences when this process holds part of
        each (context parallelism): the assignment fractions f count them. ``counts_E``:
        the choices of the tokens that count; ``valid_T`` / ``valid_all_T``: which tokens
        count (``_valid``; None: all); ``received``: the rows this rank's experts received
        (the statistics' ``recv_rows``); ``share``: the fraction of the micro-batch these
        tokens are (``begin``)."""
        cfg = self.cfg
        probs_TE = balance_probs(r.scores_TE, cfg.score_func)
        groups = self.token_groups(batch)
        # Means over valid tokens are taken per token group and averaged over the groups:
        # the same value however the groups are cut into micro-batches.
        w_GT = None if valid_T is None else token_weights(valid_T, groups, valid_all_T)
        values = {
            "aux_loss": (cfg.aux_loss_coef, lambda: load_balancing_loss(
                probs_TE, r.ids_TK, groups, ids_all_TK, valid_T, valid_all_T)),
            "seq_aux_loss": (cfg.seq_aux_loss_coef, lambda: load_balancing_loss(
                probs_TE, r.ids_TK, batch, ids_all_TK, valid_T, valid_all_T)),
            "z_loss": (cfg.z_loss_coef, lambda: z_loss(r.lse_T, w_GT)),
            "entropy": (0.0, lambda: router_entropy(probs_TE, w_GT)),
        }
        mean_probs_E = token_mean(probs_TE, w_GT)
        total = None
        stats = []
        for name in STAT_NAMES:
            coef, fn = values[name]
            track_grad = coef > 0 and torch.is_grad_enabled() and self.training
            with torch.set_grad_enabled(track_grad):
                value = fn()
            if track_grad:
                total = coef * value if total is None else total + coef * value
            stats.append(value.detach().float())
        if cfg.global_aux_loss_coef > 0 and torch.is_grad_enabled() and self.training:
            term = self.global_balance.term(mean_probs_E, counts_E)
            total = term if total is None else total + term
        if total is not None:
            y_TD = AuxLossInjector.apply(y_TD, total, self.step_context.aux_loss_scale * share)
        if self.training:
            with torch.no_grad():
                scores_TE, dropped = r.scores_TE.detach(), plan.dropped
                assignments = torch.full((), float(r.ids_TK.numel()), device=y_TD.device)
                if valid_T is not None:
                    # Left out of the score histogram by a value outside its range (boolean
                    # indexing would size its output on the host).
                    scores_TE = scores_TE.masked_fill(~valid_T[:, None], -1.0)
                    dropped = ((plan.dest_TK < 0) & valid_T[:, None]).sum()
                    assignments = valid_T.sum() * r.ids_TK.shape[1]
                counts = torch.stack([
                    torch.ones((), device=y_TD.device), assignments.float(), dropped.float()])
                qb_hist_EB = None
                if cfg.quantile_balancing:
                    qb_hist_EB = required_bias_histogram(
                        r.scores_TE, self.router.expert_bias, cfg.top_k,
                        cfg.quantile_balancing_bins, valid_T)  # fmt: skip
                self.stats.add(stats, counts_E, counts, scores_TE, mean_probs_E,
                               qb_hist_EB, received)  # fmt: skip
        return y_TD

    @torch.no_grad()
    def pop_stats(self) -> dict[str, torch.Tensor]:
        """Statistics accumulated by training forwards since the last call, then reset
        (``MoEStats.pop``), with the expert bias and the token bytes this rank's dispatcher
        sent to other expert-parallel ranks (``a2a_bytes``, 0 locally).

        Returns sums (divide by ``calls`` for per-micro-batch means), so that the trainer can
        add them across micro-batches and ranks before normalising.
        """
        out = self.stats.pop()
        out["expert_bias"] = self.router.expert_bias.clone()
        out["a2a_bytes"] = torch.full((), self.dispatcher.pop_comm_bytes(),
                                      device=self.stats.sums.device)
        return out

    @torch.no_grad()
    def update_expert_bias(
        self,
        tokens_per_expert_E: torch.Tensor,
        qb_hist_EB: torch.Tensor | None = None,
        assignments: torch.Tensor | None = None,
    ) -> None:
        """The expert bias after an optimizer step, from the step's statistics summed over
        the job. Aux-loss-free balancing (``moe.expert_bias_rate``): raise the bias of
        under-loaded experts and lower that of over-loaded ones by the rate (sign of the
        load error). Quantile balancing (``moe.quantile_balancing``): the bias at which each
        expert would have taken its share of the step's ``assignments`` (``qb_hist_EB``:
        the step's summed counts; ``moetrain.model.quantile_balance``), mixed with the
        previous one by ``moe.quantile_balancing_ema``."""
        cfg, bias_E = self.cfg, self.router.expert_bias
        if cfg.quantile_balancing:
            if qb_hist_EB is None or assignments is None:
                raise ValueError("moe.quantile_balancing: the update needs the step's "
                                 "qb_hist and assignments")  # fmt: skip
            estimate_E = quantile_bias(qb_hist_EB, bias_E, assignments)
            ema = cfg.quantile_balancing_ema
            bias_E.copy_(ema * bias_E.double() + (1.0 - ema) * estimate_E)
        elif cfg.expert_bias_rate > 0:
            load = tokens_per_expert_E.float()
            bias_E += cfg.expert_bias_rate * torch.sign(load.mean() - load)
