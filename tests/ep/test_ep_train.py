"""Training under expert parallelism reproduces single-process training.

A micro MoE transformer trains three AdamW steps on one global batch of 16 sequences. The
reference takes each step in one process as a single micro-batch; the layout under test
splits the batch over data-parallel ranks (ep of them per EP group, dp / ep expert-data-
parallel replicas) and two micro-batches per rank. Non-expert gradients are averaged over
dp, expert gradients reduced over edp and scaled by 1 / dp (``reduce_expert_grads``), the
clipping norm covers every expert once (``expert_grad_sq_norm``), the expert bias moves by
the global token counts. Compared per step: loss, gradient norm, aux / seq-aux / z losses,
tokens per expert and drops; at the end every parameter (experts gathered over EP) and the
expert bias.

Tolerance: fp32, atol 1e-5, rtol 1e-4 for values (parameters after three AdamW steps);
counts exact. This file uses a minimal data-parallel loop of its own, so that it checks EP
independently of the trainer engine; the engine's compositions (TP, PP, ZeRO) are checked
through ``micro_run`` in tests/ep/test_ep_layouts.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from divergence import Divergences
from multirank import run_ranks

from moetrain.config import ModelConfig, MoEConfig
from moetrain.model import build_model
from moetrain.parallel.expert_parallel import (
    apply_ep,
    build_ep_meshes,
    ep_expert_params,
    expert_grad_sq_norm,
    gather_experts,
    reduce_expert_grads,
)

ATOL, RTOL = 1e-5, 1e-4
STEPS, GLOBAL_SEQS, SEQ, VOCAB, MB_SEQS = 3, 16, 32, 128, 2
STAT_MEANS = ("aux_loss", "seq_aux_loss", "z_loss")
STAT_SUMS = ("tokens_per_expert", "dropped", "assignments")

MODES = {
    "dropless": dict(capacity_factor=None),
    "capacity": dict(capacity_factor=1.0),
    "padded": dict(capacity_factor=1.0, pad_to_capacity=True),
}


def _model(mode: str):
    mcfg = ModelConfig(
        vocab_size=VOCAB,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        max_seq_len=SEQ,
        tie_embeddings=False,
    )
    moe = MoEConfig(
        num_experts=8,
        top_k=2,
        expert_ffn_dim=32,
        num_shared_experts=1,
        token_group_seqs=MB_SEQS,
        aux_loss_coef=0.01,
        seq_aux_loss_coef=0.003,
        z_loss_coef=0.001,
        expert_bias_rate=0.01,
        kernels="torch",
        **MODES[mode],
    )
    return build_model(mcfg, moe, seed=0)


def _tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_SEQS, SEQ + 1), generator=gen)


def _train(model, seqs: slice, dp: int, ep_mesh=None, edp_mesh=None) -> dict:
    """STEPS steps on ``tokens[:, seqs]`` in micro-batches of MB_SEQS; returns what the
    global-batch view of the run is (means / sums over the dp ranks)."""
    tokens = _tokens()[:, seqs]
    n_mb = tokens.shape[1] // MB_SEQS
    model.step_context.aux_loss_scale = 1.0 / n_mb
    experts = ep_expert_params(model) if ep_mesh is not None else []
    expert_ids = {id(e) for e in experts}
    others = [p for p in model.parameters() if id(p) not in expert_ids]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    out: dict = {"loss": [], "grad_norm": [], "stats": []}

    def dp_sum(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        if dp > 1:
            dist.all_reduce(t)
        return t

    for step in range(STEPS):
        loss_sum = torch.zeros(())
        for mb in tokens[step].split(MB_SEQS):
            logits = model(mb[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten())
            (loss / n_mb).backward()
            loss_sum += loss.detach() / n_mb
        if dp > 1:
            for p in others:
                dist.all_reduce(p.grad)
                p.grad.div_(dp)
        reduce_expert_grads(experts, edp_mesh, dp)
        sq = sum(p.grad.pow(2).sum() for p in others)
        sq = sq + (expert_grad_sq_norm(experts, ep_mesh) if experts else 0.0)
        norm = math.sqrt(float(sq))
        for p in model.parameters():
            p.grad.mul_(min(1.0, 1.0 / (norm + 1e-6)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = {}
        for i, layer in model.moe_layers().items():
            s = layer.pop_stats()
            counts = dp_sum(s["tokens_per_expert"])
            layer.update_expert_bias(counts)  # global counts: the same bias on every rank
            stats[i] = {k: dp_sum(s[k]) for k in STAT_SUMS}
            stats[i].update({k: dp_sum(s[k] / s["calls"]) / dp for k in STAT_MEANS})
            stats[i]["a2a_bytes"] = dp_sum(s["a2a_bytes"])
        out["loss"].append(float(dp_sum(loss_sum)) / dp)
        out["grad_norm"].append(norm)
        out["stats"].append(stats)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if ep_mesh is not None:
        params.update(gather_experts(model, ep_mesh))
    out["params"] = params
    out["bias"] = {i: layer.router.expert_bias.clone() for i, layer in model.moe_layers().items()}
    return out


def _compare(got: dict, ref: dict, what: str) -> None:
    """Every parameter, the expert bias, the statistics and the losses; the message lists
    every diverging tensor, grouped by kind, worst first, with its first diverging step
    (tests/divergence.py) -- a routing bug reads as the router's tensors, not as the loss."""
    found = Divergences(what)
    missing = sorted(set(ref["params"]) ^ set(got["params"]))
    assert not missing, f"{what}: parameters {missing} in one run only"
    for name, want in ref["params"].items():
        found.check_close(name, f"param[{name}]", None, got["params"][name], want, ATOL, RTOL,
                          "param")  # fmt: skip
    for layer, want in ref["bias"].items():
        name = f"layers.{layer}.ffn.router.expert_bias"
        found.check_close(name, f"expert bias[{name}]", None, got["bias"][layer], want, ATOL,
                          RTOL, "param")  # fmt: skip
    for step, (g, r) in enumerate(zip(got["stats"], ref["stats"], strict=True)):
        for layer in r:
            for key in (*STAT_SUMS, *STAT_MEANS):
                exact = key in STAT_SUMS  # counts: equal
                found.check_close(f"moe.{key} layer {layer}", f"moe.{key}[step {step}]", step,
                                  g[layer][key], r[layer][key], 0.0 if exact else ATOL,
                                  0.0 if exact else RTOL)  # fmt: skip
    for key in ("loss", "grad_norm"):
        for step, (a, b) in enumerate(zip(got[key], ref[key], strict=True)):
            found.check_close(key, f"{key}[step {step}]", step, a, b, ATOL, RTOL)
    assert not found, found.message()


