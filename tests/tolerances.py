"""The oracle's tolerances: every layout-vs-single-process comparison's, stated once, per
dtype, each with what was measured when it was set (``TOLERANCES``; ``VALUE_TOL``,
``PARAM_TOL``, ``GRAD_TOL`` are its fp32 rows), the allowances of clamped and bf16-moment runs
(``CLAMPED``, ``BF16_MOMENTS``), which row a run takes (``_tolerance_row``) and the slack of
gradients below the comparison's noise floor (``noise_floor_slack``). docs/parallel.md's
table is checked against this file (tests/test_docs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "BF16_MOMENTS",
    "CLAMPED",
    "GRAD_TOL",
    "PARAM_TOL",
    "TOLERANCES",
    "VALUE_TOL",
    "bf16_reordered",
    "noise_floor_slack",
    "tolerances",
]


# The tolerances of every layout-vs-single-process comparison, stated once, per dtype.
TOLERANCES: dict[str, dict[str, dict[str, float]]] = {
    "fp32": {
        # Losses, gradient norms, router statistics, token and drop counts, expert bias:
        # layouts only reorder fp32 sums (measured <= 1e-6).
        "value": {"atol": 1e-5, "rtol": 1e-4},
        # Final parameters: looser, because Adam turns last-bit differences in near-zero
        # gradients into visible updates (m / sqrt(v) does not scale with the gradient).
        # Measured <= 1.2e-5; elements whose gradient is below the comparison's noise floor
        # may move further (``noise_floor_slack``).
        "param": {"atol": 5e-5, "rtol": 1e-4},
        # Gradients (every step, before clipping) and AdamW's moments (after the last step),
        # per tensor: max |got - ref| <= scale * max |ref|, relative to the tensor's own
        # magnitude (gradients span 1e-4..1e-1 between tensors: one absolute atol would be
        # blind on the small ones). "first": the first step's gradients, where a layout only
        # reorders fp32 sums (measured <= 4e-7). "later": later steps' gradients and the
        # moments inherit the parameter differences Adam amplifies (a near-zero gradient
        # element whose last bit differs moves its parameter by a sizeable fraction of lr),
        # measured <= 2.2e-4 over the equivalence matrix on an AVX-512 CPU (``CLAMPED``
        # where model.clip_qkv clamps). How far Adam amplifies depends on the machine's BLAS
        # too (1.1e-3 for MiniMax-M2's options under tp2 + SP on AVX2): a cell past these
        # rows is decided step by step (``anchored_compare``), never by widening them. A
        # constant factor on one tensor's gradient -- what Adam hides from the parameters --
        # is an error of the order of the tensor itself: x0.5 reads 0.5.
        "grad": {"first": 1e-5, "later": 1e-3},
        # Router-score histograms: the fraction of scores in another bin (measured 0).
        "hist": {"moved": 1e-3},
    },
    # bf16 (``train.dtype=bf16``): one compute-dtype policy for one process and every layout
    # (``moetrain.model.precision``: the same tensors rounded to bf16, at the same places).
    # Measured over every layout of the equivalence matrix (tests/parallel/test_bf16_layouts.py:
    # its micro MoE, 2 steps, dense routing), before the policy / after it.
    "bf16": {
        # Layouts whose bf16 roundings are one process's -- data parallelism, ZeRO 0-3, HSDP,
        # pipelines at the same micro-batches: their forward is one process's bit for bit
        # and they reorder fp32 sums only, so the fp32 row holds. Measured: losses equal,
        # statistics and the gradient norm <= 1.2e-7, the first step's gradients <= 1.2e-7,
        # later ones and the moments <= 2.3e-7, parameters <= 3.7e-9; with FP8 rowwise <=
        # 3.4e-7. Before the policy ZeRO-2/3 rounded the embeddings, the final norm and the
        # head (the residual stream bf16): first-step gradients 1.3e-2, losses 7.7e-5 apart,
        # which the old row (5e-3 on values, 0.05 on first-step gradients) let pass
        # (tests/faults.py ``fsdp_root_in_bf16``).
        "value": {"atol": 1e-5, "rtol": 1e-4},
        "param": {"atol": 5e-5, "rtol": 1e-4},
        "grad": {"first": 1e-5, "later": 1e-3},
        "hist": {"moved": 1e-3},
    },
    "bf16 reordered": {
        # Layouts that round other bf16 partial results than one process (``bf16_reordered``):
        # tp's row-parallel partial sums, each rounded to bf16 before the all-reduce (about 1
        # ulp, 2^-8, of an activation), ep's expert GEMMs over other ranks' rows and cp's
        # weight gradients over half sequences (each GEMM output rounded once, over another
        # set of tokens), a pipeline's micro-batches of another size. Measured over 2, 4 and
        # 8 ranks: losses <= 8.0e-5 apart (1e-5 of the loss), the gradient norm <= 1.3e-4,
        # z-losses <= 1.3e-4; was 5e-3 on both.
        "value": {"atol": 5e-4, "rtol": 1e-4},
        # A gradient element near zero whose sign the rounding flips moves by up to 2 lr
        # a step in Adam's first steps; ``noise_floor_slack`` allows that to the elements
        # below the first step's gradient tolerance. Measured 2.6e-3 (cp2 x tp2 SP); was
        # 1.5e-2.
        "param": {"atol": 5e-3, "rtol": 0.0},
        # Gradients: the first step's agree to <= 1.06e-2 of each tensor's scale (cp2 x tp2
        # SP; was 0.05); later steps and the moments inherit the parameter moves above,
        # measured <= 5.9e-2. Still far from a constant factor (x0.5).
        "grad": {"first": 0.02, "later": 0.1},
        # A score within an ulp of a bin edge changes bin: measured 1 score in 512 (was 0.02).
        "hist": {"moved": 5e-3},
    },
    "bf16 reordered fp8": {
        # bf16 with FP8 GEMMs under a "bf16 reordered" layout: a bf16 difference that lands
        # an FP8 input on the other side of a rounding boundary moves it by 2^-3 of itself
        # (the discontinuity of the "fp8" row), so the first step only, as there. Measured
        # over 2, 4 and 8 ranks, both recipes: losses <= 6.1e-5 apart, the gradient norm
        # <= 7.5e-4, z-losses <= 1.8e-4, gradients <= 7.1e-2 of their scale (tensorwise,
        # cp2 x dp2 x tp2 SP), 2 scores in 512 in another bin. Under the "bf16" layouts FP8
        # meets the "bf16" row (measured <= 3.8e-7; before the policy ZeRO-3's FP8 scales came
        # from other weights than one process's: 3.6% of the drops differed).
        "steps": 1,
        "value": {"atol": 2e-3, "rtol": 1e-4},
        "param": {"atol": 5e-3, "rtol": 0.0},  # not compared ("steps": 1)
        "grad": {"first": 0.1, "later": 0.1},  # later: not compared
        "hist": {"moved": 1e-2},
    },
    "fp8": {
        # fp32 training with FP8 GEMMs (``train.fp8``), compared on the first step only
        # ("steps": 1): its losses, statistics and every gradient. Every FP8 scale is the
        # same under every layout (whole tensors, per-token rows), so the first step
        # reproduces one FP8 process as fp32 does -- but for one discontinuity, like a
        # clamp's (CLAMPED): a GEMM input that a layout sums in another fp32 order (tp's
        # row-parallel reductions) and that lies within its last bit of a rounding boundary
        # of the FP8 grid rounds to the neighbouring FP8 value, 2^-3 of itself, and in this
        # 32-wide model that moves the token's later activations enough to flip more of
        # them. Over the matrix (every FP8 cell on 2, 4 and 8 ranks): losses within 9.5e-7,
        # statistics within 3.1e-6 and routing equal; the gradient norm within 7.0e-5; the
        # gradients within 4.3e-2 of their tensor's scale (tp2 with per-head q/k norms, YaRN
        # and document masks; 2.0e-5 in a plain tp2 SP cell). After the step, Adam has moved
        # a parameter by up to 2 lr where such a gradient element changed sign, which can
        # move a token's routing at the next step (measured: 1 token of 42 in another
        # expert, that expert's gradient 16% off): later steps, the moments and the final
        # parameters are not compared (the optimizer is, under every layout, without FP8).
        # Scales from one rank's slice of a tensor move the first step's gradients by 3e-2
        # to 1.2e-1, within reach of that allowance: tests/parallel/test_fp8_layouts.py
        # catches them token by token instead (tests/faults.py ``fp8_local_amax``).
        "steps": 1,
        "value": {"atol": 1e-5, "rtol": 5e-4},
        "param": {"atol": 5e-5, "rtol": 1e-4},  # not compared ("steps": 1)
        "grad": {"first": 0.1, "later": 1e-3},  # later: not compared
        "hist": {"moved": 1e-3},
    },
}
VALUE_TOL = TOLERANCES["fp32"]["value"]
PARAM_TOL = TOLERANCES["fp32"]["param"]
GRAD_TOL = TOLERANCES["fp32"]["grad"]


CLAMPED = {"grad_later": 0.05, "param": {"atol": 1e-3, "rtol": 1e-3}}
"""Later steps' gradients and moments, and final parameters, of a run whose q/k/v are
clamped (``model.clip_qkv``). A clamp's gradient is discontinuous: the parameter difference
Adam leaves after the first step (1e-6) can move an element that sits on the bound across
it, and that element's gradient jumps between zero and its full value -- measured up to
1.8e-2 of the tensor (7.5e-3 in wq, norms equal to 4 digits) at the second step and 3.3e-4
on 4 of 2048 weights after it, under cp2 and zbv, both on the same side of the bound. The
first step, where the runs see the same parameters, keeps the tight tolerance, and so do
losses and statistics."""


BF16_MOMENTS = {"grad_later": 1e-2, "param": {"atol": 2e-4, "rtol": 1e-4}}
"""A run with ``optim.moments_dtype=bf16``. A layout's moment that lies within its last fp32
bit of a bf16 rounding boundary rounds the other way, one bf16 ulp of itself -- up to 2^-7
of it at the bottom of a binade, so up to 7.8e-3 of the tensor's largest element (compared
with ``grad["later"]``; measured 4.6e-3: an exp_avg of layers.0.ffn.w1 under cp2 with
ZeRO-3, an exhaustive cell). The next update of that element, lr m / sqrt(v), moves by the
same fraction of the moment, more where m is a small difference of the old moment and the
new gradient: parameters within 2e-4 (measured 8.8e-5, layers.3.attention.wo under tp2 SP
with document masks and DeepSeek-V2 routing)."""


def _option(options: Sequence[str], key: str) -> str | None:
    values = [o.split("=", 1)[1] for o in options if o.startswith(f"{key}=")]
    return values[-1] if values else None


def tolerances(options: Sequence[str], dtype: str = "fp32") -> dict[str, dict[str, float]]:
    """``{"param": ..., "grad": ...}``: the ``TOLERANCES`` rows of ``dtype`` for a run with
    these overrides (loosened by ``CLAMPED`` after the first step where q/k/v are clamped,
    by ``BF16_MOMENTS`` for the moments and parameters under ``optim.moments_dtype=bf16``;
    runs with ``train.fp8`` have their own row, "fp8")."""
    param, grad = dict(TOLERANCES[dtype]["param"]), dict(TOLERANCES[dtype]["grad"])
    if _option(options, "model.clip_qkv") not in (None, "null", "None", "none"):
        grad["later"] = max(grad["later"], CLAMPED["grad_later"])
        param = {k: max(v, CLAMPED["param"][k]) for k, v in param.items()}
    if _option(options, "optim.moments_dtype") == "bf16":
        grad["later"] = max(grad["later"], BF16_MOMENTS["grad_later"])
        param = {k: max(v, BF16_MOMENTS["param"][k]) for k, v in param.items()}
    return {"param": param, "grad": grad}


def noise_floor_slack(ref: dict[str, Any], floor: float) -> dict[str, torch.Tensor]:
    """Per parameter, the extra distance its elements may move: for an element whose
    reference gradient was within ``floor`` of its tensor's largest at some step, 2 x the sum
    of the lrs from the first such step on; 0 for the others.

    The gradient check allows an error of ``floor`` x the tensor's scale, so the sign of such
    an element's gradient is not pinned by the comparison (a cancelling sum, e.g. an output
    row of a token the batch does not hold: measured 2e-7 of a 0.23-scale tensor). Adam
    normalises it anyway: its update is lr x m / sqrt(v), of size ~lr whatever the gradient's
    magnitude (|m^ / sqrt(v^)| <= 1.002 over two steps), so two runs may move it up to 2 lr a
    step apart -- at that step and at every later one, whose m and v still hold the unpinned
    value: an element quiet at the first step and large at the second (an embedding row of a
    token first seen in the second batch: -2.8e-9 then -8.6e-3 of a 0.18-scale tensor) has a
    second update that depends steeply on the first gradient, measured 2% of that step's lr
    apart under tp2 on one machine. Every other element keeps the tight ``param`` tolerance;
    an error a layout makes (a scaled gradient, lost moments, a wrong lr) shows on those and
    in the gradient and moment checks."""
    if "grads" not in ref or not ref.get("lrs"):
        return {}
    lrs = list(ref["lrs"])
    out = {}
    for name in ref["params"]:
        shape = ref["params"][name].shape
        slack = torch.zeros(shape, dtype=torch.float64)
        for t, grads in enumerate(ref["grads"]):
            g = grads.get(name)
            if g is None or g.shape != shape:
                continue
            g = g.double().abs()
            quiet = g <= floor * g.max()
            slack = torch.maximum(slack, quiet.double() * (2.0 * sum(lrs[t:])))
        if slack.any():
            out[name] = slack
    return out


def _tolerance_row(trainer: Any) -> str:
    """The ``TOLERANCES`` row of a run: its compute dtype, or "fp8" for FP8 GEMMs on fp32.
    Under bf16, "bf16" where the layout rounds to bf16 exactly where one process does, or
    "bf16 reordered" (``bf16_reordered``), with FP8 "bf16 reordered fp8"."""
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[trainer.dtype]
    fp8 = trainer.cfg.train.fp8 != "none"
    if dtype == "fp32":
        return "fp8" if fp8 else dtype
    if not bf16_reordered(trainer.engine.dims, trainer.cfg):
        return "bf16"
    return "bf16 reordered fp8" if fp8 else "bf16 reordered"


def bf16_reordered(dims: Any, cfg: Any) -> bool:
    """Whether a layout rounds bf16 partial results one process does not (the compute-dtype
    policy, ``moetrain.model.precision``, is the same everywhere; what differs is which
    sums a bf16 GEMM output or collective holds): tp's row-parallel partial sums and
    expert TP's, ep's expert GEMMs over the rows of several data-parallel ranks, cp's
    weight gradients over half sequences, a pipeline's micro-batches of another size than
    ``train.micro_batch_size``. Data parallelism, ZeRO 0-3 and HSDP, and pipelines at the
    same micro-batches reorder fp32 sums only."""
    return (
        dims.tp > 1
        or dims.ep > 1
        or dims.cp > 1
        or dims.micro_batch_size(cfg) != cfg.train.micro_batch_size
    )
