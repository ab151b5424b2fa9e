"""Writing: a checkpoint's files, durably, into its temporary directory (``.tmp-<name>``).

Nothing here makes a checkpoint visible: ``publish.py`` does that once everything is
written. Tensors go through ``torch.distributed.checkpoint`` (DCP), so sharded DTensor/FSDP
state saves per rank and reloads under another layout; the small extra state (scheduler,
data position, RNG, step, config) is checked to be plain data first, so that resume can
read it with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from moetrain.train.checkpoint.layout import (
    TMP_PREFIX,
    TRASH_PREFIX,
    CheckpointError,
    extra_name,
)


def check_plain(obj: Any, where: str) -> None:
    """Refuse anything ``torch.load(weights_only=True)`` would not read back, naming where."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise CheckpointError(
                    f"{where}: key {key!r} is a {type(key).__name__}; extra "
                    "dict keys must be str or int"
                )
            check_plain(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            check_plain(value, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; extra "
        "holds only dicts, lists, tuples, str, int, float, bool, None and "
        "plain tensors (convert numpy arrays and scalars to lists or tensors)"
    )


def serialize_extra(extra: dict[str, Any]) -> bytes:
    """``extra`` as ``torch.save`` bytes, refused (CheckpointError) unless it is plain data."""
    check_plain(extra, "extra")
    buf = io.BytesIO()
    torch.save(extra, buf)
    blob = buf.getvalue()
    # The real test of "plain": what resume will do with it.
    torch.load(io.BytesIO(blob), weights_only=True)
    return blob


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (on disk before anything names it)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (a crash may otherwise undo it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; single-process is supported here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def make_tmp_dir(root: Path, tmp: Path) -> None:
    """Rank 0, before a save: remove the leftovers of crashed saves and deletions under
    ``root`` (nobody else writes there during a save) and create an empty ``tmp``."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and entry.is_dir():
            shutil.rmtree(entry)
    tmp.mkdir()


def write_dcp(app_state: dict[str, Any], tmp: Path, process_group: Any, distributed: bool) -> None:
    """This rank's DCP shards (and, from the coordinator, ``.metadata``) into ``tmp``."""
    writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
    with quiet_single_process():
        dcp.save(
            app_state,
            storage_writer=writer,
            process_group=process_group,
            no_dist=not distributed,
        )


def write_extra(tmp: Path, blob: bytes | None, rank: int | None) -> None:
    """The serialized extra state as ``extra.pt`` (``rank`` None) or ``extra_rank<r>.pt``;
    nothing when ``blob`` is None (a rank that holds no extra state)."""
    if blob is not None:
        write_file(tmp / extra_name(rank), blob)
