"""``parallel.ep_overlap=halves``: two halves of every micro-batch interleaved in each block, so
that one half's all-to-alls travel while the other half computes.

Every layout with it trains like one process (the oracle of tests/oracle.py: losses, MoE
statistics, every gradient of every step, AdamW's moments, the final parameters; the fp32
tolerances), and really ran the halves (the ``ep_halves`` layout fact). The same layouts
join the equivalence matrix (tests/parallel/matrix_design.py). Here, on 2 ranks: ep=2 with
shared experts overlapped too, ZeRO-3 with full activation checkpointing (the recomputed
block issues its transfers again inside backward), dropless micro-batches of 4, and context
parallelism with packed documents.

The order of issue is checked without timing: in forward each half's rows are issued before
the other half waits (``Transfer`` records the order of issue and wait), and backward
interleaves the two halves' transfers the same way.
"""

from __future__ import annotations

import pytest
from multirank import run_ranks
from oracle import Case, check_cases

HALVES = ("parallel.ep=2", "parallel.ep_overlap=halves")
GROUPS = ("moe.token_group_seqs=1",)  # a micro-batch of 2: halves of one sequence


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_halves_train_like_one_process_on_two_ranks() -> None:
    cases = [
        Case("ep2 halves, shared experts overlapped",
             (*HALVES, "parallel.overlap_shared_experts=true"), GROUPS),
        Case("ep2 halves, ZeRO-3, full activation checkpointing",
             (*HALVES, "parallel.zero_stage=3", "parallel.activation_checkpointing=full"),
             GROUPS),
        Case("ep2 halves, dropless, micro-batches of 4",
             HALVES, ("moe.capacity_factor=null", "train.micro_batch_size=4",
                      "moe.token_group_seqs=2")),
        # EP over the cp ranks: each half gathers its whole sequences' routing over cp
        Case("cp2 x ep2 halves, dropless, documents", (*HALVES, "parallel.cp=2"),
             (*GROUPS, "moe.capacity_factor=null", "model.document_mask=true")),
    ]  # fmt: skip
    check_cases(2, cases, 3, timeout=560)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_halves_compose_with_a_pipeline_and_expert_tp_on_four_ranks() -> None:
    """pp=2 x ep=2 under interleaved 1F1B (each stage's blocks run their halves inside the
    schedule's micro-batches); ep=2 x tp=2 with expert TP (the halves' tokens enter and
    leave the TP region one half at a time), with documents packed (per-token rotary rows
    and masks cut with the halves); and with sequence parallelism (each half's input
    gathered and its output cut on the MoE layer's seams)."""
    cases = [
        Case("pp2 x ep2 interleaved v2, halves",
             (*HALVES, "parallel.pp=2", "parallel.pp_virtual_stages=2"), GROUPS),
        Case("ep2 x tp2 expert TP, halves, documents",
             (*HALVES, "parallel.tp=2"),
             (*GROUPS, "model.document_mask=true", "model.document_positions=true")),
        Case("ep2 x tp2 SP, halves", (*HALVES, "parallel.tp=2",
                                      "parallel.sequence_parallel=true"), GROUPS),
    ]  # fmt: skip
    check_cases(4, cases, 3, timeout=560)


def _order(rank: int, world: int, shared: int = 0) -> list[str]:
    """The transfers of one forward and backward of one block, in the order they are issued
    and waited for; with ``shared`` experts, where their forward and backward run."""
    import torch

    from moetrain.config import ModelConfig, MoEConfig
    from moetrain.model import ep_dispatch
    from moetrain.model.transformer import TransformerBlock, rope_tables
    from moetrain.parallel.expert_parallel import apply_ep

    events: list[str] = []
    issue, wait = ep_dispatch.Transfer.issue, ep_dispatch.Transfer.wait
    names: dict[int, str] = {}

    def named(t) -> str:
        return names.setdefault(id(t), f"t{len(names)}")

    def logged_issue(self, *args):
        events.append(f"issue {named(self)}")
        return issue(self, *args)

    def logged_wait(self):
        events.append(f"wait {named(self)}")
        return wait(self)

    ep_dispatch.Transfer.issue, ep_dispatch.Transfer.wait = logged_issue, logged_wait  # type: ignore[method-assign]
    torch.manual_seed(0)
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32, max_seq_len=8)
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16, capacity_factor=None,
                    every_n_layers=1, num_shared_experts=shared)  # fmt: skip
    block = TransformerBlock(0, cfg, moe)
    if shared:
        experts = block.ffn.shared_experts
        experts.register_forward_hook(lambda *_: events.append("shared"))
        experts.register_full_backward_hook(lambda *_: events.append("shared'"))
    par = type("P", (), {"ep_dispatcher": "all_to_all", "ep_overlap": "halves"})()
    apply_ep(block, torch.distributed.group.WORLD, par)
    cos, sin = rope_tables(cfg)
    x = torch.randn(2, 8, 16, requires_grad=True)
    block(x, cos, sin).sum().backward()
    return events


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_each_half_travels_while_the_other_computes() -> None:
    for events in run_ranks(_order, 2):
        # forward: rows of half 0 (t0) and half 1 (t1) issued before either is awaited; the
        # outputs of half 0 (t2) issued before half 1's rows are awaited
        assert events[:8] == ["issue t0", "issue t1", "wait t0", "issue t2", "wait t1",
                              "issue t3", "wait t2", "wait t3"], events  # fmt: skip
        # backward, in reverse: the outputs' gradients of both halves issued before either
        # is awaited, each half's rows' gradients issued before the other half's wait
        assert events[8:] == ["issue t3", "issue t2", "wait t3", "issue t1", "wait t2",
                              "issue t0", "wait t1", "wait t0"], events  # fmt: skip


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_the_shared_experts_cover_the_transfer_nothing_else_does() -> None:
    """The one transfer of a block's forward that only the other half's combine covers is
    the second half's return (t3): its shared experts run before it is awaited, and in
    backward between the issue of its gradients and their wait."""
    for events in run_ranks(_order, 2, 1):
        forward = events[: events.index("wait t3") + 1]
        assert forward[forward.index("issue t3"):].count("shared") == 2, events  # both halves'
        backward = events[len(forward):]
        window = backward[backward.index("issue t3"): backward.index("wait t3")]
        assert "shared'" in window, events
