"""Context parallelism (``parallel.cp``): the split, the MoE plan over whole sequences, and
every composition against one process.

Unit part (one process): the load-balanced split, the gather order, and the MoE pieces a
cp rank computes from its share of the tokens -- the dispatch plan and the switch losses --
against what ``plan_dispatch`` / ``load_balancing_loss`` compute on the whole sequences
(the single-process path, tested on its own in tests/model/).

Multi-rank part: the oracle of tests/parallel/test_layouts.py (``check_cases``: losses, MoE
statistics, every gradient of every step, AdamW's moments, final parameters, and the layout
facts -- the positions each rank holds, the attention core, the MoE layers' whole-sequence
planning, traffic on the cp group), for cp alone on 2 and 4 ranks, cp x dp, cp x ep, cp x
pp, cp x dp x tp, and checkpoints resharded across cp degrees.
"""

from __future__ import annotations

import pytest
import torch
from multirank import Case, check_cases, check_reshards

from moetrain.model.dispatch import LocalDispatcher, plan_dispatch, plan_dispatch_sharded
from moetrain.model.losses import load_balancing_loss
from moetrain.parallel.context_parallel import gather_order, sequence_index

STEPS = 3
SMALL = ("model.dim=32", "model.ffn_dim=64", "moe.expert_ffn_dim=32", "data.seq_len=16")


# ----------------------------------------------------------------------------- the split


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_rank_holds_an_early_and_a_late_chunk_and_equal_causal_work(cp: int) -> None:
    S = 32
    held = [sequence_index(S, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(S))
    chunk = S // (2 * cp)
    for r, pos in enumerate(held):
        assert pos.tolist() == [
            *range(r * chunk, (r + 1) * chunk),
            *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk),
        ]
    # Causal attention's work of a query at position p is p + 1 keys: equal on every rank.
    work = {int((pos + 1).sum()) for pos in held}
    assert len(work) == 1, work
    order = gather_order(S, cp)
    assert torch.equal(torch.cat(held)[order], torch.arange(S))


def test_a_sequence_that_does_not_split_into_2cp_chunks_is_refused() -> None:
    with pytest.raises(ValueError, match="2 \\* cp = 8 equal chunks"):
        sequence_index(20, 4, 0)


# ----------------------------------------------------------------------------- MoE plan


