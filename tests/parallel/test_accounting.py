"""Accounting against the analytic figures: model-state bytes per rank within 5% of the ZeRO
formula, bytes sent within 2% of the analytic volume for DDP, ZeRO-1/2/3, TP (with and without
SP, dense and with MoE layers), PP and CP; activation bytes per rank under CP within 5% of
the analytic scaling (1/cp of everything but the whole sequence's keys and values, measured
against the cp = 1 run of the same per-rank micro-batch). Each layout takes one warm-up step
(Adam states exist), then one measured step; one micro-batch per data-parallel rank, as the
formulas assume.

The measured ratios are also the figures the docs quote: ``docs/accounting.md`` is written
from them (``MOETRAIN_UPDATE_DOCS=1``) and ``test_accounting_page_is_current`` fails when a
figure there is not what this file measures, so the page cannot go stale unnoticed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from multirank import micro_config, run_ranks

MEMORY_TOL = 0.05
BYTES_TOL = 0.02
PAGE = Path(__file__).resolve().parents[2] / "docs" / "accounting.md"

# name -> overrides of the micro config (tests/multirank.py), 2 ranks each.
DP_LAYOUTS = {
    f"ZeRO-{z}, dp=2": [f"parallel.zero_stage={z}", "train.global_batch_size=4"] for z in range(4)
}
# Lean optimizer state beside the fp32 rows above, and FP8's saved activations beside the
# same bf16 run without it (2 ranks, ZeRO-0, one micro-batch of 2 sequences per rank).
LEAN_LAYOUTS = {
    f"ZeRO-{z}, dp=2, bf16 moments": [
        f"parallel.zero_stage={z}", "train.global_batch_size=4", "optim.moments_dtype=bf16"]
    for z in (0, 3)
}  # fmt: skip
# Muon's one momentum buffer on its matrices (fp32, and bf16 under optim.moments_dtype).
MUON_LAYOUTS = {
    f"ZeRO-{z}, dp=2, Muon{extra}": [
        f"parallel.zero_stage={z}", "train.global_batch_size=4", "optim.name=muon", *over]
    for z, extra, over in ((0, "", []), (0, " + bf16 moments", ["optim.moments_dtype=bf16"]),
                           (3, "", []))
}  # fmt: skip
FP8_LAYOUTS = {
    "bf16, dp=2": ["train.dtype=bf16", "train.global_batch_size=4"],
    "bf16 + FP8 rowwise, dp=2": ["train.dtype=bf16", "train.global_batch_size=4",
                                 "train.fp8=rowwise"],
}  # fmt: skip
TP_LAYOUTS = {
    "TP=2 + SP, dense": [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "moe.num_experts=0",
        "train.global_batch_size=2",
    ],
    "TP=2 + SP, MoE": [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "train.global_batch_size=2",
    ],
    "TP=2, MoE": ["parallel.tp=2", "train.global_batch_size=2"],
}
PP_LAYOUTS = {
    "PP=2, 1F1B, 4 micro-batches": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "PP=2, ZB-V (V placement), 4 micro-batches": [
        "parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2"],
}  # fmt: skip
# Context parallelism, each beside its cp = 1 baseline: the same world as data parallelism,
# the same micro-batch of 2 whole sequences per rank (so twice the global batch per cp).
CP_LAYOUTS = {
    "CP=2": (["parallel.cp=2", "train.global_batch_size=2"], ["train.global_batch_size=4"]),
    "CP=2, full AC": (
        ["parallel.cp=2", "train.global_batch_size=2", "parallel.activation_checkpointing=full"],
        ["train.global_batch_size=4", "parallel.activation_checkpointing=full"],
    ),
}
CP4_LAYOUTS = {
    "CP=4": (["parallel.cp=4", "train.global_batch_size=2"], ["train.global_batch_size=8"]),
    "CP=2 x DP=2": (
        ["parallel.cp=2", "train.global_batch_size=4"], ["train.global_batch_size=8"]),
}  # fmt: skip


def _measure_worker(rank: int, world_size: int, layouts: list[list[str]]) -> list[dict]:
    from moetrain.parallel.accounting import analytic_sent, layer_counts, measure_step, step_figures
    from moetrain.train.trainer import Trainer

    out = []
    for overrides in layouts:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(micro_config(tmp, "train.steps=2", *overrides))
            trainer.train_step()
            report = measure_step(trainer)
            figures = step_figures(trainer, report)
            counts = layer_counts(trainer.engine.parts)
            # The same layers priced as if every one were dense: what the MoE branch of the
            # tensor-parallel formula must differ from for the comparison to mean anything.
            as_dense = {**counts, "dense": counts["dense"] + counts["moe"], "moe": 0}
            figures["analytic_as_dense"] = analytic_sent(
                trainer.cfg, trainer.dims, report.params_per_rank, as_dense
            )
            out.append(figures)
            trainer.close()
    return out


def _tp_sent(res: dict, sequence_parallel: bool) -> float:
    """Tensor-parallel bytes: all-gathers + reduce-scatters + all-reduces with SP (expert TP
    all-reduces even under SP), all-reduces without."""
    kinds = ("all_gather", "reduce_scatter", "all_reduce") if sequence_parallel else ("all_reduce",)
    return sum(res["sent"].get(k, 0.0) for k in kinds)


def _with_baselines(layouts: dict[str, tuple[list[str], list[str]]]) -> dict[str, list[str]]:
    out = {}
    for name, (cp, baseline) in layouts.items():
        out[name] = cp
        out[f"{name} (cp=1 baseline)"] = baseline
    return out


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict]]:
    """Layout name -> every rank's measurement."""
    out: dict[str, list[dict]] = {}
    for world, layouts in (
        (2, {**DP_LAYOUTS, **LEAN_LAYOUTS, **MUON_LAYOUTS, **FP8_LAYOUTS}),
        (2, {**TP_LAYOUTS, **PP_LAYOUTS, **_with_baselines(CP_LAYOUTS)}),
        (4, _with_baselines(CP4_LAYOUTS)),
    ):
        results = run_ranks(_measure_worker, world, list(layouts.values()), timeout=280)
        for i, name in enumerate(layouts):
            out[name] = [results[rank][i] for rank in range(world)]
    return out


