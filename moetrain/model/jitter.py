"""Router input jitter that does not depend on the parallel layout.

Switch Transformer's jitter multiplies the router input by U(1 - eps, 1 + eps) per element.
Drawn from a generator, the factor a token gets would depend on how many tokens the rank
drew before it: on the data-parallel rank, the micro-batch, the pipeline schedule and the
recomputation of activation checkpointing. Here each factor is a counter-based hash of
where the element is in the training run,

    (seed, optimizer step, layer, global sequence index, position in the sequence, feature)

so every layout, and a resumed run, draws exactly the factors one uninterrupted process
draws, with no generator state to carry. The hash is splitmix64's finalizer over int64
(wrapping multiplies, logical shifts emulated by masking).
"""

from __future__ import annotations

import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_M1 = -49064778989728563  # 0xff51afd7ed558ccd
_M2 = -4265267296055464877  # 0xc4ceb9fe1a85ec53


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 33)) * _M1
    x = (x ^ _shr(x, 33)) * _M2
    return x ^ _shr(x, 33)


def _combine(h: torch.Tensor, v: torch.Tensor | int) -> torch.Tensor:
    return _mix(h + _GOLDEN + v * 2 + 1)


def feature_hashes(dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 (dim,): the hash of each feature index, the last input of every factor."""
    return _mix(torch.arange(dim, dtype=torch.int64, device=device) * _GOLDEN + 1)


def jitter_factors(
    eps: float,
    key: tuple[int | torch.Tensor, int | torch.Tensor, int | torch.Tensor],
    seq_T: torch.Tensor,
    pos_T: torch.Tensor,
    dim: int,
    hashes_D: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T, dim) factors in [1 - eps, 1 + eps) for the tokens at global sequence ``seq_T`` and
    position ``pos_T``; ``key`` = (seed, step, layer), ints or int64 scalar tensors (a
    compiled model takes tensors: an int would be compiled in as a constant, and change
    every step). Uniform to 24 bits.

    ``hashes_D``: ``feature_hashes(dim)``, computed once beforehand. Under torch.compile
    the hashes must come in as a tensor: computed in the graph, the CPU compiler emits
    ``index * constant`` in 64-bit signed arithmetic, whose overflow C++ leaves undefined,
    and gcc's loop optimisations then break the whole fused loop."""
    seed, step, layer = key
    device = seq_T.device
    if isinstance(seed, torch.Tensor):
        h = seed.to(device, torch.int64)
    else:  # filled on the device: a tensor made from a host int would be copied over
        h = torch.full((), seed, dtype=torch.int64, device=device)
    for v in (step, layer):
        h = _combine(h, v)
    h_T = _combine(_combine(h, seq_T.to(torch.int64)), pos_T.to(torch.int64))
    d_D = feature_hashes(dim, device) if hashes_D is None else hashes_D
    bits_TD = _shr(_mix(h_T[:, None] ^ d_D[None, :]), 40)  # top 24 bits
    u_TD = bits_TD.to(torch.float32) * (1.0 / (1 << 24))
    return 1.0 - eps + (2.0 * eps) * u_TD
