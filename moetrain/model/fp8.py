"""FP8 training of the model's GEMMs (``train.fp8``): which modules compute in FP8.

``convert_to_fp8`` turns, in place and before any parallelism is applied:

- every ``nn.Linear`` of the transformer blocks -- attention projections (GQA and MLA),
  dense SwiGLU FFNs, shared experts, multi-token prediction's projection -- into an
  ``Fp8Linear`` (an ``nn.Linear`` with the same parameters and names, so checkpoints,
  tensor-parallel styles and FSDP see nothing new), unless its input or output width is
  not a multiple of 16 (what ``torch._scaled_mm`` needs; both backends skip the same
  layers);
- the routed experts' grouped GEMMs (``moe.experts.fp8``), when ``fp8_experts``.

High precision stays where FP8's 3 or 2 mantissa bits would move what the run decides or
measures: the router's gate (fp32, routing decisions), the shared-expert gate (one output
column), the token embeddings, the output head and the loss, every norm, attention's softmax
and the optimizer (parameters, gradients and moments keep their dtypes; only GEMM inputs are
cast). The recipe and its scales: ``moetrain.kernels.fp8`` and docs/fp8.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrain.kernels.fp8 import Recipe, fp8_linear, get_recipe
from moetrain.model.experts import GroupedExperts

EXCLUDED = ("router.gate", "shared_expert_gate")
"""Linear layers of the blocks that stay in high precision (names end with these)."""
ALIGN = 16
"""FP8 GEMMs need both widths of a linear to be multiples of this."""


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose forward and dgrad GEMMs run in FP8 (``recipe``, ``backend``)."""

    recipe: Recipe
    backend: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.recipe, self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.recipe.name}, backend={self.backend}"


@dataclass
class Fp8Conversion:
    """What ``convert_to_fp8`` changed: names of the converted linears, the linears left in
    high precision for their widths, the MoE layers whose experts compute in FP8."""

    linears: list[str]
    unaligned: list[str]
    expert_layers: list[str]


def _fp8_linear(old: nn.Linear, recipe: Recipe, backend: str) -> Fp8Linear:
    new = Fp8Linear.__new__(Fp8Linear)
    nn.Module.__init__(new)
    new.in_features, new.out_features = old.in_features, old.out_features
    new.weight = old.weight  # the same Parameter objects: ties and optimizer groups hold
    new.bias = old.bias
    new.recipe, new.backend = recipe, backend
    return new


def convert_to_fp8(
    model: nn.Module, recipe: str, experts: bool = True, backend: str = "emulated"
) -> Fp8Conversion:
    """Make the GEMMs of ``model``'s blocks (``model.layers``) FP8 with ``recipe``
    ("tensorwise" or "rowwise"), the routed experts' too when ``experts``; ``backend`` is
    "emulated" or "scaled_mm" (``moetrain.kernels.fp8.resolve_backend`` picks one)."""
    r = get_recipe(recipe)
    out = Fp8Conversion([], [], [])
    blocks = getattr(model, "layers", model)
    for block_name, block in blocks.named_children():
        for name, module in list(block.named_modules()):
            full = f"layers.{block_name}.{name}"
            if isinstance(module, GroupedExperts) and experts:
                module.fp8 = (r, backend)
                out.expert_layers.append(full)
                continue
            if type(module) is not nn.Linear or name.endswith(EXCLUDED):
                continue
            if module.in_features % ALIGN or module.out_features % ALIGN:
                out.unaligned.append(full)
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, attr, _fp8_linear(module, r, backend))
            out.linears.append(full)
    return out