def _rows(measured: dict[str, list[dict]]) -> list[tuple[str, float, float, str]]:
    """(layout, model state / formula, bytes sent / analytic, what was counted) per layout,
    rank 0's figures except for PP, whose sends are summed over both ranks."""
    rows = []
    for name in DP_LAYOUTS:
        r = measured[name][0]
        sent = sum(r["sent"].values())
        rows.append((name, r["memory"] / r["formula"], sent / r["analytic"]["dp"], "all of it"))
    for name, overrides in TP_LAYOUTS.items():
        r = measured[name][0]
        sp = "parallel.sequence_parallel=true" in overrides
        counted = "all-gathers + reduce-scatters + all-reduces" if sp else "all-reduces"
        rows.append(
            (name, r["memory"] / r["formula"], _tp_sent(r, sp) / r["analytic"]["tp"], counted)
        )
    for name in PP_LAYOUTS:
        r0 = measured[name][0]
        sends = sum(r["sent"].get("send", 0.0) for r in measured[name])
        rows.append(
            (
                name,
                r0["memory"] / r0["formula"],
                sends / r0["analytic"]["pp_all_ranks"],
                "sends, both ranks",
            )
        )
    for name in [*CP_LAYOUTS, *CP4_LAYOUTS]:
        r = measured[name][0]
        rows.append(
            (
                name,
                r["memory"] / r["formula"],
                _cp_sent(r) / r["analytic"]["cp"],
                "all-gathers + reduce-scatters on the cp group",
            )
        )
    return rows


def _cp_sent(res: dict) -> float:
    return sum(res["sent_cp"].get(k, 0.0) for k in ("all_gather", "reduce_scatter"))


def _activation_rows(measured: dict[str, list[dict]]) -> list[tuple[str, float, float, float]]:
    """(layout, activations / analytic, activations / the cp=1 baseline's, 1/cp) per CP
    layout, rank 0: analytic (A_1 - KV_1)/cp + KV_cp (``analytic_cp_activations``)."""
    from moetrain.parallel.accounting import analytic_cp_activations

    rows = []
    for name in [*CP_LAYOUTS, *CP4_LAYOUTS]:
        r, base = measured[name][0], measured[f"{name} (cp=1 baseline)"][0]
        analytic = analytic_cp_activations(base["activations"], base["kv"], r["cp"], r["kv"])
        rows.append(
            (name, r["activations"] / analytic, r["activations"] / base["activations"], 1 / r["cp"])
        )
    return rows


