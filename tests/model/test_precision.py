"""The precision policy (``moetrain.model.precision``): the dtype chosen once, autocast around
a forward and only it, FSDP2's mixed-precision policies, and the fp32 regions.

Each fp32 region of ``FP32_REGIONS`` is checked against an fp32 reference computed without
the policy: inside a region a bf16 run computes, bit for bit, what fp32 arithmetic on the
same operands gives. Each region is then dropped from the registry in turn (the planted
policy change, ``drop_fp32_region`` of tests/faults.py) and the same comparison fails, naming
it. What a whole bf16 step computes is counted in tests/train/test_compute_dtype.py.
"""

from __future__ import annotations

import ast
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from faults import drop_fp32_region
from threads import one_thread
from torch import nn

from moetrain.config import MoEConfig
from moetrain.model import precision as precision_module
from moetrain.model.moe import Router
from moetrain.model.mtp import IGNORE_INDEX, mtp_loss, shifted
from moetrain.model.norm import RMSNorm
from moetrain.model.precision import FP32_REGIONS, Precision
from moetrain.model.rope import apply_rope

BF16 = Precision(torch.bfloat16, "cpu")
ROOT = Path(__file__).resolve().parents[2]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ each region vs fp32


def _router_gate() -> tuple[torch.Tensor, torch.Tensor]:
    """The router's log-sum-exp of its logits (what the z-loss reads; the scores and top-k
    follow from the same logits) under bf16 autocast, and in an fp32 run: the same."""
    torch.manual_seed(0)
    router = Router(16, MoEConfig(num_experts=8, top_k=2, router_bias=True))
    nn.init.normal_(router.gate.bias)
    x_TD = torch.randn(24, 16, generator=_gen())
    with BF16.autocast():
        got = router(x_TD, "torch").lse_T
    return got, router(x_TD, "torch").lse_T


def _norm() -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the fp32 residual stream under bf16 autocast, and in fp32 with its weight
    rounded to bf16 as the policy rounds it: the same (the normalisation is fp32)."""
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=_gen(1)).bfloat16().float())
    x = torch.randn(4, 6, 32, generator=_gen(2))
    with BF16.autocast():
        got = norm(x)
    return got, norm(x)


def _rope() -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated bf16 queries (what a bf16 projection gives) under bf16 autocast, and the
    rotation by hand in fp32, rounded to bf16."""
    x = torch.randn(2, 5, 3, 8, generator=_gen(3)).bfloat16()
    angles = torch.randn(5, 4, generator=_gen(4))
    cos, sin = angles.cos(), angles.sin()
    with BF16.autocast():
        got = apply_rope(x, cos, sin, "half")
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).bfloat16()
    return got, want


def _loss() -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's cross-entropy of bf16 logits (what the head gives under autocast), and
    ``F.cross_entropy`` over the same logits in fp32."""
    from moetrain.train.engine import Engine

    logits = torch.randn(2, 7, 50, generator=_gen(5)).bfloat16()
    labels = torch.randint(0, 50, (2, 7), generator=_gen(6))
    labels[0, 3] = IGNORE_INDEX
    engine = types.SimpleNamespace(_loss_scale=None)  # a mean over the counted labels
    got = Engine._ce(engine, logits, labels)  # type: ignore[arg-type]
    want = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX)  # fmt: skip
    return got, want


def _mtp() -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-token prediction's loss under bf16 autocast, its head's logits bf16, and the
    cross-entropies of the same logits in fp32 by hand (one depth; the block passes its
    input through)."""
    torch.manual_seed(7)
    B, T, D, V = 2, 6, 8, 40
    head, embed = nn.Linear(D, V, bias=False), nn.Embedding(V, D)
    h = torch.randn(B, T, D, generator=_gen(8))
    labels = torch.randint(0, V, (B, T), generator=_gen(9))

    def block(h_BTD, emb_BTD, cos, sin, valid):
        return h_BTD + emb_BTD, h_BTD + emb_BTD

    with BF16.autocast():
        got = mtp_loss([block], h, labels, embed, head, torch.empty(0), torch.empty(0))
        logits = head(h + embed(labels.clamp_min(0)))
    assert logits.dtype == torch.bfloat16
    targets = shifted(labels, 1)
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                         ignore_index=IGNORE_INDEX, reduction="sum")  # fmt: skip
    want = torch.zeros(()) + ce / (B * T)
    return got, want


REGION_CHECKS: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
    "router_gate": _router_gate,
    "norm": _norm,
    "rope": _rope,
    "loss": _loss,
    "mtp": _mtp,
}


def test_every_region_has_a_check() -> None:
    assert set(REGION_CHECKS) == set(FP32_REGIONS)


