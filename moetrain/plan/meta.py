"""What makes a meta-device build of a 2,048-rank job take seconds, not minutes, with the
same shapes and dtypes as a real one: FSDP2's per-rank chunks made only when read, and an
optimizer step without its arithmetic (the model itself is built without fills by
``moetrain.model.meta_model``, as the trainer builds it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Chunks:
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to n, computed on demand:
    FSDP2 reads chunk 0 (the padded size) and its own rank's, and building every chunk of
    every parameter costs seconds at thousands of ranks."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int) -> None:
        self.tensor, self.n, self.dim = tensor, n, dim
        self.size = -(-tensor.size(dim) // n) if tensor.size(dim) else 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        i = range(self.n)[i]
        start = i * self.size
        if self.size == 0 or start >= self.tensor.size(self.dim):
            return self.tensor.new_empty(0)
        length = min(self.size, self.tensor.size(self.dim) - start)
        return self.tensor.narrow(self.dim, start, length)


@contextlib.contextmanager
def fast_fsdp_chunks() -> Iterator[None]:
    """FSDP2's ``_chunk_with_empty`` as ``_Chunks`` while a plan builds (the same chunks,
    made only when read); left alone if this torch has no such function."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        yield
        return
    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return
    _fsdp_param._chunk_with_empty = _Chunks
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


class SkipInPlace(TorchDispatchMode):
    """An optimizer step on meta tensors without its arithmetic: an in-place op on a meta
    tensor returns it as it is (its shape and dtype cannot change), everything else runs (the
    states the optimizer creates, with the shapes and dtypes it chooses; its step counters,
    on the CPU)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func._schema.name
        first = args[0] if args else None
        if isinstance(first, (list, tuple)) and first:
            first = first[0]
        if name.endswith("_") and isinstance(first, torch.Tensor) and first.is_meta:
            return None if name.startswith("aten::_foreach_") else args[0]
        return func(*args, **(kwargs or {}))