def _lean_rows(measured: dict[str, list[dict]]) -> list[tuple[str, float, float, float]]:
    """(layout, optimizer bytes per parameter read from the state, measured model-state bytes
    per parameter, model state / formula) for the fp32-moment ZeRO-0/3 rows and their bf16
    twins, rank 0."""
    rows = []
    for name in (*(f"ZeRO-{z}, dp=2" for z in (0, 3)), *LEAN_LAYOUTS):
        r = measured[name][0]
        rows.append((name, r["optim_bytes"], r["memory"] / r["params"], r["memory"] / r["formula"]))
    return rows


def _muon_rows(measured: dict[str, list[dict]]) -> list[tuple[str, ...]]:
    """(layout, optimizer bytes per parameter: all, Muon's matrices, the rest; model-state
    bytes per parameter; model state / formula), rank 0, beside the AdamW ZeRO-0/3 rows."""
    rows = []
    for name in (*(f"ZeRO-{z}, dp=2" for z in (0, 3)), *MUON_LAYOUTS):
        r = measured[name][0]
        rows.append((name, r["optim_bytes"], r["optim_bytes_muon"], r["optim_bytes_rest"],
                     r["memory"] / r["params"], r["memory"] / r["formula"]))  # fmt: skip
    return rows


def _fp8_rows(measured: dict[str, list[dict]]) -> list[tuple[str, float, float]]:
    """(run, saved activation bytes on rank 0, / the bf16 run's)."""
    base = measured["bf16, dp=2"][0]["activations"]
    return [(n, measured[n][0]["activations"], measured[n][0]["activations"] / base)
            for n in FP8_LAYOUTS]  # fmt: skip


