"""MXFP4 expert weights (gpt-oss's published checkpoints), dequantized on import.

A quantized tensor ``W`` (E, out, in) is stored as ``<name>_blocks`` (E, out, in / 32, 16)
uint8, two FP4 (e2m1) values a byte, low nibble first, and ``<name>_scales`` (E, out, in / 32)
uint8, one power-of-two exponent per block of 32 values, biased by 127 (OCP's MX format).
The moetrain tensor is W transposed to (E, in, out), as transformers' own conversion gives
it (``transformers.integrations.mxfp4.convert_moe_packed_tensors``, which tests/interop
checks this against).
"""

from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
"""The e2m1 value of each 4-bit code."""

BLOCK = 32
"""Values per scale."""


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(..., G, 16) uint8 blocks and (..., G) uint8 exponents -> (..., G * 32) values in
    ``dtype`` (computed in fp32, where every e2m1 value times a power of two is exact)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            f"(blocks are (..., G, {BLOCK // 2}), scales (..., G))"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    values = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1)
    exponents = scales.to(torch.int32) - 127
    out = torch.ldexp(values.flatten(-2), exponents[..., None])
    return out.flatten(-2).to(dtype)
