"""A parameter that some ranks' data leave unused: every data-parallel reduction still
agrees on the set of gradients, and the step is one process's.

ZeRO-0's bucketed all-reduce used to take only the gradients its own rank had, and FSDP2
reduce-scatters only those (unless told otherwise): a parameter used on some ranks' data
shifted every later gradient in the buckets, or left one rank out of a reduce-scatter, and
the job stopped. Now every trainable parameter the data left unused gets a zero gradient
before any reduction, in every layout and in one process alike (``Gradients.fill_unused``,
``grads_or_zeros``, FSDP2's ``set_reduce_scatter_unused_params``).

The planted model (``_install``) adds the routed experts' output bias ``b2`` to the tokens
equal to one token id only, and leaves ``b2`` out of the graph of a micro-batch that holds
none: token by token the same function in every layout. The token is one that rank 1's
micro-batches hold and rank 0's never do (recorded from a first run), so rank 0's data never
use ``b2`` and rank 1's do. The expert-data-parallel all-reduce gets its own plant on four
ranks (ep 2 x edp 2), in the experts' up-projection biases (below). Without the zeros, both
plants stop the job (a rank aborts in the collective).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
from multirank import compare_runs, micro_run, run_ranks

pytestmark = pytest.mark.multirank

STEPS = 2
OPTIONS = ("moe.expert_ffn_bias=true",)
LAYOUTS = {
    "zero0 (bucketed all-reduce)": ("parallel.zero_stage=0",),
    "zero1": ("parallel.zero_stage=1",),
    "zero2 (FSDP2)": ("parallel.zero_stage=2",),
    "zero3 (FSDP2)": ("parallel.zero_stage=3",),
}


def _install(token: int | None, setattr_: Callable[..., None]) -> set[int]:
    """Record every token id the model's forwards see (returned, filled as they run); with
    ``token``, plant the bias used on that token's rows only."""
    from moetrain.model import experts, transformer

    seen: set[int] = set()
    current: dict[str, torch.Tensor] = {}
    forward, output_bias = transformer.Transformer.forward, experts.GroupedExperts.output_bias

    def recording_forward(self: Any, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not tokens.is_floating_point():
            current["tokens"] = tokens
            seen.update(tokens.unique().tolist())
        return forward(self, tokens, *args, **kwargs)

    def planted_output_bias(self: Any, ids_TK: Any, weights_TK: Any, dest_TK: Any) -> Any:
        rows_T = current["tokens"].reshape(-1) == token
        if not bool(rows_T.any()):  # b2 is not in this micro-batch's graph
            return weights_TK.new_zeros(ids_TK.shape[0], self.b2.shape[-1])
        return output_bias(self, ids_TK, weights_TK * rows_T[:, None].to(weights_TK), dest_TK)

    setattr_(transformer.Transformer, "forward", recording_forward)
    if token is not None:
        setattr_(experts.GroupedExperts, "output_bias", planted_output_bias)
    return seen


def _patched_run(
    install: Callable[[Callable[..., None]], Any], steps: int, overrides: tuple[str, ...]
) -> tuple[dict[str, Any], Any]:
    """``micro_run`` with ``install(patch)``'s patches in place (undone after); returns the
    report and what ``install`` returned."""
    undo: list[Callable[[], None]] = []

    def patch(obj: Any, attr: str, value: Any) -> None:
        old = getattr(obj, attr)
        setattr(obj, attr, value)
        undo.append(lambda: setattr(obj, attr, old))

    try:
        installed = install(patch)
        with tempfile.TemporaryDirectory() as tmp:
            got = micro_run(tmp, steps, *OPTIONS, *overrides, traffic=False)
    finally:
        for restore in reversed(undo):
            restore()
    got.pop("layout", None)
    return got, installed


def _run(token: int | None, overrides: tuple[str, ...]) -> tuple[dict[str, Any], set[int]]:
    return _patched_run(lambda patch: _install(token, patch), STEPS, overrides)


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn

    from moetrain.parallel.expert_parallel import reduce_expert_grads

    _, mine = _run(None, next(iter(LAYOUTS.values())))
    seen: list[set[int]] = [set(), set()]
    dist.all_gather_object(seen, mine)
    token = min(seen[1] - seen[0])
    runs = {name: _run(token, layout)[0] for name, layout in LAYOUTS.items()}
    # The expert-data-parallel reduction on its own: rank 0 lacks ``a``'s gradient.
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    b.grad = torch.full((2,), float(rank + 1))
    if rank == 1:
        a.grad = torch.full((3,), 4.0)
    reduce_expert_grads([a, b], dist.group.WORLD, 2)
    return {"token": token, "seen": seen, "runs": runs, "edp": (a.grad.tolist(), b.grad.tolist())}


# ---------------------------------------------------------------- expert data parallelism
#
# The expert-data-parallel all-reduce holds expert parameters (EP-sharded, replicated over
# the edp ranks); no model path leaves one out of the graph (the grouped GEMMs give an
# expert without tokens a zero gradient), so the plant is in the experts' forward: the
# up-projection biases ``b1``/``b3`` are added only to the routed rows whose first feature
# exceeds ``tau``, and left out of the graph when no row of the rank's buffer does (token
# by token the same function in every layout). ``tau`` is chosen from a first run between
# the smallest of the ranks' largest first features and the next larger: the experts of the
# rank (or ranks) below it never use their biases, their edp peers' do.
EDP_LAYOUT = ("parallel.ep=2", "parallel.zero_stage=1")  # 4 ranks: ep 2 x edp 2
EDP_STEPS = 1  # the plant's first forwards are the recording run's (b1, b3 start at 0)


def _install_edp(tau: float | None, setattr_: Callable[..., None]) -> list[float]:
    """Record the largest first feature of the routed rows this rank's experts see (returned,
    filled as they run); with ``tau``, plant the biases used on the rows above it only."""
    import torch.nn.functional as F
    from moetrain.kernels import grouped_mm

    from moetrain.model import experts

    seen: list[float] = [float("-inf")]
    forward = experts.GroupedExperts.forward

    def planted(self: Any, x_ND: torch.Tensor, offs_E: torch.Tensor, backend: str) -> Any:
        routed_N = torch.arange(x_ND.shape[0]) < offs_E[-1]
        if bool(routed_N.any()):
            seen[0] = max(seen[0], float(x_ND[routed_N, 0].max()))
        if tau is None:
            return forward(self, x_ND, offs_E, backend)
        w1, w3, w2 = (experts.local_part(w).to(x_ND.dtype) for w in (self.w1, self.w3, self.w2))
        g_NF = grouped_mm(x_ND, w1, offs_E, backend=backend)
        u_NF = grouped_mm(x_ND, w3, offs_E, backend=backend)
        hit_N = routed_N & (x_ND[:, 0] > tau)
        if bool(hit_N.any()):  # otherwise b1 and b3 are not in this forward's graph
            rows_N = experts._expert_of_rows(offs_E, x_ND.shape[0])
            hit_N1 = hit_N[:, None].to(x_ND.dtype)
            g_NF = g_NF + experts._with_zero_row(experts.local_part(self.b1))[rows_N] * hit_N1
            u_NF = u_NF + experts._with_zero_row(experts.local_part(self.b3))[rows_N] * hit_N1
        return grouped_mm(F.silu(g_NF) * u_NF, w2, offs_E, backend=backend)

    setattr_(experts.GroupedExperts, "forward", planted)
    return seen


def _run_edp(tau: float | None, overrides: tuple[str, ...]) -> tuple[dict[str, Any], float]:
    got, seen = _patched_run(lambda patch: _install_edp(tau, patch), EDP_STEPS, overrides)
    return got, seen[0]


def _edp_worker(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    _, mine = _run_edp(None, EDP_LAYOUT)
    largest: list[float] = [0.0] * world_size
    dist.all_gather_object(largest, mine)
    low = min(largest)
    tau = (low + min(m for m in largest if m > low)) / 2
    got, _ = _run_edp(tau, EDP_LAYOUT)
    return {"tau": tau, "largest": largest, "run": got}


@pytest.mark.slow
def test_an_expert_parameter_unused_on_one_edp_ranks_data_steps_as_in_one_process() -> None:
    results = run_ranks(_edp_worker, 4, timeout=300)
    tau, largest = results[0]["tau"], results[0]["largest"]
    # The edp groups of the (pp, edp, ep, tp) mesh: ranks 0 and 2, 1 and 3. In one of them
    # (both, when the ranks of an ep group tie) one rank's experts use b1/b3, the other's not.
    assert any((largest[a] < tau) != (largest[b] < tau) for a, b in ((0, 2), (1, 3))), largest
    ref, _ = _run_edp(tau, ())
    b1 = [g for n, g in ref["grads"][0].items() if n.endswith("experts.b1")]
    assert any(g.abs().sum() > 0 for g in b1)  # one process's b1 has a gradient
    for rank, res in enumerate(results):
        compare_runs(res["run"], ref, what=f"ep2 x edp2 ZeRO-1, rank {rank}")


@pytest.mark.slow
def test_a_parameter_unused_on_one_ranks_data_steps_as_in_one_process(monkeypatch) -> None:
    results = run_ranks(_worker, 2, timeout=300)
    token = results[0]["token"]
    seen = results[0]["seen"]
    assert token in seen[1] and token not in seen[0]  # b2 is used on rank 1's data only
    ref, _ = _run(token, ())
    used = [g for step in ref["grads"] for n, g in step.items() if n.endswith("experts.b2")]
    assert any(g.abs().sum() > 0 for g in used)  # one process's b2 has a gradient
    for rank, res in enumerate(results):
        assert res["edp"] == ([2.0, 2.0, 2.0], [1.5, 1.5]), (rank, res["edp"])
        for name, got in res["runs"].items():
            compare_runs(got, ref, what=f"dp2 {name}, rank {rank}")
