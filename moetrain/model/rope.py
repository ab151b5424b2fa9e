"""Rotary position embeddings: frequency tables (plain, linear, YaRN, llama3 scaling) and the
two pairings of rotated dimensions.

"interleaved" rotates consecutive pairs (x0, x1), (x2, x3), ... (moetrain's original layout,
Meta's and DeepSeek's reference code); "half" rotates (x_i, x_{i + R/2}) (transformers'
``rotate_half``). They are the same rotation of a permuted head, so a model is only defined
together with its style (``model.rope_style``).

Shape legend: S sequence, R rotated width per head, B batch, H heads.
"""

from __future__ import annotations

import math

import torch

from moetrain.config import ModelConfig
from moetrain.model.precision import fp32_region


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """float64 inverse frequencies (R/2,) of ``cfg``'s RoPE and the factor its cos/sin tables
    carry (YaRN's attention factor; 1 otherwise). The formulas are transformers'
    (``modeling_rope_utils``), computed in float64."""
    dim, base, factor = cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling_factor
    inv_R = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    kind = cfg.rope_scaling
    if kind == "none":
        return inv_R, 1.0
    if kind == "linear":
        return inv_R / factor, 1.0
    original = cfg.rope_original_max_seq_len
    assert original is not None  # validated
    if kind == "llama3":
        low, high = cfg.rope_llama3_low_freq_factor, cfg.rope_llama3_high_freq_factor
        wavelen_R = 2 * math.pi / inv_R
        scaled_R = torch.where(wavelen_R > original / low, inv_R / factor, inv_R)
        smooth_R = (original / wavelen_R - low) / (high - low)
        smoothed_R = (1 - smooth_R) * scaled_R / factor + smooth_R * scaled_R
        medium_R = (wavelen_R >= original / high) & (wavelen_R <= original / low)
        return torch.where(medium_R, smoothed_R, scaled_R), 1.0
    # YaRN: interpolate the low frequencies, keep the high ones, ramp in between.
    mscale, mscale_all = cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim
    if mscale and mscale_all:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_yarn_beta_fast), correction_dim(cfg.rope_yarn_beta_slow)
    if cfg.rope_yarn_truncate:  # whole dimensions (gpt-oss keeps the fractional ends)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp_R = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_R = 1 - ramp_R
    inv_R = (inv_R / factor) * (1 - extrapolation_R) + inv_R * extrapolation_R
    return inv_R, attention_factor


def softmax_scale_factor(cfg: ModelConfig) -> float:
    """Extra factor of the attention softmax scale: YaRN's mscale(factor, mscale_all_dim)^2
    for multi-head latent attention (DeepSeek-V3), 1 otherwise."""
    if cfg.attention == "mla" and cfg.rope_scaling == "yarn" and cfg.rope_yarn_mscale_all_dim:
        return _yarn_mscale(cfg.rope_scaling_factor, cfg.rope_yarn_mscale_all_dim) ** 2
    return 1.0


ROPE_ROWS = 256
"""Positions computed at once by ``fill_rope_tables``: its float64 temporaries stay a few
hundred KB whatever ``model.max_seq_len`` (a model materialised on a rank holds little more
than its own shards)."""


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables of shape (max_seq_len, R/2), scaled by the attention factor."""
    shape = (cfg.max_seq_len, cfg.rope_dim // 2)
    cos, sin = torch.empty(shape), torch.empty(shape)
    fill_rope_tables(cfg, cos, sin)
    return cos, sin


@torch.no_grad()
def fill_rope_tables(cfg: ModelConfig, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> None:
    """Write ``rope_tables(cfg)`` into existing (max_seq_len, R/2) tensors, ``ROPE_ROWS``
    positions at a time (the same values: each is cos/sin of position x frequency, computed
    in float64). On the meta device nothing is computed."""
    if cos_SR.is_meta:
        return
    inv_R, attention_factor = rope_inv_freq(cfg)
    for start in range(0, cfg.max_seq_len, ROPE_ROWS):
        end = min(start + ROPE_ROWS, cfg.max_seq_len)
        angles_sR = torch.outer(torch.arange(start, end, dtype=torch.float64), inv_R)
        cos_SR[start:end].copy_(angles_sR.cos() * attention_factor)
        sin_SR[start:end].copy_(angles_sR.sin() * attention_factor)


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin rows of an attention call's S tokens: per-token rows (B, S, R/2) as they
    are, or the first S rows of a table (S', R/2) whose row i is the call's i-th position
    (the whole tables when the tokens are positions 0 .. S - 1)."""
    return (cos, sin) if cos.dim() == 3 else (cos[:S], sin[:S])


def apply_rope(
    x_BSHR: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor, style: str = "interleaved"
) -> torch.Tensor:
    """Rotate the pairs of ``style`` of each head by position-dependent angles: one row of
    angles per position (S, R/2), or per token (B, S, R/2)."""
    # In fp32 (the "rope" region of moetrain.model.precision), against the fp32 tables;
    # autocast never rounds these ops down.
    region = fp32_region("rope", x_BSHR.device.type)
    cos, sin = region.cast(cos_SR).unsqueeze(-2), region.cast(sin_SR).unsqueeze(-2)
    x = region.cast(x_BSHR)
    if style == "half":
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.type_as(x_BSHR)
    x = x.unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x_BSHR)


def half_to_interleaved(head_dim: int) -> torch.Tensor:
    """Permutation p of a head's R dims with ``x_interleaved = x_half[p]``: row i of a q/k
    projection in the interleaved style is row p[i] of the same projection in the half
    style (so the rotations agree)."""
    half = head_dim // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).flatten()
