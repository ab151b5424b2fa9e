"""Capacity, drop priority and buffer layout of ``plan_dispatch`` on hand-built assignments.

Expected rows are written out by hand from the documented layout: expert-major, then token
group, then priority within (expert, group); padded buffers put assignment ``pos`` of
(expert e, group g) at row e*G*cap + g*cap + pos.
"""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.config import MoEConfig
from moetrain.model.dispatch import expert_capacity, plan_dispatch
from moetrain.model.moe import MoELayer


@pytest.mark.parametrize(
    ("group_tokens", "top_k", "num_experts", "capacity_factor", "expected"),
    [
        (8, 2, 4, 1.0, 4),  # 8*2/4 = 4
        (8, 2, 4, 1.25, 5),  # 1.25*4 = 5 exactly: no round-up
        (10, 1, 4, 1.0, 3),  # 2.5 -> 3
        (16, 2, 8, 1.5, 6),  # 1.5*4 = 6
        (6, 2, 4, 0.5, 2),  # 1.5 -> 2
        (7, 2, 4, 0.75, 3),  # 2.625 -> 3
        (12, 1, 3, 2.0, 8),  # 2*4 = 8
        (3, 1, 8, 1.0, 1),  # 0.375 -> 1
        (1, 1, 8, 0.5, 1),  # 0.0625 -> 1 (and never below 1)
    ],
)
def test_expert_capacity_table(group_tokens, top_k, num_experts, capacity_factor, expected):
    assert expert_capacity(group_tokens, top_k, num_experts, capacity_factor) == expected


# Two choices per token, two experts, every token uses both: each expert sees all 4 tokens.
# capacity = ceil(0.5 * 4 * 2 / 2) = 2, so each expert keeps 2 of its 4 assignments.
IDS_TK = [[0, 1], [1, 0], [0, 1], [1, 0]]
SCORES_TK = [[0.6, 0.4], [0.7, 0.3], [0.55, 0.45], [0.9, 0.1]]


@pytest.mark.parametrize(
    ("drop_policy", "expected_dest_TK"),
    [
        # expert 0 scores: t0 .6, t1 .3, t2 .55, t3 .1 -> keeps t0 (row 0), t2 (row 1)
        # expert 1 scores: t0 .4, t1 .7, t2 .45, t3 .9 -> keeps t3 (row 2), t1 (row 3)
        ("probs", [[0, -1], [3, -1], [1, -1], [2, -1]]),
        # earliest tokens: expert 0 keeps t0, t1; expert 1 keeps t0, t1
        ("position", [[0, 2], [3, 1], [-1, -1], [-1, -1]]),
    ],
)
def test_drop_policy_keeps_the_right_assignments(drop_policy, expected_dest_TK):
    plan = plan_dispatch(
        torch.tensor(IDS_TK),
        torch.tensor(SCORES_TK),
        num_experts=2,
        num_groups=1,
        capacity_factor=0.5,
        drop_policy=drop_policy,
    )
    assert plan.capacity == 2
    assert plan.dest_TK.tolist() == expected_dest_TK
    assert plan.offs_E.dtype == torch.int32
    assert plan.offs_E.tolist() == [2, 4]
    assert plan.num_rows == 8
    assert int(plan.dropped) == 4
    # Counted before dropping.
    assert plan.tokens_per_expert_E.tolist() == [4, 4]


# 8 tokens in 2 groups of 4, top-1, 2 experts, capacity_factor 1: cap = ceil(4 / 2) = 2.
# Group 0 sends 3 tokens to expert 0 (overflow); group 1 sends 2 to each (no overflow).
# A batch-wide capacity (ceil(8 / 2) = 4) would instead drop the lowest of expert 0's five
# assignments, token 4 (score 0.1), rather than token 1: the two layouts are told apart.
GROUP_IDS_TK = [[0], [0], [0], [1], [0], [1], [1], [0]]
GROUP_SCORES_TK = [[0.5], [0.2], [0.9], [0.6], [0.1], [0.3], [0.4], [0.8]]