def render_page(
    rows: list[tuple[str, float, float, str]],
    activations: list[tuple[str, float, float, float]] = (),
    lean: list[tuple[str, float, float, float]] = (),
    fp8: list[tuple[str, float, float]] = (),
    muon: list[tuple[str, ...]] = (),
) -> str:
    lines = [
        "# Accounting: measured against the formulas",
        "",
        "Written by `tests/parallel/test_accounting.py` from what it measures; the test fails",
        "when a figure here is not what it measures. To rewrite this page after a change:",
        "`MOETRAIN_UPDATE_DOCS=1 python -m pytest tests/parallel/test_accounting.py`.",
        "",
        "The micro MoE of `tests/multirank.py` (4 layers, dim 64, 4 experts top-2, a shared",
        "expert), 2 ranks, fp32 on CPU, one warm-up step then one measured step, one",
        "micro-batch per data-parallel rank. Model state is rank 0's peak of parameters,",
        "gradients and optimizer states against the ZeRO formula (fp32: DDP 16 bytes per",
        "parameter, ZeRO-1 8 + 8/N, ZeRO-2 4 + 12/N, ZeRO-3 16/N); bytes sent follow ring",
        "conventions against the analytic volume of the layout's axis",
        "([parallel.md](parallel.md), section Accounting).",
        "",
        "| layout | model state / formula | bytes sent / analytic | bytes counted |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n} | {m:.4f} | {b:.4f} | {what} |" for n, m, b, what in rows]
    lines += [
        "",
        "CP rows: 2 sequences of 32 positions per rank split over cp (2 or 4 ranks; CP=2 x DP=2",
        "on 4), bytes against the whole sequence's keys and values gathered forward and",
        "reduce-scattered backward per attention layer plus the MoE routing decisions",
        "gathered per MoE layer (again when recomputed).",
        "",
        "## Activations under context parallelism",
        "",
        "Peak bytes of the tensors autograd keeps for backward on rank 0 during the measured",
        "step (`SavedActivations`: parameters left out), against the same micro-batch of",
        "whole sequences on one rank (the cp = 1 baseline: data parallelism over the same",
        "world, the global batch x cp). Analytic: everything scales with the tokens a rank",
        "holds except the whole sequence's keys and values that attention keeps (and its",
        "causal mask): (A_1 - KV_1)/cp + KV_cp; with activation checkpointing nothing of",
        "attention is kept, so 1/cp.",
        "",
        "| layout | activations / analytic | activations / cp = 1 | 1/cp |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n} | {a:.4f} | {b:.4f} | {c:.4f} |" for n, a, b, c in activations]
    lines += [
        "",
        "## Lean optimizer state and FP8 activations",
        "",
        "AdamW's moments in bf16 (`optim.moments_dtype=bf16`, [fp8.md](fp8.md)): the optimizer",
        "bytes per parameter are read from the optimizer's real state",
        "(`optimizer_state_bytes_per_param`, the formula's O), the model state measured as",
        "above. fp32 master weights and gradients are kept: DDP's 16 bytes become 12, ZeRO-3's",
        "16/N become 12/N.",
        "",
        "| layout | optimizer bytes / parameter | model state bytes / parameter "
        "| model state / formula |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n} | {o:.2f} | {b:.2f} | {f:.4f} |" for n, o, b, f in lean]
    lines += [
        "",
        "Muon (`optim.name=muon`, [optim.md](optim.md)) keeps one momentum buffer per matrix it",
        "updates instead of AdamW's two moments: 4 bytes per parameter (2 in bf16), so those",
        "parameters hold 12 bytes of model state under ZeRO-0 instead of 16 (10 with bf16",
        "moments), divided by N under ZeRO-3. The rest of the model (embedding, output head,",
        "router gates, norms, biases) keeps AdamW's 8 (4): the micro MoE's average is between.",
        "Read from the optimizers' real state, the model state measured as above.",
        "",
        "| layout | optimizer bytes / parameter | Muon's matrices | the rest (AdamW) "
        "| model state bytes / parameter | model state / formula |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {o:.2f} | {f'{m:.2f}' if 'Muon' in n else '-'} | {r:.2f} | {b:.2f} "
              f"| {f:.4f} |" for n, o, m, r, b, f in muon]  # fmt: skip
    lines += [
        "",
        "Saved activations (`SavedActivations`, rank 0, parameters left out) of one bf16",
        "micro-batch of 2 sequences of 32 tokens, without and with FP8 (`train.fp8=rowwise`):",
        "an FP8 linear or expert GEMM keeps its input as e4m3 plus a scale per token instead",
        "of the bf16 input and autocast's bf16 copy of the weight.",
        "",
        "| run | saved activations (bytes) | / bf16 |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {a:,.0f} | {r:.4f} |" for n, a, r in fp8]
    return "\n".join(lines) + "\n"


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_zero_memory_and_dp_bytes_match_the_formulas(measured) -> None:
    for name, mem, sent, _ in _rows(measured)[: len(DP_LAYOUTS)]:
        line = f"{name}: memory / formula {mem:.4f}, bytes sent / analytic {sent:.4f}"
        assert abs(mem - 1) <= MEMORY_TOL, line
        assert abs(sent - 1) <= BYTES_TOL, line


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_bf16_moments_halve_the_optimizer_state_as_read_from_the_real_state(measured) -> None:
    """The formula's optimizer bytes come from the state's dtypes: 8 with fp32 moments, 4
    with bf16 ones, and the measured model state follows (4 bytes a parameter less under
    ZeRO-0, 4/N under ZeRO-3)."""
    lean = {name: (o, b, f) for name, o, b, f in _lean_rows(measured)}
    for z, shards in ((0, 1), (3, 2)):
        fp32, bf16 = lean[f"ZeRO-{z}, dp=2"], lean[f"ZeRO-{z}, dp=2, bf16 moments"]
        assert (fp32[0], bf16[0]) == (8.0, 4.0)
        assert abs(bf16[2] - 1) <= MEMORY_TOL, (z, bf16)
        assert abs((fp32[1] - bf16[1]) - 4 / shards) <= MEMORY_TOL * 16 / shards, (fp32, bf16)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_muon_keeps_one_buffer_per_matrix_as_read_from_the_real_state(measured) -> None:
    """Muon's matrices hold 4 bytes of optimizer state per parameter (2 with bf16 moments),
    the rest AdamW's 8 (4); the formula, fed the measured average, matches the model state."""
    for name, _, on_muon, rest, _, vs_formula in _muon_rows(measured):
        if "Muon" not in name:
            continue
        bf16 = "bf16" in name
        assert (on_muon, rest) == ((2.0, 4.0) if bf16 else (4.0, 8.0)), name
        assert abs(vs_formula - 1) <= MEMORY_TOL, (name, vs_formula)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_fp8_keeps_fewer_activation_bytes(measured) -> None:
    (_, _, base), (_, _, fp8) = _fp8_rows(measured)
    assert base == 1.0 and fp8 < 0.9, fp8


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_tp_bytes_match_the_formula_with_and_without_moe_layers(measured) -> None:
    for name, overrides in TP_LAYOUTS.items():
        res = measured[name][0]
        sp = "parallel.sequence_parallel=true" in overrides
        sent = _tp_sent(res, sp)
        ratio = sent / res["analytic"]["tp"]
        assert abs(ratio - 1) <= BYTES_TOL, (name, ratio, res["sent"], res["analytic"])
        if res["moe_layers"]:
            # The MoE branch is what is being checked: priced as dense layers, the same
            # traffic would be far off the formula.
            as_dense = sent / res["analytic_as_dense"]["tp"]
            assert abs(as_dense - 1) > 5 * BYTES_TOL, (name, as_dense)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_pp_bytes_match_the_formula(measured) -> None:
    for name, _, sent, _ in _rows(measured)[-len(PP_LAYOUTS) :]:
        assert abs(sent - 1) <= BYTES_TOL, (name, sent, measured[name])


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_cp_bytes_match_the_formula(measured) -> None:
    for name in [*CP_LAYOUTS, *CP4_LAYOUTS]:
        r = measured[name][0]
        ratio = _cp_sent(r) / r["analytic"]["cp"]
        assert abs(ratio - 1) <= BYTES_TOL, (name, ratio, r["sent_cp"], r["analytic"])


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_cp_activations_scale_as_the_formula(measured) -> None:
    """Activation bytes per rank under cp within 5% of (A_1 - KV_1)/cp + KV_cp -- and far
    from A_1 itself, so a cp that kept whole sequences would fail."""
    for name, vs_analytic, vs_base, inverse in _activation_rows(measured):
        assert abs(vs_analytic - 1) <= MEMORY_TOL, (name, vs_analytic)
        assert vs_base < 1 - 0.3 * (1 - inverse), (name, vs_base)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_accounting_page_is_current(measured) -> None:
    page = render_page(
        _rows(measured),
        _activation_rows(measured),
        _lean_rows(measured),
        _fp8_rows(measured),
        _muon_rows(measured),
    )
    if os.environ.get("MOETRAIN_UPDATE_DOCS") == "1":
        PAGE.write_text(page)
    current = PAGE.read_text() if PAGE.exists() else ""
    assert current == page, (
        f"{PAGE} does not hold the figures measured now; rewrite it with "
        "MOETRAIN_UPDATE_DOCS=1 python -m pytest tests/parallel/test_accounting.py\n"
        f"measured:\n{page}"
    )


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_expert_flops_per_rank_match_the_analytic_figure_and_expert_tp_halves_them() -> None:
    """Dropless routing, so every assignment is computed: under tp=2 with expert tensor
    parallelism (the default) each rank computes half of every expert -- measured from the
    rows its experts received -- exactly the analytic figure; with the experts replicated
    over tp each rank computes all of them, twice as much."""
    common = ["moe.capacity_factor=null", "parallel.tp=2", "train.global_batch_size=2"]
    split, whole = run_ranks(
        _measure_worker, 2, [common, [*common, "parallel.expert_tp=false"]], timeout=280
    )[0]
    for res in (split, whole):
        assert res["expert_flops"] == pytest.approx(res["expert_flops_analytic"], rel=1e-12)
    assert whole["expert_flops"] == pytest.approx(2 * split["expert_flops"], rel=1e-12)


