"""Every tensor that diverges, worst first, grouped by kind: the oracle's failure report.

A comparison of two runs (``oracle.compare_runs``, the semantic tests) adds each check that
fails to a ``Divergences``; the report then names every diverging tensor of the run instead
of the first one in iteration order (a routing, RoPE or capacity bug shows in the router,
the attention or the experts, not as ``tok_embeddings.weight``, the first name of the model):

    rank 0: 3 tensors diverge (worst first; excess = error / allowed error)
      router (1 tensor, worst excess 5e+04):
        layers.1.ffn.router.gate.weight: first diverges at step 0 (grad, optim, param)
          grad[step 0 layers.1.ffn.router.gate.weight]: max abs error 1.2e-03 is ...
      experts (2 tensors, ...):
        ...

``kind_of`` sorts a name into router, experts, attention, norms, embeddings, output, values
(losses, gradient norms) and other; ``excess`` is the error divided by what the tolerance
allows, so checks of different tolerances rank together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

KINDS = (
    ("router", (".router.", "moe.")),
    ("experts", (".experts.", ".shared")),
    ("attention", (".attention.",)),
    ("norms", ("norm",)),
    ("embeddings", ("tok_embeddings.",)),
    ("output", ("output.",)),
)
"""(kind, substrings of a name): the first kind whose substring the name holds. MoE
statistics (``moe.*``) count as router."""


def kind_of(name: str) -> str:
    if name in ("loss", "grad_norm") or name.startswith(("loss", "grad_norm")):
        return "values"
    for kind, marks in KINDS:
        if any(m in name for m in marks):
            return kind
    return "other"


@dataclass
class Check:
    label: str  # e.g. "grad[step 0 layers.1.ffn.router.gate.weight]"
    part: str  # grad, optim, param, value, structure
    step: int | None  # the step it belongs to (None: after the last step)
    excess: float  # error / allowed (inf: NaN or shape)
    detail: str


@dataclass
class Divergences:
    """The failed checks of one comparison, by tensor."""

    what: str = ""
    by_tensor: dict[str, list[Check]] = field(default_factory=dict)

    def add(self, tensor: str, check: Check) -> None:
        self.by_tensor.setdefault(tensor, []).append(check)

    def check_close(
        self,
        tensor: str,
        label: str,
        step: int | None,
        got: object,
        want: object,
        atol: float,
        rtol: float,
        part: str = "value",
        slack: Any = None,
    ) -> float:
        """Element-wise |got - want| <= atol + rtol |want| (``torch.testing.assert_close``'s
        rule, NaN never close), plus ``slack`` (a tensor of ``want``'s shape) where given; a
        failure is added under ``tensor``. Returns the max abs error (inf for a shape
        mismatch)."""
        import torch

        a = torch.as_tensor(got, dtype=torch.float64)
        b = torch.as_tensor(want, dtype=torch.float64)
        if a.shape != b.shape:
            self.add(tensor, Check(label, part, step, math.inf,
                                   f"shape {tuple(a.shape)} vs {tuple(b.shape)}"))  # fmt: skip
            return math.inf
        if not b.numel():
            return 0.0
        diff = (a - b).abs()
        allowed = atol + rtol * b.abs()
        if slack is not None:
            allowed = allowed + torch.as_tensor(slack, dtype=torch.float64)
        excess_t = torch.where(torch.isnan(diff), math.inf, diff / allowed.clamp_min(1e-300))
        excess = excess_t.max().item()
        if excess > 1.0:
            i = int(excess_t.flatten().argmax())
            idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), b.shape))
            self.add(tensor, Check(
                label, part, step, excess,
                f"max abs error {diff.flatten()[i].item():.3g} at {idx or 'the value'} (got "
                f"{a.flatten()[i].item():.6g}, ref {b.flatten()[i].item():.6g}; allowed "
                f"atol {atol:g} + rtol {rtol:g} |ref|"
                + (f" + slack {float(torch.as_tensor(slack).flatten()[i]):.3g}"
                   if slack is not None else "")
                + ")",
            ))  # fmt: skip
        return diff.max().item()

    def __bool__(self) -> bool:
        return bool(self.by_tensor)

    def first_step(self, tensor: str) -> int | None:
        steps = [c.step for c in self.by_tensor[tensor] if c.step is not None]
        return min(steps) if steps else None

    def worst(self, tensor: str) -> float:
        return max(c.excess for c in self.by_tensor[tensor])

    def ranked(self) -> list[tuple[str, list[str]]]:
        """[(kind, tensors worst first)], kinds worst first."""
        kinds: dict[str, list[str]] = {}
        for tensor in self.by_tensor:
            kinds.setdefault(kind_of(tensor), []).append(tensor)
        for tensors in kinds.values():
            tensors.sort(key=lambda t: (-self.worst(t), t))
        return sorted(kinds.items(), key=lambda kv: (-self.worst(kv[1][0]), kv[0]))

    def message(self, per_tensor: int = 2, per_kind: int = 6) -> str:
        """The report: per kind, its ``per_kind`` worst tensors (and how many more), each
        with its first diverging step, the parts that diverge, and its ``per_tensor`` worst
        checks (earliest first among equals)."""
        n = len(self.by_tensor)
        first = [s for t in self.by_tensor if (s := self.first_step(t)) is not None]
        head = (
            f"{self.what}: {n} tensor{'s' if n != 1 else ''} diverge"
            + (f" from step {min(first)}" if first else "")
            + " (worst first; excess = error / allowed error)"
        )
        lines = [head.strip()]
        for kind, tensors in self.ranked():
            worst = self.worst(tensors[0])
            lines.append(
                f"  {kind} ({len(tensors)} tensor{'s' if len(tensors) != 1 else ''}, "
                f"worst excess {_fmt(worst)}):"
            )
            for tensor in tensors[:per_kind]:
                checks = self.by_tensor[tensor]
                parts = ", ".join(dict.fromkeys(c.part for c in checks))
                step = self.first_step(tensor)
                when = f"first diverges at step {step}" if step is not None else "diverges"
                lines.append(f"    {tensor}: {when} ({parts})")
                shown = sorted(checks, key=lambda c: (-c.excess, c.step or 0))[:per_tensor]
                lines += [f"      {c.label}: {c.detail}" for c in shown]
            if len(tensors) > per_kind:
                lines.append(f"    ... and {len(tensors) - per_kind} more {kind} tensors")
        return "\n".join(lines)


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"
