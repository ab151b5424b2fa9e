"""Initial parameters and buffers: the same values under every layout, drawn a slice at a time.

A parameter's initial value is a function of (``train.seed``, its full-model name, the
position in the tensor) and never of how the model is split over ranks. Each parameter is
cut along dim 0 into fixed blocks, drawn from generators of their own:

    block b of parameter ``name`` = normal(0, std) from a CPU generator seeded by
                                    hash(seed, name, b)
    blocks                        one expert of a stacked expert tensor (E, ...); else
                                  ``INIT_BLOCK_NUMEL // row size`` rows (whole rows, at
                                  least one)

A rank holding a slice of a parameter (a tensor-parallel row or column shard, an FSDP chunk
of rows, its experts under expert parallelism, a pipeline stage's layers) draws only the
blocks that cover its rows, one at a time, and keeps what it holds of each: its start-up
memory is its own shards plus one block (``fill_slice``). A column shard draws whole rows
and keeps its columns (tp x the drawing, not the memory). The blocks are drawn on the CPU
whatever the device, so that a run starts from the same weights on a GPU as on a CPU.

The rules (``param_init``): normal(0, ``model.init_std``) for every matrix, the residual
output projections (attention ``wo``, every ``w2``) at ``init_std / sqrt(2 n_layers)``;
norm weights at one; biases and attention sinks at zero. Tied embeddings are one tensor
(initialised once, as the embedding); the multi-token-prediction embedding copy of a
pipeline's last stage has the embedding's name, hence its values.

Buffers are not parameters: every module that owns buffers recomputes them in its
``init_buffers()`` (RoPE tables, the expert bias, the statistics counters), which
``init_buffers`` calls after a meta-device model is materialised (``to_empty``), and refuses
a module that owns buffers without one.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from moetrain.config import ModelConfig
from moetrain.model.experts import GroupedExperts
from moetrain.model.norm import RMSNorm

INIT_BLOCK_NUMEL = 1 << 20
"""Elements of a dense parameter's generator block (whole rows of dim 0): 4 MB in fp32.
An expert of a stacked expert tensor is one block whatever its size."""

RESIDUAL_OUTPUTS = ("attention.wo.weight", "w2.weight", "experts.w2")
"""Residual-stream output projections, initialised at init_std / sqrt(2 n_layers)."""
ZERO_INIT = (".bias", "experts.b1", "experts.b3", "experts.b2", ".sinks")
"""Parameters that start at zero: biases (attention, router, experts) and attention sinks."""

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_INITS = ("normal_", "uniform_", "zeros_", "ones_", "kaiming_uniform_", "trunc_normal_")


def fqn(name: str) -> str:
    """A parameter's name as state dicts spell it (wrapper prefixes removed): the full-model
    name, the same under every layout."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """``torch.nn.init``'s fills as no-ops while a model is built on the meta device: meta
    tensors hold no values (``param_init`` decides them later), and torch's meta ``normal_``
    runs a Python decomposition (~1 ms a tensor: seconds for DeepSeek-V3's thousand
    weights)."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


