"""RMSNorm, in fp32 whatever the input dtype; its weight in the compute dtype."""

from __future__ import annotations

import torch
from torch import nn

from moetrain.model.precision import as_compute, fp32_region


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (the "norm" region of moetrain.model.precision): bf16 sums of
        # squares lose too much precision. Autocast never rounds these ops down.
        x32 = fp32_region("norm", x.device.type).cast(x)
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # The weight rounded to the compute dtype, as FSDP2 gathers it under ZeRO-2/3: the
        # same numbers in one process and every layout (moetrain.model.precision).
        return out.type_as(x) * as_compute(self.weight)
