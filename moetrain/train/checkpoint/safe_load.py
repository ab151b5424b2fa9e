"""Safe loading: reading a checkpoint never executes code from it.

DCP unpickles its ``.metadata`` with a plain ``pickle.load`` and reads non-tensor items (the
optimizer's hyperparameters) with ``torch.load(weights_only=False)``; the two classes here
replace both with loaders that only rebuild known, inert types.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

_SAFE_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_SAFE_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
)


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP metadata (dataclasses, torch.Size, dtypes, paths) and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        obj = super().find_class(module, name)
        if (module, name) in _SAFE_METADATA_GLOBALS:
            return obj
        if module in _SAFE_METADATA_MODULES and isinstance(obj, type):
            return obj
        if module == "torch" and isinstance(obj, torch.dtype):
            return obj
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which a checkpoint never needs: "
            "refusing to load it (it could execute code)"
        )


class SafeFileSystemReader(FileSystemReader):
    """A FileSystemReader whose .metadata is read by an allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Reads the checkpoint's non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
