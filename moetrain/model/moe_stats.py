"""What an MoE layer's training forwards count, in one object that others read by name.

``MoEStats`` holds every counter a training forward of ``MoELayer`` adds to (a small
``nn.Module`` of non-persistent buffers, so that it follows the layer to its device and
stays out of checkpoints):

    rows               sequences routed this step, counted when a forward routes them (where
                       the next token set starts: router
                       jitter, routing replay and record are keyed by it)
    sums               the balancing losses' and the router entropy's values (``STAT_NAMES``)
    tokens_per_expert  assignments per expert of the tokens that count (before dropping)
    counts             forwards, assignments, dropped assignments (``COUNT_NAMES``)
    score_hist         every router score, binned over [0, 1] (``SCORE_HIST_BINS``)
    probs_sum          sum over forwards of the mean routing probability of each expert
    qb_hist            quantile balancing's counts of the bias each token needed, per expert
                       (E, bins; empty unless ``moe.quantile_balancing``:
                       ``moetrain.model.quantile_balance``)
    recv_rows          rows this rank's experts received and computed (under expert
                       parallelism from every rank of its EP group), summed over forwards
    recv_rows_max      the most of them in one forward: the receive buffer a step needed.
                       A maximum, not a sum (``MAX_NAMES``): ranks combine it with max

The trainer pops them once per step (``MoELayer.pop_stats``: sums, so micro-batches and ranks
add up before dividing; ``moetrain.train.metrics`` turns them into figures). A forward
repeated for another reason must leave them as they were: activation checkpointing's
recompute and the engine's counting pass take a ``snapshot`` and ``restore`` it
(``moetrain.parallel.activation_checkpoint``), field by field as named in ``FIELDS``.

``stat_layout`` is the order a step's statistics travel in, one float64 row per layer
(``pack`` / ``unpack``): what the engine sums over ranks. The ``MAX_NAMES`` travel beside
it, combined with max.
"""

from __future__ import annotations

import torch
from torch import nn

STAT_NAMES = ("aux_loss", "seq_aux_loss", "z_loss", "entropy")
COUNT_NAMES = ("calls", "assignments", "dropped")
MAX_NAMES = ("recv_rows_max",)
"""Statistics ranks, micro-batches and steps combine with max, not by adding."""
SCORE_HIST_BINS = 20
"""Router-score histogram: fixed bins over [0, 1] (softmax and sigmoid scores both lie there)."""


