"""StepCensus counts what runs: hand-computed FLOPs, syncs and casts of small programs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetrain.plan.census import StepCensus


def test_matmul_flops_by_dtype_forward_and_backward() -> None:
    a = torch.randn(6, 5, requires_grad=True)
    b = torch.randn(5, 3, requires_grad=True)
    with StepCensus() as c:
        y = a @ b
        y.sum().backward()
    # forward 2*6*5*3; backward dA = dY B^T (2*6*3*5) and dB = A^T dY (2*5*6*3)
    assert c.matmul_flops[("mm", torch.float32)] == 3 * 2 * 6 * 5 * 3
    assert c.flops_by_dtype() == {torch.float32: 540}
    with StepCensus() as c:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.linear(a, b.t()).sum().backward()
    assert set(c.flops_by_dtype()) == {torch.bfloat16}, c.report()
    assert c.cast_elements[(torch.float32, torch.bfloat16)] >= a.numel() + b.numel()


def test_grouped_mm_both_forms_and_mismatched_operands() -> None:
    x = torch.randn(16, 4)
    w = torch.randn(3, 4, 8)
    offs = torch.tensor([4, 8, 16], dtype=torch.int32)
    dy = torch.randn(16, 8)
    with StepCensus() as c:
        torch._grouped_mm(x, w, offs=offs)
        torch._grouped_mm(x.t(), dy, offs=offs)  # the weight-gradient form
        torch.mm(x, torch.randn(4, 2, dtype=torch.float64).float())
    assert c.matmul_flops[("_grouped_mm", torch.float32)] == 2 * 16 * 4 * 8 * 2
    assert c.operands[0][:2] == ("_grouped_mm", (torch.float32, torch.float32, torch.int32))
    with StepCensus() as c:
        torch.ops.aten.mm(x, torch.randn(4, 2).to(torch.float64).float())
    assert not c.mismatched


def test_syncs_are_the_ops_the_host_must_wait_for() -> None:
    t = torch.tensor([0, 2, 0, 1])
    with StepCensus() as c:
        t.sum().item()
        t.tolist()
        t.nonzero()
        t[t > 0]
        torch.bincount(t, minlength=4)
        t.repeat_interleave(t)
        t.repeat_interleave(t, output_size=3)  # sized by the caller: no sync
        t.cumsum(0)  # nothing to wait for
        bool(t[0])
    assert c.syncs["_local_scalar_dense"] == 2 and c.syncs["tolist"] == 1  # item, bool
    assert c.syncs["nonzero"] == 1 and c.syncs["bincount"] == 1
    assert c.syncs["index"] == 1 and c.syncs["repeat_interleave"] == 1
    assert c.sync_count() == 7, c.syncs


def test_casts_and_norm_reads() -> None:
    w = torch.randn(8, 4)
    with StepCensus() as c:
        w.to(torch.bfloat16)
        w.double()
        w.to(torch.int64)  # not a floating cast
        torch.empty(8, 4, dtype=torch.bfloat16).copy_(w)
        torch.linalg.vector_norm(w)
        torch._foreach_norm([w, w[:2]])
    assert c.cast_elements == {
        (torch.float32, torch.bfloat16): 64,
        (torch.float32, torch.float64): 32,
    }
    assert c.cast_bytes() == 64 * (4 + 2) + 32 * (4 + 8)
    assert c.norm_bytes[torch.float32] == (32 + 32 + 8) * 4
    assert "host syncs: 0" in c.report()


def test_host_reads_and_the_tensors_that_stay_on_the_host() -> None:
    """``.cpu()`` counts (on a CPU tensor it runs no aten op); reads of ``host_tensors``
    (AdamW's step counts stay on the host on every device) do not."""
    step, v = torch.tensor(3.0), torch.tensor([2.0, 1.0])
    with StepCensus(host_tensors=[step]) as census:
        torch.bincount(torch.tensor([0, 1, 1]))
        step.item(), step.tolist(), v.cpu(), v[0].item(), float(v.sum())
    assert census.syncs == {"bincount": 1, "cpu": 1, "_local_scalar_dense": 2}, census.syncs
    with StepCensus() as census:
        step.item()
    assert census.syncs == {"_local_scalar_dense": 1}, census.syncs