def test_optimizer_state_bytes_come_from_the_state_or_the_declared_moments_dtype() -> None:
    """Before a step (no state yet: what the planner sees on the meta device) from the dtype
    the optimizer declares for its moments, after one from the state tensors themselves; and
    the ZeRO formula takes them as its optimizer term."""
    import torch

    from moetrain.config import OptimConfig
    from moetrain.parallel.accounting import optimizer_state_bytes_per_param, zero_bytes_per_param
    from moetrain.train.optim import adamw

    for moments, want in (("fp32", 8.0), ("bf16", 4.0)):
        p = torch.nn.Parameter(torch.randn(6, 5))
        opt = adamw([p], [], OptimConfig(moments_dtype=moments))
        assert optimizer_state_bytes_per_param([opt]) == want
        p.grad = torch.randn(6, 5)
        opt.step()
        assert optimizer_state_bytes_per_param([opt]) == want
        assert zero_bytes_per_param(0, 1, optim_bytes=want) == 8 + want
    # Muon's group keeps one buffer: 4 bytes (2 in bf16), before a step and after it.
    from moetrain.train.muon import build_muon

    for moments, want in (("fp32", 4.0), ("bf16", 2.0)):
        w = torch.nn.Parameter(torch.randn(6, 5))
        muon = build_muon([], [], [w], OptimConfig(name="muon", moments_dtype=moments))
        assert optimizer_state_bytes_per_param([muon]) == want
        w.grad = torch.randn(6, 5)
        muon.step()
        assert optimizer_state_bytes_per_param([muon]) == want
        assert optimizer_state_bytes_per_param([muon], muon=False) == 0.0
    # A planted dtype: moments stored in fp64 read as 16 bytes, not the declared 4.
    st = opt.state[p]
    st["exp_avg"], st["exp_avg_sq"] = st["exp_avg"].double(), st["exp_avg_sq"].double()
    assert optimizer_state_bytes_per_param([opt]) == 16.0
    assert zero_bytes_per_param(3, 4) == 16 / 4 and zero_bytes_per_param(1, 2, True) == 4 + 12 / 2