def test_capacity_is_per_token_group():
    plan = plan_dispatch(
        torch.tensor(GROUP_IDS_TK),
        torch.tensor(GROUP_SCORES_TK),
        num_experts=2,
        num_groups=2,
        capacity_factor=1.0,
    )
    assert plan.capacity == 2
    # expert 0: group 0 t2 (0.9) row 0, t0 (0.5) row 1, t1 dropped; group 1 t7 row 2, t4 row 3
    # expert 1: group 0 t3 row 4; group 1 t6 (0.4) row 5, t5 (0.3) row 6
    assert plan.dest_TK.flatten().tolist() == [1, -1, 0, 4, 3, 6, 5, 2]
    assert plan.offs_E.tolist() == [4, 7]
    assert plan.num_rows == 8
    assert int(plan.dropped) == 1


def test_batch_wide_capacity_differs_from_per_group():
    plan = plan_dispatch(
        torch.tensor(GROUP_IDS_TK),
        torch.tensor(GROUP_SCORES_TK),
        num_experts=2,
        num_groups=1,
        capacity_factor=1.0,
    )
    assert plan.capacity == 4
    dropped_T = (plan.dest_TK.flatten() < 0).nonzero().flatten().tolist()
    assert dropped_T == [4]


def test_pad_to_capacity_rows():
    plan = plan_dispatch(
        torch.tensor(GROUP_IDS_TK),
        torch.tensor(GROUP_SCORES_TK),
        num_experts=2,
        num_groups=2,
        capacity_factor=1.0,
        pad_to_capacity=True,
    )
    cap, G = 2, 2
    # (expert, group, pos) of every token, from the scores above; t1 is dropped.
    where = {
        0: (0, 0, 1),
        2: (0, 0, 0),
        3: (1, 0, 0),
        4: (0, 1, 1),
        5: (1, 1, 1),
        6: (1, 1, 0),
        7: (0, 1, 0),
    }
    expected = [-1] * 8
    for t, (e, g, pos) in where.items():
        expected[t] = e * G * cap + g * cap + pos
    assert expected == [1, -1, 0, 4, 3, 7, 6, 2]
    assert plan.dest_TK.flatten().tolist() == expected
    assert plan.offs_E.dtype == torch.int32
    assert plan.offs_E.tolist() == [4, 8]  # multiples of G*cap
    assert plan.num_rows == 2 * G * cap
    assert int(plan.dropped) == 1


def test_pad_to_capacity_num_rows_is_static():
    # The buffer size depends on shapes and the capacity factor only, never on the routing.
    ids_a = torch.zeros(12, 2, dtype=torch.int64)
    ids_a[:, 1] = 1
    ids_b = torch.stack([torch.arange(12) % 3, (torch.arange(12) + 1) % 3], 1)
    scores = torch.rand(12, 2)
    rows = {
        plan_dispatch(ids, scores, 3, 2, 1.0, pad_to_capacity=True).num_rows
        for ids in (ids_a, ids_b)
    }
    # cap = ceil(1.0 * 6 * 2 / 3) = 4 -> 3 experts * 2 groups * 4 rows
    assert rows == {24}


def test_dropless_keeps_everything_in_position_order():
    ids_TK = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2], [1, 0]])
    plan = plan_dispatch(
        ids_TK, torch.rand(5, 2), num_experts=4, num_groups=1, capacity_factor=None
    )
    assert plan.capacity is None
    assert int(plan.dropped) == 0
    assert plan.num_rows == 10
    # counts per expert: 0 -> 4, 1 -> 3, 2 -> 3, 3 -> 0
    assert plan.tokens_per_expert_E.tolist() == [4, 3, 3, 0]
    assert plan.offs_E.dtype == torch.int32
    assert plan.offs_E.tolist() == [4, 7, 10, 10]
    # expert 0 rows 0-3: t0, t1, t3, t4; expert 1 rows 4-6: t1, t2, t4; expert 2 rows 7-9: t0,
    # t2, t3 -- within an expert, tokens in position order.
    assert plan.dest_TK.tolist() == [[7, 0], [1, 4], [8, 5], [2, 9], [6, 3]]


# ------------------------------------------------------------------------ randomised invariants