class MoEStats(nn.Module):
    """The counters of one MoE layer's training forwards since the last ``pop`` (module
    doc). ``E``: experts of the layer."""

    FIELDS = ("rows", "sums", "tokens_per_expert", "counts", "score_hist", "probs_sum", "qb_hist",
              "recv_rows", "recv_rows_max")

    def __init__(self, num_experts: int, quantile_bins: int = 0) -> None:
        super().__init__()
        E = num_experts
        self.register_buffer("rows", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("sums", torch.zeros(len(STAT_NAMES)), persistent=False)
        self.register_buffer("tokens_per_expert", torch.zeros(E), persistent=False)
        self.register_buffer("counts", torch.zeros(len(COUNT_NAMES)), persistent=False)
        self.register_buffer("score_hist", torch.zeros(SCORE_HIST_BINS), persistent=False)
        self.register_buffer("probs_sum", torch.zeros(E), persistent=False)
        self.register_buffer("qb_hist", torch.zeros(E, quantile_bins), persistent=False)
        self.register_buffer("recv_rows", torch.zeros(()), persistent=False)
        self.register_buffer("recv_rows_max", torch.zeros(()), persistent=False)

    def init_buffers(self) -> None:
        """Every counter starts at zero (``moetrain.model.init.init_buffers``)."""
        for name in self.FIELDS:
            getattr(self, name).zero_()

    @torch.no_grad()
    def add(
        self,
        values: list[torch.Tensor],
        tokens_per_expert_E: torch.Tensor,
        counts: torch.Tensor,
        scores_TE: torch.Tensor,
        mean_probs_E: torch.Tensor,
        qb_hist_EB: torch.Tensor | None = None,
        received: torch.Tensor | None = None,
    ) -> None:
        """One training forward: its ``STAT_NAMES`` values, the
        assignments per expert of its counted tokens, its (calls, assignments, dropped),
        router scores (an excluded token's at -1, outside the histogram's range), under
        quantile balancing its counts of required biases, and the rows this rank's experts
        received (a device scalar: the last of their group offsets)."""
        self.sums += torch.stack(values)
        self.tokens_per_expert += tokens_per_expert_E.float()
        self.counts += counts
        # All T*E router scores, binned: the TensorBoard score histograms.
        self.score_hist += torch.histc(scores_TE.float(), bins=SCORE_HIST_BINS, min=0.0, max=1.0)
        self.probs_sum += mean_probs_E.detach().float()
        if qb_hist_EB is not None:
            self.qb_hist += qb_hist_EB
        if received is not None:
            self.recv_rows += received
            torch.maximum(self.recv_rows_max, received.float(), out=self.recv_rows_max)

    @torch.no_grad()
    def pop(self) -> dict[str, torch.Tensor]:
        """The sums since the last call (``STAT_NAMES``, ``tokens_per_expert``,
        ``COUNT_NAMES``, ``score_hist``, ``probs_sum``, ``qb_hist``, ``recv_rows``) and
        ``recv_rows_max``, then every counter reset."""
        out = {name: self.sums[i].clone() for i, name in enumerate(STAT_NAMES)}
        out["tokens_per_expert"] = self.tokens_per_expert.clone()
        out.update(zip(COUNT_NAMES, self.counts.clone().unbind(), strict=True))
        out["score_hist"] = self.score_hist.clone()
        out["probs_sum"] = self.probs_sum.clone()
        out["qb_hist"] = self.qb_hist.clone()
        out["recv_rows"] = self.recv_rows.clone()
        out["recv_rows_max"] = self.recv_rows_max.clone()
        self.init_buffers()
        return out

    @torch.no_grad()
    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of every counter, by name (``restore`` puts it back)."""
        return {name: getattr(self, name).clone() for name in self.FIELDS}

    @torch.no_grad()
    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        for name in self.FIELDS:
            getattr(self, name).copy_(saved[name])


def stat_layout(num_experts: int, quantile_bins: int = 0) -> list[tuple[str, int | None]]:
    """(name, width; None for a scalar) of a layer's statistics in one packed row, in order
    (``quantile_bins``: quantile balancing's bins per expert, 0 when it is off). The expert
    bias, a state that every data-parallel rank holds identically, comes last (the engine
    divides that slice by the ranks it summed over)."""
    E = num_experts
    return [
        *((name, None) for name in STAT_NAMES),
        ("tokens_per_expert", E),
        *((name, None) for name in COUNT_NAMES),
        ("a2a_bytes", None),
        ("recv_rows", None),
        ("score_hist", SCORE_HIST_BINS),
        ("probs_sum", E),
        ("qb_hist", E * quantile_bins),
        ("expert_bias", E),
    ]


def pack(stats: dict[str, torch.Tensor], num_experts: int, quantile_bins: int = 0) -> torch.Tensor:
    """One float64 row of ``MoELayer.pop_stats()``'s tensors in ``stat_layout`` order."""
    layout = stat_layout(num_experts, quantile_bins)
    return torch.cat([stats[name].double().reshape(-1) for name, _ in layout])


def unpack(row: torch.Tensor, num_experts: int, quantile_bins: int = 0) -> dict[str, torch.Tensor]:
    """``pack``'s inverse: views of ``row`` by name (``qb_hist`` as (E, bins))."""
    out: dict[str, torch.Tensor] = {}
    start = 0
    for name, width in stat_layout(num_experts, quantile_bins):
        out[name] = row[start] if width is None else row[start : start + width]
        start += 1 if width is None else width
    out["qb_hist"] = out["qb_hist"].view(num_experts, quantile_bins)
    return out


def packed_width(num_experts: int, quantile_bins: int = 0) -> int:
    """Elements of one packed row."""
    return sum(1 if w is None else w for _, w in stat_layout(num_experts, quantile_bins))