def _worker(rank: int, world_size: int, ep: int, variants: list[tuple[str, str]]) -> dict:
    ep_mesh, edp_mesh = build_ep_meshes(1, world_size, 1, ep)
    per_rank = GLOBAL_SEQS // world_size
    bytes_by_variant = {}
    for dispatcher, mode in variants:
        what = f"dp={world_size} ep={ep} {dispatcher} {mode} rank {rank}"
        ref_model = _model(mode)
        model = copy.deepcopy(ref_model)
        ref = _train(ref_model, slice(None), dp=1)
        apply_ep(model, ep_mesh, dispatcher)
        got = _train(
            model, slice(rank * per_rank, (rank + 1) * per_rank), world_size, ep_mesh, edp_mesh
        )
        _compare(got, ref, what)
        bytes_by_variant[f"{dispatcher}/{mode}"] = float(got["stats"][0][1]["a2a_bytes"])
        assert bytes_by_variant[f"{dispatcher}/{mode}"] > 0, f"{what}: no all-to-all traffic"
    return bytes_by_variant


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world_size, ep, variants",
    [
        (2, 2, [("all_to_all", "capacity"), ("all_gather", "dropless")]),
        (4, 2, [("all_to_all", "dropless")]),  # two expert-data-parallel replicas
        (4, 4, [("all_to_all", "capacity"), ("all_to_all", "padded")]),
    ],
    ids=["dp2-ep2", "dp4-ep2", "dp4-ep4"],
)
def test_ep_training_matches_single_process(world_size, ep, variants) -> None:
    results = run_ranks(_worker, world_size, ep, variants, timeout=280)
    assert len(results) == world_size


def test_a_difference_is_reported_by_tensor_not_as_the_loss() -> None:
    """``_compare`` names every diverging tensor, worst first: a changed router and its
    statistics read as the router, the loss that moved with them comes after."""
    stats = {k: torch.tensor([3.0, 5.0]) for k in (*STAT_SUMS, *STAT_MEANS)}
    ref = {
        "params": {"layers.0.ffn.router.gate.weight": torch.ones(4, 8),
                   "tok_embeddings.weight": torch.ones(16, 8)},
        "bias": {0: torch.zeros(4)},
        "stats": [{0: stats}],
        "loss": [2.0],
        "grad_norm": [1.0],
    }  # fmt: skip
    got = copy.deepcopy(ref)
    got["params"]["layers.0.ffn.router.gate.weight"][1, 2] = 1.5
    got["stats"][0][0]["tokens_per_expert"] = torch.tensor([4.0, 4.0])
    got["loss"] = [2.01]
    with pytest.raises(AssertionError) as info:
        _compare(got, ref, "planted")
    message = str(info.value)
    assert message.index("router (2 tensors") < message.index("values (1 tensor"), message
    assert "layers.0.ffn.router.gate.weight: diverges (param)" in message
    assert "moe.tokens_per_expert layer 0: first diverges at step 0" in message
    assert "tok_embeddings" not in message
