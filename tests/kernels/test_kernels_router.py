"""route (fused top-k router), every backend, against the plain-torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import BACKENDS, DEVICE, assert_close, grads
from moetrain.kernels import route
from moetrain.kernels.router.reference import route_reference


def _logits(num_tokens, num_experts, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(num_tokens, num_experts, generator=gen)).to(DEVICE).requires_grad_()


def _check_route(backend, logits_TE, top_k, score_func, bias_E, renormalize, used=(0, 2, 3)):
    """Compare every output, then the logits gradient from the outputs listed in `used`
    (indices into RouteResult: 0 weights, 2 scores, 3 lse)."""
    kwargs = {"score_func": score_func, "expert_bias_E": bias_E, "renormalize": renormalize}
    got = route(logits_TE, top_k, backend=backend, **kwargs)
    ref = route_reference(logits_TE, top_k, **kwargs)
    assert torch.equal(got.ids_TK, ref.ids_TK), f"ids differ:\n{got.ids_TK}\n{ref.ids_TK}"
    assert torch.equal(got.counts_E, ref.counts_E), f"counts {got.counts_E} != {ref.counts_E}"
    assert got.ids_TK.dtype == got.counts_E.dtype == torch.int64
    for name in ("weights_TK", "scores_TE", "lse_T"):
        assert_close(getattr(got, name), getattr(ref, name), name)
    gen = torch.Generator().manual_seed(7)
    douts = [torch.randn(ref[i].shape, generator=gen).to(DEVICE) for i in used]
    (dlogits,) = grads([got[i] for i in used], [logits_TE], douts)
    (dlogits_ref,) = grads([ref[i] for i in used], [logits_TE], douts)
    assert_close(dlogits, dlogits_ref, f"dlogits from outputs {used}")


@pytest.mark.thread_counts
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
def test_route_matches_reference(backend, score_func, renormalize, with_bias):
    bias_E = (0.3 * torch.randn(16, generator=torch.Generator().manual_seed(3))).to(DEVICE)
    _check_route(
        backend, _logits(33, 16), 4, score_func, bias_E if with_bias else None, renormalize
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k",
    [(1, 8, 1), (7, 6, 6), (7, 128, 8), (33, 5, 2)],
    ids=["T1-top1", "T7-topk=E", "T7-E128-top8", "T33-E5-top2"],
)
def test_route_shapes(backend, num_tokens, num_experts, top_k):
    _check_route(backend, _logits(num_tokens, num_experts, seed=num_tokens), top_k,
                 "softmax", None, True)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("used", [(0,), (2,), (3,), (0, 3)], ids=["w", "scores", "lse", "w+lse"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_route_partial_gradients(backend, used, score_func):
    """Only some outputs reach the loss: the others' gradients are absent, not zeros."""
    _check_route(backend, _logits(9, 12, seed=5), 3, score_func, None, True, used=used)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_steers_selection_only(backend):
    """A large bias on expert 0 forces its selection; weights stay unbiased scores."""
    logits_TE = _logits(7, 6)
    bias_E = torch.zeros(6, device=DEVICE)
    bias_E[0] = 100.0
    got = route(logits_TE, 2, expert_bias_E=bias_E, renormalize=False, backend=backend)
    assert torch.all(got.ids_TK[:, 0] == 0)
    assert_close(got.weights_TK[:, 0], torch.softmax(logits_TE, -1)[:, 0], "weight of expert 0")


@pytest.mark.parametrize(
    "renormalize, group_score", [(True, "top2"), (False, "top2"), (False, "max")]
)
def test_group_limited_routing_matches_reference(renormalize, group_score):
    """Group-limited routing (torch path; DeepSeek-V3's groups scored by their two best
    experts, DeepSeek-V2's by their best) against the per-token reference, and the choice
    really is confined to each token's best groups."""
    gen = torch.Generator().manual_seed(11)
    logits_TE = torch.randn(40, 16, generator=gen).to(DEVICE).requires_grad_()
    bias_E = (0.2 * torch.randn(16, generator=gen)).to(DEVICE)
    kwargs = dict(score_func="sigmoid", expert_bias_E=bias_E, renormalize=renormalize,
                  n_groups=4, topk_groups=2, group_score=group_score)  # fmt: skip
    got = route(logits_TE, 4, backend="torch", **kwargs)
    ref = route_reference(logits_TE, 4, **kwargs)
    assert torch.equal(got.ids_TK, ref.ids_TK)
    assert torch.equal(got.counts_E, ref.counts_E)
    assert_close(got.weights_TK, ref.weights_TK, "weights_TK")
    groups_TK = got.ids_TK // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups_TK), "a token left its 2 groups"
    plain = route(logits_TE, 4, backend="torch", score_func="sigmoid", expert_bias_E=bias_E)
    assert not torch.equal(plain.ids_TK.sort(-1).values, got.ids_TK.sort(-1).values), (
        "group limit changed nothing: the test cannot fail"
    )
    other = "max" if group_score == "top2" else "top2"
    swapped = route(logits_TE, 4, backend="torch", **{**kwargs, "group_score": other})
    assert not torch.equal(swapped.ids_TK, got.ids_TK), "group scoring changed nothing"
    gen = torch.Generator().manual_seed(7)
    dw = torch.randn(got.weights_TK.shape, generator=gen).to(DEVICE)
    (dlogits,) = grads([got.weights_TK], [logits_TE], [dw])
    (dlogits_ref,) = grads([ref.weights_TK], [logits_TE], [dw])
    assert_close(dlogits, dlogits_ref, "dlogits")


def test_group_limited_routing_is_refused_by_the_triton_router():
    logits_TE = torch.randn(8, 16).to(DEVICE)
    with pytest.raises(ValueError, match="group-limited routing .* no Triton kernel"):
        route(logits_TE, 2, backend="triton", n_groups=4, topk_groups=2)