def kept_reference(ids_TK, scores_TK, num_experts, num_groups, cap, drop_policy):
    """Which assignments survive, from the definition: per group and expert, the top-cap by
    score ("probs") or the earliest tokens ("position")."""
    T, K = ids_TK.shape
    per_group = T // num_groups
    keep = torch.zeros(T, K, dtype=torch.bool)
    for g in range(num_groups):
        for e in range(num_experts):
            cands = [
                (t, k)
                for t in range(g * per_group, (g + 1) * per_group)
                for k in range(K)
                if ids_TK[t, k] == e
            ]
            if drop_policy == "probs":
                cands.sort(key=lambda tk: -float(scores_TK[tk]))
            for t, k in cands[:cap]:
                keep[t, k] = True
    return keep


@pytest.mark.parametrize("num_groups", [1, 2, 3])
@pytest.mark.parametrize(
    ("capacity_factor", "drop_policy", "pad"),
    [
        (None, "probs", False),
        (0.75, "probs", False),
        (0.75, "position", False),
        (1.0, "probs", True),
        (0.5, "position", True),
    ],
)
def test_plan_invariants(num_groups, capacity_factor, drop_policy, pad):
    T, K, E = 12, 2, 4
    gen = torch.Generator().manual_seed(num_groups)
    ids_TK = torch.rand(T, E, generator=gen).topk(K, dim=1).indices  # distinct per token
    scores_TK = torch.rand(T, K, generator=gen)

    plan = plan_dispatch(ids_TK, scores_TK, E, num_groups, capacity_factor, drop_policy, pad)

    if capacity_factor is None:
        cap = None
        keep_TK = torch.ones(T, K, dtype=torch.bool)
    else:
        cap = math.ceil(capacity_factor * (T // num_groups) * K / E)
        keep_TK = kept_reference(ids_TK, scores_TK, E, num_groups, cap, drop_policy)
    assert plan.capacity == cap
    assert torch.equal(plan.dest_TK >= 0, keep_TK)
    assert int(plan.dropped) == int((~keep_TK).sum())
    if capacity_factor is not None:
        assert int(plan.dropped) > 0, "the case must exercise dropping"
    assert torch.equal(plan.tokens_per_expert_E, torch.bincount(ids_TK.flatten(), minlength=E))
    assert plan.num_rows == (E * num_groups * cap if pad else T * K)

    kept_rows = plan.dest_TK[keep_TK]
    assert kept_rows.unique().numel() == kept_rows.numel(), "two assignments share a row"
    assert kept_rows.min() >= 0 and kept_rows.max() < plan.num_rows
    offs = [0] + plan.offs_E.tolist()
    assert offs[-1] <= plan.num_rows
    for (t, k), row in zip(keep_TK.nonzero().tolist(), kept_rows.tolist(), strict=True):
        e = int(ids_TK[t, k])
        assert offs[e] <= row < offs[e + 1], f"row {row} of expert {e} outside {offs[e : e + 2]}"
    kept_E = torch.bincount(ids_TK[keep_TK], minlength=E)
    if pad:
        assert plan.offs_E.tolist() == [(e + 1) * num_groups * cap for e in range(E)]
    else:
        # Segments hold exactly the kept rows, back to back.
        assert plan.offs_E.tolist() == torch.cumsum(kept_E, 0).tolist()


def test_plan_rejects_bad_groups_and_policy():
    ids_TK = torch.zeros(6, 1, dtype=torch.int64)
    scores_TK = torch.rand(6, 1)
    with pytest.raises(ValueError, match="token groups"):
        plan_dispatch(ids_TK, scores_TK, 2, 4, 1.0)
    with pytest.raises(ValueError, match="drop_policy"):
        plan_dispatch(ids_TK, scores_TK, 2, 1, 1.0, drop_policy="random")


def test_layer_rejects_batch_not_divisible_by_token_group_seqs():
    cfg = MoEConfig(num_experts=2, top_k=1, expert_ffn_dim=4, token_group_seqs=2, kernels="torch")
    layer = MoELayer(4, cfg)
    assert layer.token_groups(4) == 2
    with pytest.raises(ValueError, match="token_group_seqs"):
        layer(torch.randn(3, 2, 4))
