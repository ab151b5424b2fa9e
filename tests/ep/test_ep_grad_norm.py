"""The gradient norm under expert parallelism: what the engine's optimizer step returns (and
clips by) on every rank of an ep2 job equals one process's, and the L2 norm of every reduced
gradient of the step gathered to full size.

Under EP the experts' gradients are no part of the engine's non-expert pieces; their squares
reach the norm only through ``expert_grad_sq_norm`` (summed over the EP group), so a norm that
left them out would still be a plausible number: the expert-parallel layouts' optimizer moments
would show it only after clipping had scaled a step by it. Here the norm itself is compared,
step by step, with both references; the fp32 "value" row of ``TOLERANCES`` (layouts reorder
fp32 sums; measured 1e-7).
"""

from __future__ import annotations

import math
import re
import tempfile

import pytest
from multirank import TOLERANCES, micro_run, reference_run, run_ranks

STEPS = 2
OPTIONS = ("model.dim=32", "model.ffn_dim=64", "moe.expert_ffn_dim=32", "data.seq_len=16")
EP2 = ("parallel.ep=2",)
TOL = TOLERANCES["fp32"]["value"]


def _norms(run: dict) -> dict[str, list[float]]:
    """The step's returned norms, and the norms of its reduced gradients (before clipping,
    gathered to full size), in fp64: all of them, and the routed experts' alone."""
    out: dict[str, list[float]] = {"returned": list(run["grad_norm"]), "of the gradients": [],
                                   "of the expert gradients": []}  # fmt: skip
    for step in run["grads"]:
        sq = {k: float(g.double().pow(2).sum()) for k, g in step.items()}
        out["of the gradients"].append(math.sqrt(sum(sq.values())))
        out["of the expert gradients"].append(
            math.sqrt(sum(v for k, v in sq.items() if ".ffn.experts." in k))
        )
    return out


def _worker(rank: int, world: int) -> dict[str, dict[str, list[float]]]:
    """Each rank's norms of an ep2 run, then of the same run with tests/faults.py's
    ``ep_grad_norm_without_experts`` planted."""
    import multirank as mr

    out = {}
    for fault in (None, ("plant", None, "ep_grad_norm_without_experts")):
        undo: list = []
        mr._plant(fault, rank, undo)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                run = micro_run(tmp, STEPS, *OPTIONS, *EP2, traffic=False)
        finally:
            for restore in reversed(undo):
                restore()
        out["planted" if fault else "ep2"] = _norms(run)
    return out


def norm_problems(got: dict[str, list[float]], one: dict[str, list[float]]) -> list[str]:
    """Every step whose returned norm differs from one process's or from the norm of its own
    gradients, and whose expert term (the returned norm's square less the other gradients'
    squares) differs from the norm of its expert gradients, beyond ``TOL``. The experts hold
    0.1% of the micro MoE's squared norm at the start (the embeddings dominate): the total
    alone moves by 5e-4 without them, the term by all of it; from the run's own gradients the
    subtraction is exact to fp64 (both sides sum the same fp32 values)."""
    out = []
    for step in range(STEPS):
        want = one["returned"][step]
        assert math.isclose(want, one["of the gradients"][step], **_tol()), one
        norm, own = got["returned"][step], got["of the gradients"][step]
        experts = got["of the expert gradients"][step]
        term = math.sqrt(max(0.0, norm**2 - (own**2 - experts**2)))
        checks = (
            ("grad_norm", norm, "one process's", want),
            ("grad_norm", norm, "its gradients'", own),
            ("its expert term", term, "its expert gradients'", experts),
        )
        for what, value, source, ref in checks:
            if not math.isclose(value, ref, **_tol()):
                out.append(f"step {step}: {what} {value:.6g}, {source} {ref:.6g} "
                           f"(ratio {value / ref:.4f})")  # fmt: skip
    return out


def _tol() -> dict[str, float]:
    return {"rel_tol": TOL["rtol"], "abs_tol": TOL["atol"]}


@pytest.fixture(scope="module")
def norms() -> tuple[list[dict], dict[str, list[float]]]:
    one = _norms(reference_run(OPTIONS, STEPS))
    return run_ranks(_worker, 2, timeout=280), one


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_the_gradient_norm_under_ep2_is_one_processs(norms) -> None:
    results, one = norms
    for rank, r in enumerate(results):
        assert norm_problems(r["ep2"], one) == [], rank


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_norm_without_the_expert_term_is_caught(norms) -> None:
    """tests/faults.py ``ep_grad_norm_without_experts``: every step's norm is short of both
    references, and its expert term is gone (the gradients themselves are the layout's own:
    their norm still holds the experts)."""
    results, one = norms
    for rank, r in enumerate(results):
        problems = norm_problems(r["planted"], one)
        labels = [re.fullmatch(r"(step \d+: .+) \S+, (.+) \S+ \(ratio \S+\)", p).groups()
                  for p in problems]  # fmt: skip
        assert labels == [
            (f"step {step}: {what}", source)
            for step in range(STEPS)
            for what, source in (("grad_norm", "one process's"), ("grad_norm", "its gradients'"),
                                 ("its expert term", "its expert gradients'"))
        ], (rank, problems)  # fmt: skip
        assert all(p.endswith("(ratio 0.0000)") for p in problems[2::3]), (rank, problems)