def test_measure_step_drives_a_run_through_its_protocol_alone() -> None:
    """``measure_step`` uses what ``MeasuredRun`` names and nothing else: a stand-in run (one
    linear layer, SGD with momentum, no trainer) is measured, each phase's model state read
    after its probe: 15 fp32 parameters (60 bytes) throughout, their gradients from the
    backward on, SGD's momentum buffer after the step; the forward saves its (2, 4) input
    (32 bytes; the weight is a parameter, not an activation); no collective."""
    import torch

    from moetrain.parallel.accounting import MeasuredRun, StepEngine, measure_step

    class Engine:
        def __init__(self) -> None:
            self.parts = [torch.nn.Linear(4, 3)]
            self.optimizers = [torch.optim.SGD(self.parts[0].parameters(), 0.1, momentum=0.9)]
            self.params_at_rest = 15
            self.meshes = None

    class Run:
        cfg = dims = None  # read by step_figures only

        def __init__(self) -> None:
            self.engine = Engine()

        def probed_step(self, probe):
            out = self.engine.parts[0](torch.ones(2, 4)).sum()
            probe("forward")
            out.backward()
            probe("backward")
            self.engine.optimizers[0].step()
            probe("step")
            return "result"

    run = Run()
    assert isinstance(run, MeasuredRun) and isinstance(run.engine, StepEngine)
    report = measure_step(run)
    assert report.result == "result" and report.params_per_rank == 15
    got = {k: (s.params, s.grads, s.optim) for k, s in report.memory.items()}
    assert got == {"forward": (60, 0, 0), "backward": (60, 60, 0), "step": (60, 60, 60)}
    assert report.activations == 32 and report.sent == {}


def test_the_trainer_is_a_measured_run(tmp_path: Path) -> None:
    """The trainer and its engine give what the accounting's protocols name, ``probed_step``
    probes the three phases and leaves no probe behind; a run that only has ``train_step``
    (how the accounting once drove the trainer) is not a ``MeasuredRun``."""
    from moetrain.parallel.accounting import MeasuredRun, StepEngine, measure_step
    from moetrain.train.trainer import Trainer

    trainer = Trainer(micro_config(str(tmp_path), "train.steps=2"))
    assert isinstance(trainer, MeasuredRun) and isinstance(trainer.engine, StepEngine)
    trainer.train_step()
    report = measure_step(trainer)
    assert set(report.memory) == {"forward", "backward", "step"}
    assert trainer.engine.probe is None and trainer.step == 2

    class DuckTyped:
        def __init__(self) -> None:
            self.cfg, self.dims, self.engine = trainer.cfg, trainer.dims, trainer.engine

        def train_step(self):
            return trainer.train_step()

    assert not isinstance(DuckTyped(), MeasuredRun)
    trainer.close()
