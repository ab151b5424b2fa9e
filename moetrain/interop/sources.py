"""Where each moetrain tensor comes from in a Hugging Face checkpoint, and a DCP storage reader
that serves any slice of it.

A family adapter maps every moetrain state-dict name to a ``Source``: a tensor of the HF
checkpoint (or a block of its rows), the per-expert matrices stacked and transposed into
moetrain's grouped (E, in, out) layout, or a generated tensor (sparse upcycling). A source
reads any region of its moetrain tensor from the safetensors slices it needs and nothing
else, and exports a moetrain tensor back into HF pieces.

``HFStorageReader`` presents those sources to ``torch.distributed.checkpoint`` as a
checkpoint in moetrain's names and shapes: ``dcp.load`` of a state dict of any layout
(DTensor shards under TP/FSDP, expert slices under EP, the layers of a pipeline stage) asks
each rank for exactly the regions it holds, which the sources cut from the shards with
``safe_open(...).get_slice`` (the approach of torch's ``HuggingFaceStorageReader``, with a
name and layout mapping in between).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from moetrain.interop.hf_files import HFDirectory

Region = tuple[slice, ...]
Piece = tuple[str, tuple[Any, ...], torch.Tensor]
"""What a source exports: (HF name, the index of the HF tensor the piece fills, the piece)."""


def _full(shape: tuple[int, ...]) -> Region:
    return tuple(slice(0, n) for n in shape)


@dataclass(frozen=True)
class Rows:
    """hf[key][row0 : row0 + shape[0]]: the whole tensor, or a block of its rows when the
    checkpoint stacks several moetrain tensors in one (``hf_rows`` is then its row count)."""

    key: str
    shape: tuple[int, ...]
    row0: int = 0
    hf_rows: int | None = None
    copies: tuple[str, ...] = ()
    """More HF names that export writes the same tensor under (DeepSeek-V3's
    multi-token-prediction layer keeps its own copy of the embedding and the head); an
    import checks each one it finds equal to ``key`` (``accounting.shared_copies``)."""

    def hf_shapes(self) -> dict[str, tuple[int, ...] | None]:
        return {self.key: (self.hf_rows or self.shape[0], *self.shape[1:])}

    def read(self, hf: HFDirectory, region: Region) -> torch.Tensor:
        rows = slice(self.row0 + region[0].start, self.row0 + region[0].stop)
        return hf.read(self.key, (rows, *region[1:]))

    def export(self, t: torch.Tensor) -> list[Piece]:
        rows = (slice(self.row0, self.row0 + t.shape[0]),)
        return [(self.key, rows, t)] + [(key, rows, t.clone()) for key in self.copies]


@dataclass(frozen=True)
class Stacked:
    """moetrain (E, in, out) grouped experts = stack over e of hf[keys[e]] (out, in), transposed."""

    keys: tuple[str, ...]
    shape: tuple[int, int, int]

    def hf_shapes(self) -> dict[str, tuple[int, ...] | None]:
        return {k: (self.shape[2], self.shape[1]) for k in self.keys}

    def read(self, hf: HFDirectory, region: Region) -> torch.Tensor:
        experts, rows, cols = region
        return torch.stack(
            [hf.read(self.keys[e], (cols, rows)).T for e in range(experts.start, experts.stop)]
        )

    def export(self, t: torch.Tensor) -> list[Piece]:
        return [(k, (), t[e].T) for e, k in enumerate(self.keys)]


@dataclass(frozen=True)
class Interleaved:
    """hf[key][..., parity::2]: one of two tensors a checkpoint interleaves along its last dim
    (gpt-oss's ``gate_up_proj``, (E, D, 2F), and its bias, (E, 2F): the gate at even columns,
    the up projection at odd ones). ``shape``: the moetrain tensor's."""

    key: str
    shape: tuple[int, ...]
    parity: int

    def hf_shapes(self) -> dict[str, tuple[int, ...] | None]:
        return {self.key: (*self.shape[:-1], 2 * self.shape[-1])}

    def read(self, hf: HFDirectory, region: Region) -> torch.Tensor:
        *lead, cols = region
        return hf.read(self.key, (*lead, slice(2 * cols.start, 2 * cols.stop)))[
            ..., self.parity :: 2
        ]

    def export(self, t: torch.Tensor) -> list[Piece]:
        return [(self.key, (..., slice(self.parity, None, 2)), t)]


