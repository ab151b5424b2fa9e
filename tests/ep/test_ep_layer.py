"""An MoE layer under expert parallelism reproduces the single-process layer.

Every rank holds a slice of one global batch; the reference layer sees the whole batch in
one process. Compared: the layer output, the input gradient, the gradient of every
parameter (expert gradients after the expert-data-parallel reduction, the others after a
plain data-parallel mean), token and drop counts, the balancing losses, and the all-to-all
bytes against a count of the rows routed off-rank made from the routing ids alone (not from
the dispatcher's plan). Dropless, capacity and padded plans; all-to-all and all-gather
dispatchers; maximal skew (every token picks the same experts).

Tolerance: fp32, atol 1e-5, rtol 1e-4 (the table of tests/model); counts and bytes exact.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks

from moetrain.config import ConfigError, MoEConfig
from moetrain.model.moe import MoELayer
from moetrain.parallel.expert_parallel import (
    apply_ep,
    check_ep_layout,
    reduce_expert_grads,
)

ATOL, RTOL = 1e-5, 1e-4
DIM, SEQ, SEQS_PER_RANK, E, K = 64, 32, 2, 8, 2

MODES = {
    "dropless": dict(capacity_factor=None),
    "capacity": dict(capacity_factor=1.0),
    "padded": dict(capacity_factor=1.25, pad_to_capacity=True),
}


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(
        got.double(), want.double(), atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}"
    )


def _cfg(mode: str) -> MoEConfig:
    return MoEConfig(
        num_experts=E,
        top_k=K,
        expert_ffn_dim=32,
        num_shared_experts=1,
        token_group_seqs=1,
        aux_loss_coef=0.01,
        seq_aux_loss_coef=0.003,
        z_loss_coef=0.001,
        kernels="torch",
        **MODES[mode],
    )


def _kept_rows(ref: MoELayer, x_TD: torch.Tensor, ws: int) -> tuple[torch.Tensor, int]:
    """kept_PE[p, e]: the rows source rank p keeps for expert e, counted from the routing ids
    of the global batch alone, independently of the dispatcher and its plan (the ids come
    from the gate's float64 softmax top-k, capacity from its definition,
    ``ceil(capacity_factor * group_tokens * top_k / E)`` per expert and token group); and
    the slots one expert's segment travels in (its capacity in every group, at most a row a
    token; 0 dropless)."""
    T = SEQ * SEQS_PER_RANK
    cfg = ref.cfg
    with torch.no_grad():
        logits_TE = x_TD.double() @ ref.router.gate.weight.double().T
        ids_TK = logits_TE.softmax(-1).topk(K, dim=-1).indices
    # count_PGE[p, g, e]: assignments of source rank p's token group g (one sequence each,
    # token_group_seqs=1) to expert e.
    count_PGE = torch.zeros(ws, SEQS_PER_RANK, E, dtype=torch.int64)
    for t, experts in enumerate(ids_TK.tolist()):
        p, g = divmod(t // SEQ, SEQS_PER_RANK)
        for e in experts:
            count_PGE[p, g, e] += 1
    if cfg.capacity_factor is None:  # dropless: every assignment is kept
        return count_PGE.sum(1), 0
    capacity = math.ceil(cfg.capacity_factor * SEQ * K / E)
    slots = min(SEQS_PER_RANK * capacity, T)
    if cfg.pad_to_capacity:  # every (group, expert) block full, padding included
        return torch.full((ws, E), SEQS_PER_RANK * capacity), slots
    return count_PGE.clamp(max=capacity).sum(1), slots


def _predicted_bytes(
    ref: MoELayer, x_TD: torch.Tensor, ws: int, rank: int, mode: str, dispatcher: str
) -> int:
    """Token bytes this rank sends to other ranks (dispatch + combine), from ``_kept_rows``.
    With a capacity factor every expert's segment is sent in as many rows as it can hold,
    whatever was kept (static split sizes)."""
    T = SEQ * SEQS_PER_RANK
    row = DIM * 4
    if dispatcher == "all_gather":
        return 2 * (ws - 1) * T * row
    kept_PE, slots = _kept_rows(ref, x_TD, ws)
    if slots:
        kept_PE = torch.full((ws, E), slots)
    owner_E = torch.arange(E) // (E // ws)
    sent = kept_PE[rank][owner_E != rank].sum()  # dispatch: my rows for others' experts
    returned = kept_PE[:, owner_E == rank].sum() - kept_PE[rank, owner_E == rank].sum()
    return int(sent + returned) * row


def _predicted_received(ref: MoELayer, x_TD: torch.Tensor, ws: int, rank: int) -> int:
    """Rows this rank's experts receive from every rank, padding of a padded plan included
    (``recv_rows``)."""
    kept_PE, _ = _kept_rows(ref, x_TD, ws)
    return int(kept_PE[:, torch.arange(E) // (E // ws) == rank].sum())


def _check_case(
    rank: int, ws: int, mode: str, dispatcher: str, skew: bool, dp_group=None, etp_mesh=None
) -> None:
    """``rank``/``ws``: data-parallel rank and size (= EP here: edp 1); ``dp_group`` (default
    the world) is also the EP group; ``etp_mesh``: split the experts' FFN over it too."""
    dp_group = dp_group or dist.group.WORLD
    etp = f" etp={etp_mesh.size()}" if etp_mesh is not None else ""
    what = f"ep={ws}{etp} {mode} {dispatcher}{' skew' if skew else ''} dp rank {rank}"
    torch.manual_seed(0)
    ref = MoELayer(DIM, _cfg(mode))
    gen = torch.Generator().manual_seed(1)
    x_global = torch.randn(ws * SEQS_PER_RANK, SEQ, DIM, generator=gen)
    c_global = torch.randn(ws * SEQS_PER_RANK, SEQ, DIM, generator=gen)
    if skew:  # every token's top-2 is experts (0, 1): all rows go to EP rank 0
        with torch.no_grad():
            ref.router.gate.weight.zero_()
            ref.router.gate.weight[0, 0], ref.router.gate.weight[1, 0] = 20.0, 10.0
        x_global[..., 0] = x_global[..., 0].abs() + 1.0
    layer = copy.deepcopy(ref)
    ref.train()
    layer.train()

    # Reference: the whole global batch, loss = mean over tokens of <y, c>.
    x_ref = x_global.clone().requires_grad_()
    y_ref = ref(x_ref)
    ((y_ref * c_global).sum() / y_ref[..., 0].numel()).backward()

    expert_params = apply_ep(layer, dp_group, dispatcher, etp_mesh=etp_mesh)
    sl = slice(rank * SEQS_PER_RANK, (rank + 1) * SEQS_PER_RANK)
    x = x_global[sl].clone().requires_grad_()
    y = layer(x)
    ((y * c_global[sl]).sum() / y[..., 0].numel()).backward()
    experts = {id(p) for p in expert_params}
    for p in layer.parameters():  # the data-parallel mean of the non-expert gradients
        if id(p) not in experts:
            dist.all_reduce(p.grad, group=dp_group)
            p.grad.div_(ws)
    reduce_expert_grads(expert_params, None, ws)

    _close(y, y_ref[sl], f"{what} output")
    _close(x.grad / ws, x_ref.grad[sl], f"{what} input grad")  # local loss = ws * share
    L = E // ws
    tp, tp_rank = (etp_mesh.size(), etp_mesh.get_local_rank()) if etp_mesh else (1, 0)
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        want = ref_params[name].grad
        if id(p) in experts:
            assert p.shape[0] == L, f"{what}: {name} holds {p.shape[0]} experts, not {L}"
            want = want[rank * L : (rank + 1) * L]
            f_dim = 1 if name.endswith("w2") else 2
            want = want.chunk(tp, f_dim)[tp_rank]
        _close(p.grad, want, f"{what} grad {name}")

    stats, ref_stats = layer.pop_stats(), ref.pop_stats()
    for key in ("tokens_per_expert", "dropped", "assignments"):  # sums over ranks, exact
        total = stats[key].clone()
        dist.all_reduce(total, group=dp_group)
        assert torch.equal(total, ref_stats[key]), f"{what} {key}: {total} vs {ref_stats[key]}"
    for key in ("aux_loss", "seq_aux_loss", "z_loss", "entropy"):  # means over ranks
        mean = stats[key].clone()
        dist.all_reduce(mean, group=dp_group)
        _close(mean / ws, ref_stats[key], f"{what} {key}")
    if skew and mode != "dropless":
        assert float(ref_stats["dropped"]) > 0, f"{what}: the skewed batch should drop"
    want_bytes = _predicted_bytes(ref, x_global.view(-1, DIM), ws, rank, mode, dispatcher)
    assert float(stats["a2a_bytes"]) == want_bytes, (
        f"{what} a2a bytes {float(stats['a2a_bytes'])} vs predicted {want_bytes}"
    )
    want_rows = _predicted_received(ref, x_global.view(-1, DIM), ws, rank)
    got = (float(stats["recv_rows"]), float(stats["recv_rows_max"]))
    assert got == (want_rows, want_rows), f"{what} rows received {got} vs {want_rows}"
    # A second forward/backward pair still works (no stale dispatcher state).
    layer(x_global[sl]).sum().backward()


