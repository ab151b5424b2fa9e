"""Muon (``optim.name=muon``) against torch.optim.Muon, one expert at a time, and what it
updates.

- 2-D parameters: moetrain's Muon equals ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``
  with the same momentum, coefficients and decay, step after step, to fp32 rounding (it is
  bit-for-bit on this machine); the AdamW half equals ``torch.optim.AdamW``.
- 3-D expert weights (E, A, B): equal to that reference applied to each expert's slice as a
  parameter of its own -- and a planted fault is caught: the expert tensor orthogonalized
  flattened (one (E A) x B matrix), or the momentum applied after the orthogonalization.
- fp32 Newton-Schulz (``optim.muon_ns_dtype=fp32``, which torch's bf16-only reference
  cannot run) against the iteration written out in float64 per matrix; the quintic's
  fixed point checked on the singular values.
- bf16 momentum buffers (``optim.moments_dtype=bf16``): torch's Muon with its buffer rounded
  to bf16 after every step.
- Which parameters Muon takes in the real model, and the FLOPs ``ns_flops`` states against
  torch's FLOP counter.
- The AdamW-vs-Muon sweep docs/optim.md quotes compares equal tokens, and its summary is its
  runs' own; the same sweep made small (tests/train/sweep_records.py), rerun through the
  sweep runner, equals its committed record, and a changed optimizer breaks it.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from sweep_records import differences, load, missing, rerun
from torch import nn

from moetrain.config import ConfigError, OptimConfig, load_config
from moetrain.model.experts import GroupedExperts
from moetrain.train import muon as muon_module
from moetrain.train.muon import NS_COEFFICIENTS, newton_schulz, ns_flops
from moetrain.train.optim import build_optimizer

pytestmark = pytest.mark.timeout(120)

LR, WD, MOMENTUM = 2e-2, 0.1, 0.95
FP32_ROUNDING = 1e-6
"""Largest difference from the reference allowed, relative to the tensor's largest element:
a few fp32 ulps (measured: 0, bit for bit)."""


class Net(nn.Module):
    """A hidden linear with a bias (a tall matrix: transposed inside Newton-Schulz), a wide
    one, and routed experts: (E, A, B) tensors, with their (E, F) biases."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(12, 20)  # weight 20 x 12, bias
        self.down = nn.Linear(20, 12, bias=False)  # 12 x 20
        self.moe = GroupedExperts(3, 12, 8, top_k=1, bias=True)  # w1, w3 (3, 12, 8); w2 (3, 8, 12)


MATRICES = ("up.weight", "down.weight")
EXPERTS = ("moe.w1", "moe.w3", "moe.w2")
ADAM = ("up.bias", "moe.b1", "moe.b3", "moe.b2")


def _cfg(**kw) -> OptimConfig:
    return OptimConfig(name="muon", lr=LR, weight_decay=WD, muon_momentum=MOMENTUM, **kw)