@dataclass(frozen=True)
class ParamInit:
    """How one parameter starts: ``fill`` "normal" (with ``std``), "zeros" or "ones";
    ``expert_blocks``: dim 0 indexes experts, one generator block each."""

    fill: str
    std: float = 0.0
    expert_blocks: bool = False

    def block_rows(self, shape: tuple[int, ...]) -> int:
        """Rows of dim 0 per generator block of a parameter of (global) ``shape``."""
        if self.expert_blocks:
            return 1
        return max(1, INIT_BLOCK_NUMEL // max(1, math.prod(shape[1:])))


def param_init(module: nn.Module, attr: str, name: str, cfg: ModelConfig) -> ParamInit:
    """The rule of parameter ``attr`` of ``module`` (full-model name ``name``)."""
    p = module._parameters[attr]
    assert p is not None
    if isinstance(module, RMSNorm):
        return ParamInit("ones")
    if name.endswith(ZERO_INIT):
        return ParamInit("zeros")
    if p.dim() >= 2:
        std = cfg.init_std
        if name.endswith(RESIDUAL_OUTPUTS):
            std = std / math.sqrt(2 * cfg.n_layers)
        return ParamInit("normal", std, expert_blocks=isinstance(module, GroupedExperts))
    raise ValueError(f"no initialisation rule for parameter {name} of shape {tuple(p.shape)} "
                     "(moetrain.model.init.param_init)")  # fmt: skip


def named_inits(
    model: nn.Module, cfg: ModelConfig
) -> Iterator[tuple[str, nn.Parameter, ParamInit]]:
    """(full-model name, parameter, rule) of every distinct parameter of ``model`` (a tied
    weight once, under its first name: the embedding's), in registration order."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for attr, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            name = fqn(f"{module_name}.{attr}" if module_name else attr)
            yield name, p, param_init(module, attr, name, cfg)


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of block ``block`` of parameter ``name`` (63 bits)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def covering_blocks(
    rule: ParamInit, shape: tuple[int, ...], row0: int, rows: int
) -> Iterator[tuple[int, int, int]]:
    """(block index, first row, end row) of the blocks covering rows [row0, row0 + rows)
    of a parameter of global ``shape``."""
    if rows <= 0:
        return
    per = rule.block_rows(shape)
    for b in range(row0 // per, -(-(row0 + rows) // per)):
        yield b, b * per, min((b + 1) * per, shape[0])


Slice = tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]
"""(the tensor this rank holds of a parameter, the parameter's global shape, the global
offset of the held tensor along each dim)."""


def whole(name: str, p: torch.Tensor) -> Slice:
    """A parameter held whole (one process, or replicated)."""
    return p, tuple(p.shape), (0,) * p.dim()


def largest_block(shape: tuple[int, ...], rule: ParamInit, offsets: tuple[int, ...],
                  local_shape: tuple[int, ...]) -> int:  # fmt: skip
    """Elements of the largest block ``fill_slice`` draws for this slice (0: none)."""
    if rule.fill != "normal" or 0 in local_shape:
        return 0
    row = math.prod(shape[1:])
    blocks = covering_blocks(rule, shape, offsets[0], local_shape[0])
    return max(((end - start) * row for _, start, end in blocks), default=0)


@torch.no_grad()
def fill_slice(out: torch.Tensor, name: str, rule: ParamInit, shape: tuple[int, ...],
               offsets: tuple[int, ...], seed: int) -> int:  # fmt: skip
    """Write into ``out`` its region of parameter ``name``'s initial value: the global
    tensor of ``shape`` at ``offsets`` (any device). Returns the elements of the largest
    block drawn."""
    if rule.fill == "zeros":
        out.zero_()
        return 0
    if rule.fill == "ones":
        out.fill_(1.0)
        return 0
    if out.numel() == 0:
        return 0
    row0, rows = offsets[0], out.shape[0]
    rest = tuple(slice(o, o + n) for o, n in zip(offsets[1:], out.shape[1:], strict=True))
    largest = 0
    for b, start, end in covering_blocks(rule, shape, row0, rows):
        gen = torch.Generator(device="cpu")
        gen.manual_seed(block_seed(seed, name, b))
        block = torch.empty((end - start, *shape[1:]), dtype=torch.float32)
        block.normal_(0.0, rule.std, generator=gen)
        largest = max(largest, block.numel())
        lo, hi = max(start, row0), min(end, row0 + rows)
        out[lo - row0 : hi - row0].copy_(block[(slice(lo - start, hi - start), *rest)])
        del block
    return largest


Where = Callable[[str, torch.Tensor], Slice]
"""``where(name, param) -> Slice``: what this rank holds of a parameter (``whole`` in one
process; ``moetrain.parallel.materialize.local_slice`` under a layout)."""


def init_parameters(
    model: nn.Module,
    cfg: ModelConfig,
    seed: int,
    where: Where = whole,
    skip: Collection[str] = (),
) -> int:
    """Initialise every parameter of ``model`` (a whole model, or this rank's chunk of one)
    from ``seed`` by its rule, each only in the region this rank holds (``where``).
    ``skip``: full-model names drawn from no generator (weights a start loads next): they
    hold NaN until it does, so that an element the start misses shows in the first loss
    rather than training on whatever the memory held. Returns the elements of the largest
    block drawn."""
    largest = 0
    for name, p, rule in named_inits(model, cfg):
        local, shape, offsets = where(name, p)
        if name in skip:
            with torch.no_grad():
                local.fill_(math.nan)
            continue
        largest = max(largest, fill_slice(local, name, rule, shape, offsets, seed))
    return largest


def to_empty(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model.to_empty(device=device)`` (storage for every meta tensor, values
    uninitialised) keeping each parameter the same Python object with its attributes: tied
    weights stay one tensor, and what was built around the meta model (lists of the expert
    parameters and their marks, FSDP's parameter groups, pipeline stages) stays valid.
    torch swaps the new storage into the old objects (``swap_module_params_on_conversion``;
    plain tensors would otherwise come back as new ``Parameter`` objects), but a swap swaps
    their ``__dict__`` too: the attributes missing after it are put back."""
    attrs = [(p, dict(p.__dict__)) for p in model.parameters()]
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    for p, saved in attrs:
        for key, value in saved.items():
            p.__dict__.setdefault(key, value)
    return model


@torch.no_grad()
def init_buffers(model: nn.Module) -> None:
    """Recompute every buffer of ``model`` (after ``to_empty`` they hold garbage): each module
    owning buffers does its own (``init_buffers()``); one without that method is refused."""
    for name, module in model.named_modules():
        if all(b is None for b in module._buffers.values()):
            continue
        method = getattr(type(module), "init_buffers", None)
        if method is None:
            raise TypeError(
                f"{type(module).__name__} {fqn(name) or '(root)'} owns buffers "
                f"{sorted(module._buffers)} but no init_buffers() to recompute them after a "
                "meta-device build (moetrain.model.init)"
            )
        module.init_buffers()
