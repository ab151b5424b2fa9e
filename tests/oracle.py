"""The correctness oracle: a layout's run against the single-process run.

``compare_runs`` asserts two ``micro_run`` reports (tests/micro.py) agree within the
``TOLERANCES`` row of their dtype (tests/tolerances.py): losses, MoE statistics, every
gradient of every step, the optimizer moments and the final parameters; a failure lists every
diverging tensor (tests/divergence.py). ``check_cases`` runs the cells of a layout test on
spawned ranks (tests/harness.py), compares each rank's run with ``reference_run`` and its
layout facts with what the request asks (tests/layout_facts.py); a cell past the whole-run
tolerances is decided step by step (``anchored_compare``). ``check_reshards`` does the same
for runs resumed under another layout. ``Case.fault`` plants the errors the oracle's own
tests (tests/parallel/test_oracle.py) see caught.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from divergence import Check, Divergences
from harness import run_ranks
from layout_facts import check_layout, expected_layout
from micro import micro_config, micro_run, reshard_run
from threads import one_thread
from tolerances import TOLERANCES, _tolerance_row, noise_floor_slack, tolerances

__all__ = [
    "ANCHORED_PARAM_TOL",
    "Case",
    "anchored_compare",
    "anchored_run",
    "check_cases",
    "check_reshards",
    "compare_resumed",
    "compare_runs",
    "reference_run",
    "scale_grads",
]


LAYOUT_STATS = ("a2a_bytes", "calls", "recv_rows", "recv_rows_max")
"""MoE statistics that describe the layout rather than the training (bytes sent between
EP ranks, forward calls = micro-batches, rows a rank's experts received): not compared with
one process; the layout checks assert them instead."""
HISTOGRAMS = {"score_hist": "router scores", "qb_hist": "required biases"}
"""Binned MoE statistics (what their values are): compared by their totals and the fraction
of values in another bin, since a value within rounding of a bin edge may cross it."""
PER_CALL_STATS = ("aux_loss", "seq_aux_loss", "z_loss", "entropy", "probs_sum")
"""MoE statistics summed over a step's forward calls: compared as per-call means (a layout
may cut the step into other micro-batches; token counts and drops are sums over tokens)."""


def compare_runs(
    got: dict[str, Any],
    ref: dict[str, Any],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    param_tol: dict[str, float] | None = None,
    grad_tol: dict[str, float] | None = None,
    what: str = "",
) -> dict[str, float]:
    """Assert two ``micro_run`` reports agree, with the ``TOLERANCES`` row of their dtype
    unless given: values within atol/rtol, parameters within ``param_tol``, every gradient
    at every step and both AdamW moments of every parameter within ``grad_tol`` (skipped
    when either report lacks them). Returns the worst error of each part (relative to the
    tensor's scale for gradients and moments).

    Every check runs; the assertion message lists every diverging tensor, grouped by kind
    (router, experts, attention, norms, embeddings, ...), worst first, each with the first
    step at which it diverged (``tests/divergence.py``)."""
    errs: dict[str, float] = {}
    precision = ref.get("precision")
    assert got.get("precision") == precision, f"{what}: {got.get('precision')} vs {precision}"
    # The layout's row: under bf16 it depends on what the layout sums (``bf16_reordered``).
    table = TOLERANCES[got.get("dtype", ref.get("dtype", "fp32"))]
    if "steps" in table:  # a row compared on its first steps only (fp8)
        got, ref = _first_steps(got, table["steps"]), _first_steps(ref, table["steps"])
    atol = table["value"]["atol"] if atol is None else atol
    rtol = table["value"]["rtol"] if rtol is None else rtol
    param_tol = param_tol or table["param"]
    grad_tol = grad_tol or table["grad"]
    found = Divergences(what or "runs")

    def note(name: str, err: float) -> None:
        key = name.split("[")[0]
        errs[key] = max(errs.get(key, 0.0), err)

    def shape_differs(tensor: str, label: str, part: str, step, a, b) -> bool:
        if a.shape == b.shape:
            return False
        found.add(tensor, Check(label, part, step, math.inf, f"shape {tuple(a.shape)} vs "
                                f"{tuple(b.shape)}"))  # fmt: skip
        return True

    def check(tensor: str, label: str, step, a: Any, b: Any, atol=atol, rtol=rtol) -> None:
        part = "param" if label.startswith("param[") else "value"
        err = found.check_close(tensor, label, step, a, b, atol, rtol, part)
        if not math.isinf(err):
            note(label, err)

    def check_scaled(tensor: str, label: str, part: str, step, a, b, scale_tol: float) -> None:
        a_t, b_t = a.double(), b.double()
        if shape_differs(tensor, label, part, step, a_t, b_t):
            return
        scale = b_t.abs().max().item() if b_t.numel() else 0.0
        err = (a_t - b_t).abs().max().item() if a_t.numel() else 0.0
        rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
        if math.isnan(rel):
            rel = math.inf
        note("grad first step[" if label.startswith("grad[step 0 ") else label, rel)
        if rel > scale_tol:
            found.add(tensor, Check(
                label, part, step, rel / scale_tol,
                f"max abs error {err:.3g} is {rel:.3g} of the reference's max abs {scale:.3g} "
                f"(allowed {scale_tol:g}); ratio of norms got/ref "
                f"{a_t.norm().item() / max(b_t.norm().item(), 1e-30):.4g}",
            ))  # fmt: skip

    def same_names(kind: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
        missing, extra = sorted(set(b) - set(a)), sorted(set(a) - set(b))
        for name in missing:
            found.add(name, Check(f"{kind}[{name}]", kind, None, math.inf, "missing"))
        for name in extra:
            found.add(name, Check(f"{kind}[{name}]", kind, None, math.inf, "unexpected"))
        return [n for n in b if n in a]

    if "grads" in got and "grads" in ref:
        assert len(got["grads"]) == len(ref["grads"]), f"{what}: gradient steps differ"
        for step, (g, r) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
            tol = grad_tol["first"] if step == 0 else grad_tol["later"]
            for name in same_names("grad", g, r):
                check_scaled(name, f"grad[step {step} {name}]", "grad", step, g[name], r[name],
                             tol)  # fmt: skip
    if "optim" in got and "optim" in ref:
        for name in same_names("optim", got["optim"], ref["optim"]):
            tensor = name.rsplit(".", 1)[0]  # <parameter>.exp_avg / .exp_avg_sq
            check_scaled(tensor, f"optim[{name}]", "optim", None, got["optim"][name],
                         ref["optim"][name], grad_tol["later"])  # fmt: skip
    for key in ("loss", "grad_norm", "mtp_loss"):
        if key not in ref or (key == "mtp_loss" and all(math.isnan(x) for x in ref[key])):
            continue  # no multi-token prediction: nan in both runs
        a, b = list(got.get(key, [])), list(ref[key])
        if len(a) != len(b):
            found.add(key, Check(key, "value", None, math.inf, f"{len(a)} steps vs {len(b)}"))
            continue
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            check(key, f"{key}[step {step}]", step, x, y)
    # QK-clip: each attention layer's largest logit, which sets its rescale (a report without
    # them, the anchored replay's, compares none).
    logits = zip(got.get("max_logits", []), ref.get("max_logits", []), strict=False)
    for step, (g, r) in enumerate(logits):
        for layer, value in r.items():
            check(f"max logit layer {layer}", f"max_logit[step {step} layer {layer}]", step,
                  g.get(layer, math.nan), value)  # fmt: skip
    for step, (g, r) in enumerate(zip(got["moe"], ref["moe"], strict=True)):
        if sorted(g) != sorted(r):
            found.add(
                "moe layers",
                Check(
                    f"moe[step {step}]",
                    "value",
                    step,
                    math.inf,
                    f"MoE layers {sorted(g)} vs {sorted(r)}",
                ),
            )
            continue
        for layer in r:
            for key in r[layer]:
                if key in LAYOUT_STATS:
                    continue
                tensor = f"moe.{key} layer {layer}"
                a, b = g[layer][key], r[layer][key]
                if key in HISTOGRAMS:
                    # Binned values: the counts must all be there (per expert for qb_hist),
                    # and a value within rounding of a bin edge may land in the next bin: the
                    # table row's fraction may move. Quantile balancing's required biases
                    # r_te = c_t - s_te share their token's cutoff c_t: a cutoff within
                    # rounding of a tie (two experts' scores) moves all E of them at once,
                    # and 1000 fine bins over a few hundred tokens make one token's E values
                    # more than 0.1%: one token's worth may move.
                    check(tensor, f"moe.{key} total[step {step} layer {layer}]", step,
                          a.sum(-1), b.sum(-1))  # fmt: skip
                    total = max(b.sum().item(), 1.0)
                    moved = 0.5 * (a - b).abs().sum().item() / total
                    allowed = table["hist"]["moved"]
                    if key == "qb_hist":
                        allowed = max(allowed, b.shape[0] / total)
                    note(f"moe.{key} moved", moved)
                    if moved > allowed:
                        found.add(tensor, Check(
                            f"moe.{key}[step {step} layer {layer}]", "value", step,
                            moved / allowed,
                            f"{moved:.3%} of the {HISTOGRAMS[key]} in another bin (allowed "
                            f"{allowed:.2%})",
                        ))  # fmt: skip
                    continue
                if key in PER_CALL_STATS:  # sums over forward calls: compare the means
                    a, b = a / g[layer]["calls"], b / r[layer]["calls"]
                check(tensor, f"moe.{key}[step {step} layer {layer}]", step, a, b)
    noise = noise_floor_slack(ref, grad_tol["first"])
    for name in same_names("param", got["params"], ref["params"]):
        err = found.check_close(name, f"param[{name}]", None, got["params"][name],
                                ref["params"][name], part="param", slack=noise.get(name),
                                **param_tol)  # fmt: skip
        if not math.isinf(err):
            note(f"param[{name}]", err)
    assert not found, found.message()
    return errs


def _first_steps(run: dict[str, Any], steps: int) -> dict[str, Any]:
    """A ``micro_run`` report cut to its first ``steps`` steps: no moments, no final
    parameters (they come after the last step)."""
    out = {k: v[:steps] if k in ("loss", "grad_norm", "moe", "grads", "lrs", "max_logits") else v
           for k, v in run.items() if k != "optim"}  # fmt: skip
    out["params"] = {}
    return out


@dataclass(frozen=True)
class Case:
    """One cell of a layout test: ``layout`` (``parallel.*`` overrides) run on ``options``
    (model / MoE / training overrides, which the single-process reference shares)."""

    name: str
    layout: tuple[str, ...]
    options: tuple[str, ...] = ()
    fault: tuple[Any, ...] | None = None
    """For the oracle's own tests, an error planted on one rank (``rank`` None: on every
    rank): ``("scale", rank, suffix, factor)`` multiplies the reduced gradient of every
    parameter whose name ends with ``suffix``; ``("disable", rank, "module:function")``
    replaces a function of moetrain with a no-op, as if the code silently ignored what it
    implements; ``("plant", rank, name)`` installs a realistic bug of ``tests/faults.py``.
    Undone after the case."""


def scale_grads(suffix: str, factor: float) -> Callable[[Any, int], None]:
    """A ``micro_run`` injection: multiply the reduced gradients of the parameters whose
    single-process name ends with ``suffix`` by ``factor``."""

    def inject(engine: Any, step: int) -> None:
        from moetrain.train.tensors import fqn as _fqn

        for part in engine.parts:
            for name, p in part.named_parameters():
                if _fqn(name).endswith(suffix) and p.grad is not None:
                    p.grad.mul_(factor)

    return inject


def _plant(
    fault: tuple[Any, ...] | None, rank: int, undo: list[Callable[[], None]]
) -> Callable[[Any, int], None] | None:
    """Install ``fault`` on this rank (when it is this rank's); what it patched is restored
    by the callables it appends to ``undo`` (a worker runs several cases)."""
    if fault is None or fault[1] not in (None, rank):
        return None
    if fault[0] == "scale":
        return scale_grads(fault[2], fault[3])

    def patch(obj: Any, attr: str, value: Any) -> None:
        old = getattr(obj, attr)
        setattr(obj, attr, value)
        undo.append(lambda: setattr(obj, attr, old))

    if fault[0] == "disable":
        import importlib

        module, attr = fault[2].split(":")
        patch(importlib.import_module(module), attr, lambda *a, **k: None)
        return None
    if fault[0] == "plant":
        from faults import plant

        plant(fault[2], patch)
        return None
    raise ValueError(f"unknown fault {fault!r}")


_REFERENCES: dict[tuple[tuple[str, ...], int], dict[str, Any]] = {}


def reference_run(options: tuple[str, ...], steps: int) -> dict[str, Any]:
    """The single-process ``micro_run`` of ``options`` (computed once per test process)."""
    key = (tuple(options), steps)
    if key not in _REFERENCES:
        with tempfile.TemporaryDirectory() as out:
            _REFERENCES[key] = micro_run(out, steps, *options)  # on ORACLE_THREADS, as a rank
    return _REFERENCES[key]


ANCHORED_PARAM_TOL = {"atol": 1e-6, "rtol": 1e-5}
"""Parameters (and buffers) after one step that the layout and one process take from the same
parameters, optimizer state and gradients (``anchored_compare``): only the gradient norm's
reduction order differs (the clipping factor, one fp32 rounding) and the optimizer's
elementwise arithmetic is the same: measured 0 (MiniMax-M2's options under tp2 + SP on an
AVX2 CPU, gradient norms 2e-16 apart)."""


def anchored_run(options: tuple[str, ...], got: dict[str, Any], steps: int) -> dict[str, Any]:
    """One process replaying a layout's run step by step: before every step after the first
    it takes the layout's parameters, buffers and optimizer state (``got["before"]``), so its
    forward and backward see what the layout's saw; its reduced gradients are recorded, then
    replaced by the layout's own (``got["grads"]``) before clipping and the optimizer step, so
    its update is one process's update of the layout's inputs. Returns a ``micro_run``-shaped
    report whose ``after`` lists the parameters and optimizer state after every step."""
    from moetrain.train.tensors import fqn as _fqn
    from moetrain.train.trainer import Trainer

    with one_thread(), tempfile.TemporaryDirectory() as out:
        trainer = Trainer(micro_config(out, f"train.steps={steps}", *options))
        engine = trainer.engine
        named = {_fqn(n): p for part in engine.parts for n, p in part.named_parameters()}
        grads: list[dict[str, torch.Tensor]] = []

        def hook(engine: Any) -> None:
            grads.append(engine.full_grad_dict())
            for name, g in got["grads"][len(grads) - 1].items():
                p = named[name]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(g)

        def load(state: dict[str, dict[str, torch.Tensor]]) -> None:
            with torch.no_grad():
                for part in engine.parts:
                    for n, t in part.state_dict(keep_vars=True).items():
                        t.copy_(state["params"][_fqn(n)])
                for opt in engine.optimizers:
                    for group in opt.param_groups:
                        for p in group["params"]:
                            name = next(k for k, v in named.items() if v is p)
                            for moment, value in opt.state[p].items():
                                key = f"{name}.{moment}"
                                if key in state["optim"]:
                                    value.copy_(state["optim"][key])

        engine.grad_hook = hook
        report: dict[str, Any] = {"loss": [], "mtp_loss": [], "grad_norm": [], "moe": [],
                                  "grads": grads, "after": []}  # fmt: skip
        for step in range(steps):
            if step > 0:
                load(got["before"][step - 1])
            res = trainer.train_step()
            report["loss"].append(res.loss)
            report["mtp_loss"].append(res.mtp_loss)
            report["grad_norm"].append(res.grad_norm)
            report["moe"].append(
                {i: {k: v.detach().cpu().clone() for k, v in st.items()}
                 for i, st in res.moe.items()}
            )  # fmt: skip
            report["after"].append({"params": trainer.full_model_state_dict(),
                                    "optim": engine.full_optimizer_state()})  # fmt: skip
        report["dtype"] = _tolerance_row(trainer)
        report["precision"] = (str(trainer.dtype), trainer.cfg.train.fp8)
        trainer.close()
    return report


def _step_report(run: dict[str, Any], step: int, state: dict[str, Any]) -> dict[str, Any]:
    """One step of a ``micro_run`` report, with the parameters and optimizer state after it."""
    keys = ("loss", "mtp_loss", "grad_norm", "moe", "grads")
    return {**{k: run[k][step : step + 1] for k in keys}, "params": state["params"],
            "optim": state["optim"], "dtype": run.get("dtype", "fp32"),
            "precision": run.get("precision")}  # fmt: skip


def anchored_compare(
    options: tuple[str, ...], got: dict[str, Any], steps: int, what: str = ""
) -> dict[str, float]:
    """The layout's run step by step against one process given the same inputs
    (``anchored_run``): every step's losses, statistics and gradients within the FIRST step's
    tolerance of its dtype (where both see the same parameters, a layout only reorders
    sums), and the parameters and optimizer state after every step within
    ``ANCHORED_PARAM_TOL``. Raises AssertionError naming the step and the tensors.

    Why: a whole-run comparison allows later steps the divergence Adam amplifies from
    last-bit differences (``TOLERANCES``' "later" rows), and how far that goes depends on
    the machine's BLAS (an AVX2 CPU sums in other blocks than an AVX-512 one) and on the
    options. Step by step there is nothing to amplify: an update of the same inputs is the
    same update, so a layout that is right at every step passes on any machine, and one
    that is wrong at any step fails at that step, with the tight tolerance. Returns the worst
    error of each part over the steps.

    Measured on an AMD EPYC forced to AVX2 (``ATEN_CPU_CAPABILITY=avx2``), MiniMax-M2's options
    under tp2 + SP (tests/parallel/test_arch_layouts.py): first-step gradients within 7.1e-7
    of their tensors' scale and no sign flipped, yet after the first update an embedding
    element whose gradient is of the order of Adam's eps lay 0.084 lr from one process's, and
    the second step's expert gradients 1.1e-3 of their scale apart (two parameters 1.2 and 2.3
    times the fp32 "param" row); step by step, gradients within 1.1e-6 of scale and updates 0
    apart. With AVX-512 the cell passes the whole-run comparison."""
    ref = anchored_run(options, got, steps)
    worst: dict[str, float] = {}
    dtype = got.get("dtype", "fp32")
    first = TOLERANCES[dtype]["grad"]["first"]
    for step in range(steps):
        after = got["before"][step] if step + 1 < steps else {
            "params": got["params"], "optim": got["optim"]}  # fmt: skip

        mine, theirs = _step_report(got, step, after), _step_report(ref, step, ref["after"][step])
        errs = compare_runs(mine, theirs, param_tol=ANCHORED_PARAM_TOL,
                            grad_tol={"first": first, "later": first},
                            what=f"{what} anchored at step {step}")  # fmt: skip
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
    return worst


def _cases_worker(
    rank: int,
    world_size: int,
    cases: list[Case],
    refs: dict[tuple[str, ...], dict[str, Any]],
    steps: int,
    wants: list[list[dict[str, Any]]],
) -> list[dict[str, Any]]:
    out = []
    counted: set[tuple[str, ...]] = set()  # layouts whose traffic a cell already counted
    for case, want in zip(cases, wants, strict=True):
        overrides = [*case.options, *case.layout]
        undo: list[Callable[[], None]] = []
        inject = _plant(case.fault, rank, undo)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                traffic = case.layout not in counted
                got = micro_run(tmp, steps, *overrides, inject=inject, traffic=traffic)
                counted.add(case.layout)
        except Exception as exc:
            exc.add_note(f"in the cell {case.name}")
            raise
        finally:
            for restore in reversed(undo):
                restore()
        problems = [
            f"layout {m}"
            for m in check_layout(got["layout"], overrides, world_size, rank, want[rank])
        ]
        errs: dict[str, float] = {}
        result: dict[str, Any] = {"name": case.name, "problems": problems}
        try:
            errs = compare_runs(
                got,
                refs[case.options],
                **{
                    f"{k}_tol": v
                    for k, v in tolerances(overrides, got.get("dtype", "fp32")).items()
                },
                what=f"rank {rank}",
            )
        except AssertionError as exc:
            # Beyond the whole-run tolerances: the parent replays the run step by step
            # (anchored_compare), which decides.
            result.update(trajectory=str(exc), got={k: v for k, v in got.items() if k != "layout"})
        result["errs"] = errs
        out.append(result)
    return out


def check_cases(world_size: int, cases: list[Case], steps: int, timeout: float) -> None:
    """Run every case on ``world_size`` spawned ranks (one job, a fresh Trainer per case);
    on every rank compare the run with the single-process reference of its options
    (``compare_runs``: losses, MoE statistics, every gradient of every step, the optimizer
    moments and the final parameters) and its layout facts with what the config asks
    (``expected_layout`` of the raw request, computed here, before and outside the run).
    Raises one AssertionError listing every failing case and rank."""
    refs = {c.options: reference_run(c.options, steps) for c in cases}
    wants = [
        [expected_layout([*c.options, *c.layout], world_size, r) for r in range(world_size)]
        for c in cases
    ]
    results = run_ranks(_cases_worker, world_size, cases, refs, steps, wants, timeout=timeout)
    failures = case_failures(cases, results, steps)
    assert not failures, "\n\n".join(failures)


def caught_reports(world_size: int, case: Case, steps: int, timeout: float) -> list[str]:
    """Each rank's part of what ``check_cases`` reports for ``case``, whose planted fault it
    must catch (the oracle's own tests): fails if the case passes."""
    try:
        check_cases(world_size, [case], steps, timeout)
    except AssertionError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"{case.name}: the planted fault {case.fault} was not caught")
    return [message.split(f"{case.name} (rank {rank})", 1)[1].split("\n\n")[0]
            for rank in range(world_size)]  # fmt: skip


def case_failures(cases: list[Case], results: list[list[dict[str, Any]]], steps: int) -> list[str]:
    """The verdict on what ``_cases_worker`` returned on every rank (``results[rank][case]``):
    one message per failing case and rank, naming its layout facts that differ from the
    request and, for a run beyond the whole-run tolerances (``trajectory``), the step-by-step
    replay that then decides (``anchored_compare``): its numbers are read, not only its
    layout. Prints the worst errors, and which cases the replay decided."""
    failures, worst, anchored = [], {}, []
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank, strict=True):
            problems = res["problems"]
            if "trajectory" in res:
                try:
                    errs = anchored_compare(case.options, res["got"], steps, what=f"rank {rank}")
                    anchored.append(f"{res['name']} (rank {rank}) {errs}")
                except AssertionError as exc:
                    problems = [*problems, res["trajectory"], str(exc)]
            if problems:
                failures.append(f"{res['name']} (rank {rank}):\n  " + "\n  ".join(problems))
            for k, v in res["errs"].items():
                worst[k] = max(worst.get(k, 0.0), v)
    print(f"{len(cases)} cases x {len(results)} ranks; worst errors {worst}")
    if anchored:  # past the whole-run tolerances, exact step by step
        print("decided step by step (anchored_compare): " + "; ".join(anchored))
    return failures