def _routing(B: int, S: int, E: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Skewed random routing (expert 0 popular) so capacity drops many assignments."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B * S, E, generator=g)
    logits[:, 0] += 1.5
    scores = logits.softmax(-1)
    top = scores.topk(K, dim=-1)
    return top.indices, top.values


@pytest.mark.thread_counts
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("cp", [2, 4])
def test_sharded_plan_keeps_exactly_what_the_whole_sequences_keep(
    policy: str, pad: bool, cp: int
) -> None:
    B, S, E, K, G, cf = 4, 16, 4, 2, 2, 1.0
    ids_all, scores_all = _routing(B, S, E, K, seed=cp)
    whole = plan_dispatch(ids_all, scores_all, E, G, cf, policy, pad)
    assert int(whole.dropped) > 0  # the case has drops to get right
    x_all = torch.randn(B * S, 8)
    weights_all = torch.rand(B * S, K)
    # A stand-in for the experts: expert e scales its rows by e + 1.
    scale_E = torch.arange(1, E + 1, dtype=torch.float32)

    def run(x, ids, weights, plan):
        d = LocalDispatcher()
        rows, offs = d.dispatch(x, plan, "torch")
        expert_of_row = torch.searchsorted(offs.long(), torch.arange(rows.shape[0]), right=True)
        return d.combine(
            rows * scale_E[expert_of_row.clamp(max=E - 1)][:, None], plan, weights, "torch"
        )

    y_whole = run(x_all, ids_all, weights_all, whole).view(B, S, -1)
    dropped, counts = 0, torch.zeros(E, dtype=torch.int64)
    for r in range(cp):
        pos = sequence_index(S, cp, r)
        ids, x, w = (
            t.view(B, S, -1)[:, pos].reshape(B * len(pos), -1)
            for t in (ids_all, x_all, weights_all)
        )
        plan = plan_dispatch_sharded(ids, ids_all, scores_all, pos, E, G, cf, policy, pad)
        keep = (whole.dest_TK >= 0).view(B, S, K)[:, pos].reshape(-1, K)
        assert torch.equal(plan.dest_TK >= 0, keep), f"cp rank {r}: other assignments kept"
        assert plan.capacity == whole.capacity
        torch.testing.assert_close(
            run(x, ids, w, plan).view(B, len(pos), -1), y_whole[:, pos], rtol=0, atol=0
        )
        dropped += int(plan.dropped)
        counts += plan.tokens_per_expert_E
        if pad:
            assert plan.num_rows == whole.num_rows  # static shapes, as one process pads
    assert dropped == int(whole.dropped)
    assert torch.equal(counts, whole.tokens_per_expert_E)


def test_planning_a_shard_on_its_own_would_drop_other_assignments() -> None:
    """The negative control: a cp rank that applied capacity to its own tokens (half of each
    group) would keep a different set -- what the whole-sequence plan is there to avoid."""
    B, S, E, K, G, cf, cp = 4, 16, 4, 2, 2, 1.0, 2
    ids_all, scores_all = _routing(B, S, E, K, seed=2)
    whole = plan_dispatch(ids_all, scores_all, E, G, cf, "probs")
    pos = sequence_index(S, cp, 0)
    ids = ids_all.view(B, S, K)[:, pos].reshape(-1, K)
    scores = scores_all.view(B, S, K)[:, pos].reshape(-1, K)
    alone = plan_dispatch(ids, scores, E, G, cf, "probs")
    keep = (whole.dest_TK >= 0).view(B, S, K)[:, pos].reshape(-1, K)
    assert not torch.equal(alone.dest_TK >= 0, keep)


@pytest.mark.parametrize("cp", [2, 4])
def test_switch_loss_of_the_shards_averages_to_the_whole_sequences_loss(cp: int) -> None:
    """f counts the whole groups' choices, P averages a rank's tokens: the mean over cp
    ranks of the value and of its gradient is the whole sequences' (the engine averages
    gradients over dp x cp)."""
    B, S, E, K, G = 4, 16, 4, 2, 2
    g = torch.Generator().manual_seed(0)
    probs_all = torch.rand(B * S, E, generator=g).softmax(-1).requires_grad_()
    ids_all = probs_all.topk(K, -1).indices
    whole = load_balancing_loss(probs_all, ids_all, G)
    (grad_whole,) = torch.autograd.grad(whole, probs_all)
    total = torch.zeros(())
    grad = torch.zeros_like(probs_all).view(B, S, E)
    for r in range(cp):
        pos = sequence_index(S, cp, r)
        probs = probs_all.detach().view(B, S, E)[:, pos].reshape(-1, E).requires_grad_()
        ids = ids_all.view(B, S, K)[:, pos].reshape(-1, K)
        value = load_balancing_loss(probs, ids, G, ids_all)
        (g_r,) = torch.autograd.grad(value, probs)
        total += value.detach() / cp
        grad[:, pos] += g_r.view(B, len(pos), E) / cp
    torch.testing.assert_close(total, whole.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad.view(-1, E), grad_whole, rtol=1e-6, atol=1e-9)
    # Without the whole groups' counts the value is another one.
    pos = sequence_index(S, cp, 0)
    probs = probs_all.detach().view(B, S, E)[:, pos].reshape(-1, E)
    ids = ids_all.view(B, S, K)[:, pos].reshape(-1, K)
    assert not torch.allclose(
        load_balancing_loss(probs, ids, G, ids_all), load_balancing_loss(probs, ids, G)
    )


# ----------------------------------------------------------------------------- layouts


def _cases(layouts: dict[str, list[str]], options: tuple[str, ...] = SMALL) -> list[Case]:
    return [Case(name, tuple(overrides), options) for name, overrides in layouts.items()]


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_cp2_alone_and_resharded_to_dp2() -> None:
    """cp=2 on 2 ranks: plain; dropping by score with padded capacity, router jitter,
    ZeRO-1 and full activation checkpointing; ZeRO-3 with selective AC and MLA. A checkpoint
    saved under cp=2 resumes under dp=2 with ZeRO-3, and one saved under dp=2 under cp=2."""
    check_cases(
        2,
        [
            *_cases({"cp=2": ["parallel.cp=2"]}),
            Case(
                "cp=2 zero1 + full AC, drop by score padded, jitter",
                (
                    "parallel.cp=2",
                    "parallel.zero_stage=1",
                    "parallel.activation_checkpointing=full",
                ),
                (*SMALL, "moe.pad_to_capacity=true", "moe.jitter_eps=0.1"),
            ),
            Case(
                "cp=2 zero3 + selective AC, MLA, drop by position",
                (
                    "parallel.cp=2",
                    "parallel.zero_stage=3",
                    "parallel.activation_checkpointing=selective",
                ),
                (
                    *SMALL,
                    "model.attention=mla",
                    "model.q_lora_rank=24",
                    "model.kv_lora_rank=16",
                    "model.qk_nope_head_dim=16",
                    "model.qk_rope_head_dim=8",
                    "model.v_head_dim=16",
                    "moe.drop_policy=position",
                ),
            ),
        ],  # fmt: skip
        STEPS,
        timeout=380,
    )
    check_reshards(
        2,
        [
            (
                "cp=2 zero1 -> dp=2 zero3",
                ["parallel.cp=2", "parallel.zero_stage=1"],
                ["parallel.zero_stage=3"],
            ),
            (
                "dp=2 zero0 -> cp=2 zero2",
                ["parallel.zero_stage=0"],
                ["parallel.cp=2", "parallel.zero_stage=2"],
            ),
        ],  # fmt: skip
        STEPS,
        timeout=380,
        options=SMALL,
    )


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_cp4_and_cp2_with_dp_ep_pp_on_four_ranks() -> None:
    """cp=2 x dp=2 (ZeRO-3 over dp_shard x cp) and cp=2 x pp=2 under ZB-V; a checkpoint
    saved under cp=4 resumes under cp=2 x dp=2. (cp=4, cp x ep x dp and cp x pp under
    interleaved 1F1B are layouts of the equivalence matrix, tests/parallel/test_matrix.py.)"""
    check_cases(
        4,
        _cases(
            {
                "cp=2 x dp=2 zero3": ["parallel.cp=2", "parallel.zero_stage=3"],
                "cp=2 x pp=2 zbv": [
                    "parallel.cp=2",
                    "parallel.pp=2",
                    "parallel.pp_schedule=zbv",
                    "parallel.pp_virtual_stages=2",
                ],
            }
        ),  # fmt: skip
        STEPS,
        timeout=580,
    )
    check_reshards(
        4,
        [
            (
                "cp=4 -> cp=2 x dp=2 zero1",
                ["parallel.cp=4"],
                ["parallel.cp=2", "parallel.zero_stage=1"],
            )
        ],
        STEPS,
        timeout=380,
        options=SMALL,
    )


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.timeout(400)
def test_cp2_dp2_tp2_on_eight_ranks() -> None:
    """cp x dp x tp = 2 x 2 x 2 with sequence parallelism (each cp rank's half of the
    sequence split again over tp) and ZeRO-2 over dp_shard x cp. The same layout is in the
    equivalence matrix's CI part; this run (the micro model itself) is under -m exhaustive
    for the suite's budget."""
    check_cases(
        8,
        _cases(
            {
                "cp=2 x dp=2 x tp=2 SP zero2": [
                    "parallel.cp=2",
                    "parallel.tp=2",
                    "parallel.sequence_parallel=true",
                    "parallel.zero_stage=2",
                ],
            }
        ),  # fmt: skip
        STEPS,
        timeout=380,
    )