@dataclass(frozen=True)
class Mxfp4Experts:
    """A grouped expert tensor (E, in, out) stored MXFP4-packed (``moetrain.interop.mxfp4``):
    ``key``_blocks (E, hf_out, in / 32, 16) and ``key``_scales (E, hf_out, in / 32), with
    hf_out = out, or 2 out when two tensors are interleaved along it (``parity``: which one,
    as ``Interleaved``). Read regions are dequantized from the blocks that cover them, in
    ``dtype``; export writes the plain tensor (``Interleaved`` / ``Rows``), not this."""

    key: str
    shape: tuple[int, int, int]
    parity: int | None = None
    dtype: torch.dtype = torch.bfloat16

    def hf_shapes(self) -> dict[str, tuple[int, ...] | None]:
        from moetrain.interop.mxfp4 import BLOCK

        E, n_in, n_out = self.shape
        out = n_out if self.parity is None else 2 * n_out
        return {f"{self.key}_blocks": (E, out, n_in // BLOCK, BLOCK // 2),
                f"{self.key}_scales": (E, out, n_in // BLOCK)}  # fmt: skip

    def read(self, hf: HFDirectory, region: Region) -> torch.Tensor:
        from moetrain.interop.mxfp4 import BLOCK, dequantize_mxfp4

        experts, rows, cols = region
        if self.parity is not None:
            cols = slice(2 * cols.start, 2 * cols.stop)
        g0, g1 = rows.start // BLOCK, -(-rows.stop // BLOCK)
        blocks = hf.read(f"{self.key}_blocks", (experts, cols, slice(g0, g1)))
        scales = hf.read(f"{self.key}_scales", (experts, cols, slice(g0, g1)))
        w = dequantize_mxfp4(blocks, scales, self.dtype)  # (e, cols, (g1 - g0) * 32)
        w = w[..., rows.start - g0 * BLOCK : rows.stop - g0 * BLOCK].transpose(1, 2)
        return w if self.parity is None else w[..., self.parity :: 2]

    def export(self, t: torch.Tensor) -> list[Piece]:
        raise NotImplementedError("MXFP4 tensors are exported dequantized by their family")


@dataclass(frozen=True)
class ExpertCopies:
    """Sparse upcycling: expert e is part e % parts of one dense SwiGLU matrix, transposed into
    the grouped layout, times ``scale`` and (1 + N(0, noise^2)) noise drawn per expert from
    ``seed`` (the same values on every rank, whichever slice it reads).

    ``hidden_dim``: the dense matrix's dim that holds the FFN hidden units (0 for
    gate/up_proj (F, D), 1 for down_proj (D, F)); the part is cut along it."""

    key: str
    shape: tuple[int, int, int]
    parts: int
    hidden_dim: int
    scale: float = 1.0
    noise: float = 0.0
    seed: int = 0

    def hf_shapes(self) -> dict[str, tuple[int, ...] | None]:
        _, rows, cols = self.shape  # (E, in, out); the dense matrix is (out, in) with parts
        dense = [cols, rows]
        dense[self.hidden_dim] *= self.parts
        return {self.key: tuple(dense)}

    def read(self, hf: HFDirectory, region: Region) -> torch.Tensor:
        experts, rows, cols = region
        width = self.shape[1 + (1 - self.hidden_dim)]  # hidden units per part
        out = []
        for e in range(experts.start, experts.stop):
            off = (e % self.parts) * width
            index = [cols, rows]
            part = index[self.hidden_dim]
            index[self.hidden_dim] = slice(off + part.start, off + part.stop)
            w = hf.read(self.key, tuple(index)).T.float() * self.scale
            if self.noise:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + e)
                noise = torch.randn(self.shape[1:], generator=gen, dtype=torch.float32)
                w = w * (1 + self.noise * noise[rows, cols])
            out.append(w)
        return torch.stack(out)

    def export(self, t: torch.Tensor) -> list[Piece]:
        raise NotImplementedError("upcycled experts are exported through their MoE family")


@dataclass(frozen=True)
class Generated:
    """A tensor drawn from N(0, std^2) with a fixed seed (zeros when std = 0): an upcycled
    router. Every rank draws the whole tensor and keeps its region."""

    shape: tuple[int, ...]
    std: float
    seed: int

    def hf_shapes(self) -> dict[str, tuple[int, ...] | None]:
        return {}

    def read(self, hf: HFDirectory, region: Region) -> torch.Tensor:
        if self.std == 0:
            return torch.zeros(tuple(s.stop - s.start for s in region))
        gen = torch.Generator().manual_seed(self.seed)
        return (torch.randn(self.shape, generator=gen) * self.std)[region]

    def export(self, t: torch.Tensor) -> list[Piece]:
        raise NotImplementedError("generated tensors are exported through their MoE family")


Source = Rows | Stacked | Interleaved | Mxfp4Experts | ExpertCopies | Generated


def read_full(hf: HFDirectory, source: Source) -> torch.Tensor:
    return source.read(hf, _full(source.shape))


class HFStorageReader(StorageReader):
    """A DCP ``StorageReader`` over a Hugging Face directory in moetrain's names and shapes.

    Each moetrain tensor is declared as one chunk of its full shape; a load plan's read item
    names a region of it, which ``read_data`` cuts from the safetensors shards through the
    tensor's source."""

    def __init__(self, hf: HFDirectory, sources: dict[str, Source]) -> None:
        super().__init__()
        self.hf = hf
        self.sources = sources

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for name, src in self.sources.items():
            size = torch.Size(src.shape)
            zeros = torch.Size([0] * len(size))
            md[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.float32),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=zeros, sizes=size)],
            )
            storage[MetadataIndex(name, zeros)] = name
        return Metadata(state_dict_metadata=md, storage_data=storage)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *a: Any, **kw: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            region = tuple(
                slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths, strict=True)
            )
            value = self.sources[req.storage_index.fqn].read(self.hf, region)
            target = planner.resolve_tensor(req).detach()
            if tuple(target.shape) != tuple(value.shape):
                raise AssertionError(
                    f"{req.storage_index.fqn}: region {region} read as {tuple(value.shape)}, "
                    f"the model holds {tuple(target.shape)}"
                )
            target.copy_(value)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True
