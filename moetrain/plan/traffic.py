"""Bytes one rank sends per step on each parallel axis, and the links they cross.

The volumes are ``moetrain.parallel.accounting.analytic_sent``'s (checked against the bytes
the real collectives send: docs/accounting.md), with the dtypes of the run (bf16 activations
and FSDP2 all-gathers under train.dtype bf16, fp32 gradient reductions) and what that
function leaves out added here:

    dp   non-expert gradients and parameters by ZeRO stage; FSDP2 gathers and reduces once per
         micro-batch (ZeRO-3 gathers twice: forward and backward)
    edp  expert gradients all-reduced over the expert-data-parallel group, 2 Psi_e (n-1)/n
    ep   per MoE layer and micro-batch: T K rows of D out and back in forward, the same
         again in backward, (ep-1)/ep of them to other ranks; again for a recomputed forward
    tp   and under activation checkpointing the recomputed forward's collectives again
    muon the optimizer step's gathers of sharded matrices (``optim.name=muon``: the bytes its
         optimizer states, ``RankState.muon_sent``), on the data-parallel group's link

Links. The rank order is tp fastest, then cp, dp_shard, dp_replicate, pp
(``moetrain.parallel.dims``); an axis group of n ranks at stride st spans st x n consecutive
ranks. Within a node (``gpus_per_node``) it runs on NVLink, otherwise on the network, whose
per-GPU bandwidth then bounds the whole collective (ring algorithms: the slowest link sets
the pace). An EP group that spans nodes sends the share of its rows that leaves the node over
the network, the rest over NVLink.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.config import JobConfig
from moetrain.parallel.accounting.analytic import analytic_sent
from moetrain.parallel.dims import ParallelDims
from moetrain.plan.activations import Shapes, rows
from moetrain.plan.build import RankState


@dataclass
class Axis:
    name: str
    bytes: float
    """Bytes this rank sends per step on the axis."""
    group: int
    stride: int
    nodes: int
    """Nodes one group of the axis spans (1: NVLink only)."""
    inter_fraction: float
    """Share of the bytes that crosses the network."""


def _span(stride: int, size: int, gpus_per_node: int) -> tuple[int, float]:
    """(nodes one group spans, the share of a ring's or an all-to-all's traffic that leaves
    the node)."""
    if size <= 1:
        return 1, 0.0
    span = stride * size
    nodes = max(-(-span // gpus_per_node), 1)
    if nodes == 1:
        return 1, 0.0
    per_node = max(size // nodes, 1)
    return nodes, (size - per_node) / (size - 1)


def traffic(
    cfg: JobConfig,
    dims: ParallelDims,
    state: RankState,
    sh: Shapes,
    dtype: torch.dtype,
    gpus_per_node: int,
) -> list[Axis]:
    """This rank's bytes per step on every axis it talks on."""
    counts = {"dense": 0, "moe": 0, "boundary": 0}
    for chunk in state.chunks:
        for layer in chunk.layers:
            counts["moe" if layer.moe else "dense"] += 1
        counts["boundary"] += chunk.embedding + chunk.output
    e = sh.e
    p = cfg.parallel
    m = dims.microbatches(cfg)
    ac = p.activation_checkpointing
    out: list[Axis] = []
    tp, cp = dims.tp, dims.cp
    # Strides of the rank order (pp, dp_replicate, dp_shard, cp, tp), tp fastest.
    st_cp, st_shard, st_pp = tp, tp * cp, dims.world_size // dims.pp

    def add(name: str, volume: float, group: int, stride: int) -> None:
        if volume <= 0 or group <= 1:
            return
        nodes, inter = _span(stride, group, gpus_per_node)
        out.append(Axis(name, volume, group, stride, nodes, inter))

    # data parallel: the non-expert gradients (fp32) and, by ZeRO stage, the parameters
    psi_n = (state.param_elements - state.expert_elements) * 4
    d, n, r = dims.dp_cp, dims.dp_shard * cp, dims.dp_replicate
    zero = p.zero_stage if d > 1 else 0
    gather = (dtype.itemsize if dtype != torch.float32 else 4) / 4  # FSDP2 gathers in bf16
    if d > 1:
        if zero == 0:
            dp = 2 * psi_n * (d - 1) / d
        elif zero == 1:
            dp = 2 * psi_n * (n - 1) / n
        else:  # FSDP2: per micro-batch, reduce-scatter fp32 + all-gather(s) in param dtype
            gathers = 2 if zero == 3 else 1
            dp = m * psi_n * (n - 1) / n * (1 + gathers * gather)
        if r > 1 and zero > 0:
            dp += 2 * (psi_n / n) * (r - 1) / r
        add("dp", dp, n if zero > 0 else d, st_cp if cp > 1 else st_shard)
    # Muon: sharded matrices gathered whole for Newton-Schulz in the optimizer step, over
    # the data-parallel shards (ZeRO-1/2/3) and tp: priced on the data-parallel group's link
    # when the matrices are sharded over it (the wider of the two), else tp's
    if state.muon_sent:
        if zero > 0 and n > 1:
            add("muon", state.muon_sent, n, st_cp if cp > 1 else st_shard)
        else:
            add("muon", state.muon_sent, tp, 1)
    # expert-data parallel: the experts' gradients, all-reduced over edp
    if dims.ep > 1 and state.expert_elements:
        edp = dims.dp_cp // dims.ep
        psi_e = state.expert_elements * 4
        add("edp", 2 * psi_e * (edp - 1) / edp, edp, st_cp * dims.ep)
    sent = analytic_sent(cfg, dims, state.param_elements, counts, bytes_per_elem=e)
    if "tp" in sent:
        tp_bytes = sent["tp"]
        if ac == "full":  # the recomputed forward's collectives: half of a layer's
            tp_bytes *= 1.5
        add("tp", tp_bytes, tp, 1)
    if "cp" in sent:
        add("cp", sent["cp"], cp, st_cp)
    if "pp_all_ranks" in sent:
        add("pp", sent["pp_all_ranks"] / dims.pp, dims.pp, st_pp)
    if dims.ep > 1 and counts["moe"]:
        fwd_passes = 2 if ac == "full" else 1
        per_layer = rows(cfg, sh) * cfg.model.dim * e * (dims.ep - 1) / dims.ep
        # dispatch + combine, forward (and recomputed forward) and backward
        ep_bytes = m * counts["moe"] * per_layer * 2 * (fwd_passes + 1)
        add("ep", ep_bytes, dims.ep, st_cp)
    return out