def _layer_worker(rank: int, world_size: int, cases: list[tuple[str, str, bool]]) -> int:
    for mode, dispatcher, skew in cases:
        _check_case(rank, world_size, mode, dispatcher, skew)
    return len(cases)


CASES = [
    *[(mode, d, False) for mode in MODES for d in ("all_to_all", "all_gather")],
    ("dropless", "all_to_all", True),
    ("capacity", "all_to_all", True),
    ("padded", "all_to_all", True),
    ("dropless", "all_gather", True),
]


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ep", [2, 4])
def test_ep_layer_matches_single_process(ep: int) -> None:
    assert run_ranks(_layer_worker, ep, CASES, timeout=240) == [len(CASES)] * ep


def _etp_worker(rank: int, world_size: int, expert_tp: bool) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    # ep=2 x tp=2: tp ranks see the same tokens; experts replicated over tp or split (ETP).
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    ep_mesh = mesh["ep"]
    cases = [("capacity", "all_to_all", False), ("dropless", "all_gather", False)]
    for mode, dispatcher, skew in cases:
        _check_case(
            ep_mesh.get_local_rank(),
            2,
            mode,
            dispatcher,
            skew,
            dp_group=ep_mesh.get_group(),
            etp_mesh=mesh["tp"] if expert_tp else None,
        )
    return len(cases)


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("expert_tp", [False, True], ids=["tp2-replicated", "tp2-etp"])
def test_ep_layer_with_tensor_parallel_ranks(expert_tp: bool) -> None:
    assert run_ranks(_etp_worker, 4, expert_tp, timeout=240) == [2] * 4


def test_check_ep_layout_names_the_keys() -> None:
    check_ep_layout(num_experts=8, ep=4, dp=8)
    check_ep_layout(num_experts=0, ep=1, dp=3)
    with pytest.raises(ConfigError, match=r"parallel\.ep.*moe\.num_experts=6"):
        check_ep_layout(num_experts=6, ep=4, dp=8)
    with pytest.raises(ConfigError, match=r"parallel\.ep.*data-parallel size 6.*dp_shard"):
        check_ep_layout(num_experts=8, ep=4, dp=6)
    with pytest.raises(ConfigError, match=r"parallel\.ep.*moe\.num_experts is 0"):
        check_ep_layout(num_experts=0, ep=2, dp=2)