def _assert_computes_in_fp32(region: str) -> None:
    """The region's result under the policy equals its fp32 reference, bit for bit (both
    sides on the same thread settings)."""
    with one_thread():
        got, want = REGION_CHECKS[region]()
    assert got.dtype == want.dtype, f"{region}: {got.dtype}, the fp32 reference {want.dtype}"
    err = (got.double() - want.double()).abs().max().item()
    assert torch.equal(got, want), f"{region}: {err:.3g} from the fp32 reference"


@pytest.mark.parametrize("region", sorted(FP32_REGIONS))
def test_each_fp32_region_computes_what_fp32_computes(region: str) -> None:
    _assert_computes_in_fp32(region)


@pytest.mark.parametrize("region", sorted(FP32_REGIONS))
def test_a_region_dropped_from_the_policy_is_caught(region: str, monkeypatch) -> None:
    """The planted policy change: ``region`` left out of the registry computes in bf16, and
    the comparison above fails on it."""
    drop_fp32_region(region, monkeypatch.setattr)
    assert region not in precision_module.FP32_REGIONS
    with pytest.raises(AssertionError, match=f"^{region}: "):
        _assert_computes_in_fp32(region)


def test_the_regions_are_the_only_places_autocast_is_left() -> None:
    """Every region of the registry is entered somewhere in the package, every
    ``fp32_region`` names one of the registry, and nothing but the policy enters or leaves
    autocast (``torch.autocast``) in ``moetrain/``."""
    used: dict[str, list[str]] = {}
    autocast: list[str] = []
    for path in sorted((ROOT / "moetrain").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            fn = ast.unparse(node.func)
            if fn.endswith("fp32_region") and rel != "moetrain/model/precision.py":
                first = node.args[0]
                assert isinstance(first, ast.Constant), f"{rel}: {ast.unparse(node)}"
                used.setdefault(first.value, []).append(rel)
            if fn in ("torch.autocast", "torch.amp.autocast") and not rel.endswith(
                "model/precision.py"
            ):
                autocast.append(f"{rel}: {ast.unparse(node)}")
    assert set(used) == set(FP32_REGIONS), used
    assert not autocast, autocast


# ------------------------------------------------------------------ the policy object


def test_the_dtype_is_chosen_once_from_train_dtype_and_the_device() -> None:
    assert Precision.choose("auto", "cuda") == Precision(torch.bfloat16, "cuda")
    assert Precision.choose("auto", "cpu") == Precision(torch.float32, "cpu")
    assert Precision.choose("bf16", "cpu").dtype == torch.bfloat16
    assert Precision.choose("fp32", "cuda").dtype == torch.float32
    assert Precision.choose("bf16", "cpu").mixed and not Precision.choose("fp32", "cpu").mixed
    assert Precision.choose("bf16", "meta").fp32_regions == tuple(FP32_REGIONS)


class _Probe(nn.Module):
    """Records autocast's state in its forward and in its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[tuple[str, bool]] = []

    def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        self.seen.append(("forward", torch.is_autocast_enabled("cpu")))
        if fail:
            raise RuntimeError("planted")
        y = self.lin(x)
        y.register_hook(lambda g: self.seen.append(("backward", torch.is_autocast_enabled("cpu"))))
        return y


def test_wrap_forward_autocasts_the_forward_and_only_it() -> None:
    """The forward's GEMM in bf16, the backward outside autocast, autocast left even when the
    forward raises; an fp32 policy adds nothing."""
    probe = _Probe()
    BF16.wrap_forward(probe)
    x = torch.randn(3, 4, requires_grad=True)
    y = probe(x)
    assert y.dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    y.float().sum().backward()
    assert probe.seen == [("forward", True), ("backward", False)]
    assert x.grad is not None and x.grad.dtype == torch.float32
    with pytest.raises(RuntimeError, match="planted"):
        probe(x, fail=True)
    assert not torch.is_autocast_enabled("cpu")
    plain = _Probe()
    Precision(torch.float32, "cpu").wrap_forward(plain)
    assert not plain._forward_hooks and not plain._forward_pre_hooks
    assert plain(x).dtype == torch.float32


def test_fsdp_policies_gather_blocks_in_bf16_and_routers_and_root_in_fp32() -> None:
    p = BF16.fsdp_policies()
    assert p.blocks.param_dtype == torch.bfloat16
    assert p.root.param_dtype == torch.float32
    assert p.routers is not None and p.routers.param_dtype == torch.float32
    for mp in (p.blocks, p.root, p.routers):
        assert mp.reduce_dtype == torch.float32 and not mp.cast_forward_inputs
    fp32 = Precision(torch.float32, "cpu").fsdp_policies()
    assert fp32.routers is None
    assert fp32.blocks.param_dtype is None and fp32.root.param_dtype is None
