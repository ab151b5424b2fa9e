"""A transformers checkpoint directory on disk: config.json, safetensors shards (one file or
an index), tokenizer files. Reading checks every shard's header against its size (a
truncated or missing shard fails here, before any tensor is read) and reads tensors or
slices of them with ``safetensors.safe_open(...).get_slice``; writing produces the sharded
layout ``save_pretrained`` does.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from moetrain.interop.errors import HFCheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


def _read_header(path: Path) -> dict:
    """The JSON header of a safetensors file, checked against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HFCheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise HFCheckpointError(
                    f"{path}: truncated safetensors file (header of {n} bytes, file {size})"
                )
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise HFCheckpointError(f"{path}: missing safetensors shard") from None
    except (OSError, ValueError) as exc:
        raise HFCheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise HFCheckpointError(
            f"{path}: truncated safetensors file: its header needs {8 + n + end} bytes, the "
            f"file has {size}"
        )
    return header


class HFDirectory:
    """A local directory saved by transformers: its config and the tensors of its shards."""

    def __init__(self, path: str | Path, key: str = "HF_DIR") -> None:
        self.path = Path(path).expanduser()
        self.key = key
        if not self.path.is_dir():
            raise HFCheckpointError(f"{key}: {str(self.path)!r} is not a directory")
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise HFCheckpointError(
                f"{key}: {self.path} has no config.json (not a directory saved by "
                "transformers' save_pretrained)"
            )
        try:
            self.config: dict = json.loads(cfg_path.read_text())
        except ValueError as exc:
            raise HFCheckpointError(f"{key}: {cfg_path} is not valid JSON ({exc})") from None
        if not isinstance(self.config, dict):
            raise HFCheckpointError(f"{key}: {cfg_path} does not hold a JSON object")
        self._tensors: dict[str, TensorInfo] | None = None

    # ------------------------------------------------------------------ tensors

    def shard_files(self) -> list[Path]:
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise HFCheckpointError(
                    f"{self.key}: {index} is not a safetensors index ({exc})"
                ) from None
            return [self.path / name for name in sorted(set(weight_map.values()))]
        if (self.path / SINGLE).is_file():
            return [self.path / SINGLE]
        found = sorted(self.path.glob("*.safetensors"))
        if not found:
            bins = sorted(p.name for p in self.path.glob("*.bin"))
            hint = f" (it has {bins[0]}...: re-save with safe_serialization)" if bins else ""
            raise HFCheckpointError(f"{self.key}: {self.path} has no safetensors weights{hint}")
        return found

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor of every shard: name -> file, shape, dtype (headers only)."""
        if self._tensors is None:
            tensors: dict[str, TensorInfo] = {}
            for file in self.shard_files():
                for name, info in _read_header(file).items():
                    if name == "__metadata__":
                        continue
                    dtype = _DTYPES.get(info["dtype"])
                    if dtype is None:
                        raise HFCheckpointError(
                            f"{self.key}: {file.name} stores {name} as {info['dtype']}, which "
                            "moetrain does not read (quantized checkpoints: dequantize to bf16 "
                            "or fp32 first)"
                        )
                    tensors[name] = TensorInfo(file, tuple(info["shape"]), dtype)
            index = self.path / INDEX
            if index.is_file():
                listed = set(json.loads(index.read_text())["weight_map"])
                missing = sorted(listed - set(tensors))
                if missing:
                    raise HFCheckpointError(
                        f"{self.key}: {INDEX} lists {len(missing)} tensors no shard holds, "
                        f"e.g. {missing[0]}"
                    )
            self._tensors = tensors
        return self._tensors

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``name`` or the slice ``index`` of it, read from its shard."""
        from safetensors import safe_open

        info = self.tensors[name]
        with safe_open(str(info.file), framework="pt") as f:
            if index is None:
                return f.get_tensor(name)
            return f.get_slice(name)[index]

    def has_tokenizer(self) -> bool:
        return (self.path / "tokenizer.json").is_file()


# ---------------------------------------------------------------------- writing


def write_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Write ``(name, tensor)`` pairs as safetensors shards of at most ``max_shard_bytes``
    (``model.safetensors`` when one is enough, else ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json``), as ``save_pretrained`` lays them out. Tensors arrive
    one by one, so the whole model never has to be in memory. Returns the file names."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        tmp = out / f".shard-{len(written):05d}.tmp"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        written.append((tmp, list(shard)))
        shard, shard_bytes = {}, 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[name] = t.detach().contiguous().cpu()
        shard_bytes += nbytes
        total += nbytes
    flush()
    if len(written) == 1:
        os.replace(written[0][0], out / SINGLE)
        return [SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    weight_map = {}
    for (tmp, keys), name in zip(written, names, strict=True):
        os.replace(tmp, out / name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX]