def _set_grads(net: Net, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for _, p in sorted(net.named_parameters()):
        p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** (step % 3 - 1)


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _ours(cfg: OptimConfig, steps: int, seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    net = _net(seed)
    opt = build_optimizer(net, cfg)
    for step in range(steps):
        _set_grads(net, step)
        opt.step()
    return net, opt


def _reference(steps: int, seed: int = 0, round_buffers: bool = False) -> dict[str, torch.Tensor]:
    """torch.optim.Muon on the matrices, each expert's slice a parameter of its own; torch's
    AdamW on the biases (the (E, F) ones decayed, as moetrain's AdamW decays every >= 2-D
    parameter); the same gradients."""
    net = _net(seed)
    params = dict(net.named_parameters())
    slices = {n: [nn.Parameter(e.detach().clone()) for e in params[n]] for n in EXPERTS}
    matrices = [params[n] for n in MATRICES] + [e for n in EXPERTS for e in slices[n]]
    muon = torch.optim.Muon(
        matrices,
        lr=LR,
        weight_decay=WD,
        momentum=MOMENTUM,
        ns_coefficients=NS_COEFFICIENTS,
        adjust_lr_fn="match_rms_adamw",
    )
    # Every AdamW parameter here is a bias: none decays, the experts' (E, F) ones included.
    adam = torch.optim.AdamW([params[n] for n in ADAM], lr=LR, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=0.0)  # fmt: skip
    for step in range(steps):
        _set_grads(net, step)
        for n in EXPERTS:
            for e, g in zip(slices[n], params[n].grad, strict=True):
                e.grad = g.clone()
        muon.step()
        adam.step()
        if round_buffers:
            with torch.no_grad():
                for st in muon.state.values():
                    st["momentum_buffer"].copy_(st["momentum_buffer"].bfloat16().float())
    out = {n: params[n].detach() for n in (*MATRICES, *ADAM)}
    out.update({n: torch.stack([e.detach() for e in slices[n]]) for n in EXPERTS})
    out.update({f"{n}.buffer": muon.state[params[n]]["momentum_buffer"] for n in MATRICES})
    out.update({f"{n}.buffer": torch.stack([muon.state[e]["momentum_buffer"] for e in slices[n]])
                for n in EXPERTS})  # fmt: skip
    return out


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max())


def _errors(net: Net, ref: dict[str, torch.Tensor], opt=None) -> dict[str, float]:
    params = dict(net.named_parameters())
    out = {n: _max_rel(params[n], ref[n]) for n in (*MATRICES, *EXPERTS, *ADAM)}
    if opt is not None:
        for n in (*MATRICES, *EXPERTS):
            buf = opt.state[params[n]]["momentum_buffer"]
            out[f"{n}.buffer"] = _max_rel(buf, ref[f"{n}.buffer"])
    return out


def test_groups_and_hyperparameters_reach_the_optimizer() -> None:
    net = Net()
    params = dict(net.named_parameters())
    opt = build_optimizer(net, _cfg(muon_ns_steps=4, muon_update_rms=0.3))
    decay, no_decay, matrices = opt.param_groups
    ids = lambda names: {id(params[n]) for n in names}  # noqa: E731
    assert {id(p) for p in matrices["params"]} == ids((*MATRICES, *EXPERTS))
    assert not decay["params"]  # biases of any shape are not decayed
    assert {id(p) for p in no_decay["params"]} == ids(("up.bias", "moe.b1", "moe.b3", "moe.b2"))
    assert matrices["muon"] and matrices["momentum"] == MOMENTUM and matrices["ns_steps"] == 4
    assert matrices["update_rms"] == 0.3 and matrices["weight_decay"] == WD
    assert matrices["ns_dtype"] == "bf16" and no_decay["weight_decay"] == 0.0
    # AdamW keeps its two groups, nothing else.
    assert len(build_optimizer(net, OptimConfig()).param_groups) == 2


def test_matrices_equal_torch_muon_and_each_expert_equals_it_on_its_slice() -> None:
    steps = 4
    net, opt = _ours(_cfg(), steps)
    ref = _reference(steps)
    errors = _errors(net, ref, opt)
    assert max(errors.values()) <= FP32_ROUNDING, errors
    # The parameters moved: the comparison is not between two untouched copies.
    assert _max_rel(_net(0).moe.w1, ref["moe.w1"]) > 1e-2


def _flattened(x: torch.Tensor, steps: int, dtype=torch.bfloat16, eps: float = 1e-7):
    """Planted: a 3-D expert tensor orthogonalized as one (E A) x B matrix."""
    if x.ndim == 3:
        return _ORIGINAL_NS(x.reshape(-1, x.size(-1)), steps, dtype, eps).view_as(x)
    return _ORIGINAL_NS(x, steps, dtype, eps)


_ORIGINAL_NS = newton_schulz


def _momentum_after(grads, bufs, momentum, orthogonalize):
    """Planted: Newton-Schulz on the raw gradient, the momentum applied to its result."""
    ortho = orthogonalize(list(grads))
    return [muon_module.momentum_update(b, o.float(), momentum) for b, o in
            zip(bufs, ortho, strict=True)]  # fmt: skip


@pytest.mark.parametrize(
    "attr, fault, caught",
    [
        ("newton_schulz", _flattened, EXPERTS),
        ("muon_directions", _momentum_after, (*MATRICES, *EXPERTS)),
    ],
    ids=["expert orthogonalized flattened", "momentum after orthogonalization"],
)
def test_a_planted_fault_is_caught(monkeypatch: pytest.MonkeyPatch, attr, fault, caught) -> None:
    monkeypatch.setattr(muon_module, attr, fault)
    net, _ = _ours(_cfg(), 4)
    errors = _errors(net, _reference(4))
    for name in caught:
        assert errors[name] > 100 * FP32_ROUNDING, (name, errors)


def _ns_float64(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic iteration written out for one matrix in float64."""
    a, b, c = NS_COEFFICIENTS
    tall = x.shape[0] > x.shape[1]
    X = (x.T if tall else x).double()
    X = X / max(float(torch.linalg.matrix_norm(X)), 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


@pytest.mark.parametrize("shape", [(3, 20, 12), (2, 12, 20), (1, 16, 16)])
def test_fp32_newton_schulz_is_the_iteration_and_orthogonalizes(shape) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    got = newton_schulz(x, 5, torch.float32)
    assert got.dtype == torch.float32 and got.shape == x.shape
    for e in range(shape[0]):
        want = _ns_float64(x[e], 5)
        assert _max_rel(got[e], want) <= 1e-5, e
        # The quintic maps every singular value into about [0.7, 1.2], not onto 1.
        s = torch.linalg.svdvals(got[e].double())
        assert 0.6 < float(s.min()) and float(s.max()) < 1.25, s
    # bf16 (the reference's dtype) is the same iteration, rounded.
    assert _max_rel(newton_schulz(x, 5).float(), got) < 0.05


def test_bf16_momentum_is_torch_muon_with_its_buffer_rounded_each_step() -> None:
    steps = 4
    net, opt = _ours(_cfg(moments_dtype="bf16"), steps)
    ref = _reference(steps, round_buffers=True)
    # (AdamW's bf16 moments have their test: tests/train/test_optim.py)
    errors = {k: v for k, v in _errors(net, ref, opt).items() if not k.startswith(ADAM)}
    assert max(errors.values()) <= FP32_ROUNDING, errors
    buf = opt.state[net.up.weight]["momentum_buffer"]
    assert buf.dtype == torch.bfloat16 and net.up.weight.dtype == torch.float32
    assert torch.equal(buf.float(), ref["up.weight.buffer"])
    # The check can fail: unrounded buffers end elsewhere.
    assert not torch.equal(buf.float(), _reference(steps)["up.weight.buffer"])


def test_ns_flops_is_what_the_matmuls_count() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    for shape in [(20, 12), (3, 12, 20), (4, 8, 8)]:
        with FlopCounterMode(display=False) as counter:
            newton_schulz(torch.randn(shape), 5, torch.float32)
        assert counter.get_total_flops() == ns_flops(shape, 5), shape
    m, n = 12, 20
    assert ns_flops((n, m), 1) == 4 * m * m * n + 2 * m**3


def _model(*overrides: str):
    from moetrain.model import Transformer

    cfg = load_config(None, ["model.vocab_size=64", "model.dim=32", "model.n_layers=2",
                             "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64",
                             "moe.num_experts=4", "moe.expert_ffn_dim=16", *overrides])  # fmt: skip
    return Transformer(cfg.model, cfg.moe)


def _names(model: nn.Module, cfg: OptimConfig) -> set[str]:
    chosen = muon_module.muon_matrices(model, cfg)
    return {n for n, p in model.named_parameters() if id(p) in chosen}


def test_muon_takes_the_hidden_matrices_and_each_choice_is_a_key() -> None:
    model = _model("model.tie_embeddings=false", "moe.num_shared_experts=1",
                   "moe.shared_expert_gate=true", "moe.router_bias=true",
                   "moe.expert_ffn_bias=true", "model.qkv_bias=true", "model.mtp_depth=1",
                   "model.qk_norm=head")  # fmt: skip
    names = _names(model, _cfg())
    want = set()
    for i in range(3):  # two layers and the multi-token-prediction block
        want |= {f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        want |= {f"layers.{i}.ffn.experts.{w}" for w in ("w1", "w3", "w2")}
        want |= {f"layers.{i}.ffn.shared_experts.{w}.weight" for w in ("w1", "w3", "w2")}
    want.add("layers.2.eh_proj.weight")
    assert names == want, (names - want, want - names)
    # Each of the choices Moonlight makes is a key.
    assert _names(model, _cfg(muon_embedding=True)) - names == {"tok_embeddings.weight"}
    assert _names(model, _cfg(muon_output=True)) - names == {"output.weight"}
    gates = {f"layers.{i}.ffn.{g}.weight" for i in range(3)
             for g in ("router.gate", "shared_expert_gate")}  # fmt: skip
    assert _names(model, _cfg(muon_router=True)) - names == gates
    # A tied embedding is the embedding: the output key alone leaves it to AdamW.
    tied = _model("model.tie_embeddings=true")
    assert "tok_embeddings.weight" not in _names(tied, _cfg(muon_output=True))
    assert "tok_embeddings.weight" in _names(tied, _cfg(muon_embedding=True))


def test_muon_keys_are_validated_and_named() -> None:
    for kw, match in [
        ({"name": "adamw", "muon_momentum": 0.9}, r"^optim\.muon_momentum: 0\.9 is a Muon"),
        ({"name": "sgd"}, r"^optim\.name: expected adamw or muon"),
        ({"muon_momentum": 1.0}, r"^optim\.muon_momentum: must be in \[0, 1\)"),
        ({"muon_ns_steps": 0}, r"^optim\.muon_ns_steps: must be in \[1, 99\]"),
        ({"muon_update_rms": 0.0}, r"^optim\.muon_update_rms: must be > 0"),
        ({"moments_dtype": "bf16", "muon_momentum": 0.995}, r"^optim\.muon_momentum: 0\.995 "),
    ]:
        cfg = OptimConfig(**{"name": "muon", **kw})
        with pytest.raises(ConfigError, match=match):
            cfg.validate()
    _cfg().validate()
    OptimConfig().validate()


def test_update_rms_is_about_the_key() -> None:
    """The Moonlight scaling: a fresh step's update of an A x B matrix has RMS about
    ``muon_update_rms`` (the orthogonalized matrix's singular values are about 1)."""
    p = nn.Parameter(torch.zeros(64, 32))
    opt = build_optimizer(nn.ModuleDict({"l": nn.Linear(32, 64, bias=False)}), _cfg())
    opt.param_groups[2]["params"] = [p]
    p.grad = torch.randn(64, 32)
    opt.step()
    rms = float(p.detach().pow(2).mean().sqrt()) / LR
    assert 0.15 < rms < 0.25, rms
    assert math.isclose(opt.param_groups[2]["update_rms"], 0.2)


SWEEP = Path(__file__).resolve().parents[2] / "docs" / "data" / "sweeps"
SWEEP_VARIANTS = ("adamw", "muon-lr-3e-3", "muon-lr-1e-2", "muon-lr-1e-3", "adamw-lr-1e-2",
                  "adamw-lr-1e-3", "muon-lr-3e-2")  # fmt: skip


def _sweep_rows(name: str) -> list[dict[str, str]]:
    with (SWEEP / name).open(newline="") as f:
        return list(csv.DictReader(f))


def test_the_sweep_compares_equal_tokens_and_its_summary_is_its_runs_own() -> None:
    """configs/sweeps/optim.yaml's committed outputs (docs/data/sweeps/optim_*.csv, the sweep's
    ``summary.csv``, ``results.csv`` and ``curves.csv``, which docs/optim.md quotes): every
    variant trained 3 seeds of the same 300 steps and tokens, and the summary's paired
    differences from AdamW are the runs' own."""
    from moetrain.ablation.stats import difference_interval

    summary = {r["run"]: r for r in _sweep_rows("optim_summary.csv")}
    runs = _sweep_rows("optim_runs.csv")
    assert tuple(summary) == SWEEP_VARIANTS and summary["adamw"]["baseline"] == "true"
    assert len(runs) == 3 * len(SWEEP_VARIANTS) and {int(r["steps"]) for r in runs} == {300}
    assert {int(float(r["tokens"])) for r in summary.values()} == {300 * 8 * 128}
    eval_loss = {(r["run"], int(r["seed"])): float(r["eval_loss"]) for r in runs}
    for run in SWEEP_VARIANTS[1:]:
        row = summary[run]
        assert row["n"] == "3" and row["optim.name"] == run.split("-")[0]
        d = difference_interval({s: eval_loss[run, s] for s in range(3)},
                                {s: eval_loss["adamw", s] for s in range(3)})  # fmt: skip
        assert float(row["eval_loss_diff_mean"]) == pytest.approx(d.mean, abs=1e-12)
        assert (float(row["eval_loss_diff_lo"]), float(row["eval_loss_diff_hi"])) == (
            pytest.approx(d.lo, abs=1e-12), pytest.approx(d.hi, abs=1e-12))  # fmt: skip
    curves = _sweep_rows("optim_curves.csv")
    assert {r["run"] for r in curves} == set(SWEEP_VARIANTS)


REGENERATE = "python tests/train/sweep_records.py"


@pytest.fixture(scope="module")
def optim_sweep(tmp_path_factory) -> dict:
    return rerun("optim", tmp_path_factory.mktemp("optim_sweep"))


def test_a_small_optim_sweep_reruns_to_its_record(optim_sweep) -> None:
    """The committed sweep's CSVs above cannot change when the optimizers do; this can. The
    same comparison made small (tests/train/sweep_records.py: AdamW against Muon, two seeds,
    4 steps) runs through ``moetrain ablate``'s runner, and every eval loss of results.csv and
    train-loss mean and paired difference of curves.csv equals the committed record's (bit
    for bit in its environment, within ``BOUND`` elsewhere)."""
    want = load("optim")
    assert not missing(optim_sweep, want), missing(optim_sweep, want)
    diffs = differences(optim_sweep, want)
    assert not diffs, "\n".join(diffs) + (
        f"\nIf the optimizers' arithmetic changed on purpose: {REGENERATE} optim, and say why "
        "in the commit.")  # fmt: skip


def test_a_changed_optimizer_breaks_the_sweep_record(monkeypatch, tmp_path) -> None:
    """tests/faults.py ``muon_plain_momentum`` (heavy-ball momentum instead of Nesterov's),
    Muon's runs rerun and judged as above: its first update is the same (both directions
    are the first gradient's), the third step's train loss and both eval losses are not."""
    from faults import plant

    plant("muon_plain_momentum", monkeypatch.setattr)
    got = rerun("optim", tmp_path, variants=("muon",))
    keys = [d.split(":")[0] for d in differences(got, load("optim"))]
    assert keys[:2] == ["results muon/seed_0 eval_loss", "results muon/seed_1 eval_loss"], keys
    assert "curves muon step 3 train_loss_mean" in keys, keys
    assert "curves muon step 1 train_loss_mean" not in keys, keys