def compare_resumed(got: dict[str, Any], ref: dict[str, Any], what: str = "") -> None:
    """A ``reshard_run`` against the uninterrupted single-process ``micro_run``: losses,
    the last step's gradients, the optimizer moments and the parameters."""
    later = TOLERANCES[got.get("dtype", ref.get("dtype", "fp32"))]["grad"]["later"]
    compare_runs(
        {**got, "grad_norm": [], "moe": []},
        {**ref, "grad_norm": [], "moe": [], "grads": ref["grads"][-1:], "mtp_loss": []},
        grad_tol={"first": later, "later": later},  # the resumed step is a later step
        what=what,
    )


def _reshard_worker(
    rank: int,
    world_size: int,
    root: str,
    cases: list[tuple[str, list[str], list[str]]],
    ref: dict[str, Any],
    steps: int,
) -> list[str]:
    problems = []
    for i, (name, save, load) in enumerate(cases):
        got = reshard_run(f"{root}/{i}", steps, save, load)
        try:
            compare_resumed(got, ref, what=f"{name} (rank {rank})")
        except AssertionError as exc:
            problems.append(str(exc))
    return problems


def check_reshards(
    world_size: int,
    cases: list[tuple[str, list[str], list[str]]],
    steps: int,
    timeout: float,
    options: tuple[str, ...] = (),
) -> None:
    """Each (name, save layout, load layout) resumed mid-run reproduces the single-process
    run of ``options`` on every rank (``compare_resumed``)."""
    ref = reference_run(options, steps)
    cases = [(n, [*options, *s], [*options, *ld]) for n, s, ld in cases]
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_reshard_worker, world_size, root, cases, ref, steps, timeout=timeout)
    failures = [p for per_rank in results for p in per_rank]
    assert not failures, "\n\n".join(failures)
