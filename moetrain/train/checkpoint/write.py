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
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.tensor import DTensor

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
    """This rank's DCP shards (and, from the coordinator, ``.metadata``) into ``tmp``.

    Without the CRC32 that ``torch.save`` computes over every byte by default: ``torch.load``
    never checks it (a flipped byte loads either way), and computing it costs a core about
    1.3 s per 300 MB (``torch.save`` of 300 MB alone: 1.69 s with it, 0.37 s without), CPU
    that an asynchronous save would take from the steps beside it. The verification checks
    sizes and byte ranges (``verify.py``). The shards go to disk as they are written, a
    chunk at a time (``SyncingStream``)."""
    writer = _SyncingWriter(tmp, single_file_per_rank=True, sync_files=True)
    with quiet_single_process(), _without_crc32():
        dcp.save(
            app_state,
            storage_writer=writer,
            process_group=process_group,
            no_dist=not distributed,
        )


SYNC_CHUNK = 64 << 20  # bytes written between two syncs of a shard file


class SyncingStream:
    """A shard file that goes to disk as it is written: every ``SYNC_CHUNK`` bytes it is
    synced (``fdatasync``) and its pages dropped from the page cache.

    Written whole and synced once at the end, a checkpoint first fills the page cache with
    dirty pages (gigabytes, below the kernel's writeback threshold) and then waits for them
    all in one ``fsync``; the copying into fresh cache pages, the burst of writeback and the
    freeing of those pages at the next prune take CPU and memory bandwidth from the steps an
    asynchronous save runs beside. Chunked, the write proceeds at the disk's pace and the
    cache stays small (tools/bench_checkpoint.py measures the steps beside a save;
    docs/checkpoints.md)."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self._fd = file.fileno()
        self._unsynced = 0

    def write(self, data: Any) -> int:
        written = self._file.write(data)
        self._unsynced += written
        if self._unsynced >= SYNC_CHUNK:
            self._sync()
        return written

    def _sync(self) -> None:
        self._file.flush()
        _datasync(self._fd)
        if hasattr(os, "posix_fadvise"):  # clean pages now: dropping them loses nothing
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self._unsynced = 0

    def close(self) -> None:
        """Sync what is left and close. (DCP fsyncs a shard's descriptor before it closes
        the buffered file, which leaves the buffer's last bytes unsynced; this sync has
        them.)"""
        self._sync()
        self._file.close()

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._fd


def _datasync(fd: int) -> None:
    (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)


class _SyncingFileSystem(FileSystem):
    """DCP's local file system, its shard files written through ``SyncingStream``."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            yield SyncingStream(stream) if "w" in mode else stream


class _SyncingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` over ``_SyncingFileSystem``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = _SyncingFileSystem()


def _without_crc32() -> contextlib.AbstractContextManager[Any]:
    """``torch.save`` without its CRC32 (torch's serialization config; process-wide while
    it lasts), or nothing where this torch has no such setting."""
    try:
        from torch.utils.serialization import config

        return config.patch({"save.compute_crc32": False})
    except (ImportError, AttributeError):
        return contextlib.nullcontext()


def write_extra(tmp: Path, blob: bytes | None, rank: int | None) -> None:
    """The serialized extra state as ``extra.pt`` (``rank`` None) or ``extra_rank<r>.pt``;
    nothing when ``blob`` is None (a rank that holds no extra state)."""
    if blob is not None:
        write_file(tmp / extra_name(rank), blob)


class Staging:
    """Host buffers an asynchronous save writes from: ``stage(state)`` copies every tensor of
    a (nested) state dict into them and returns the state dict made of the copies.

    A buffer is kept per key path and reused while its shape and dtype stay the same, so a
    run allocates its staging memory once (pinned host memory for tensors on a GPU, whose
    copies then run as DMA; plain host memory on a CPU). A DTensor's local shard is copied
    and wrapped again with its mesh and placements, so DCP writes each rank's shards where
    it would have. Non-tensor leaves are deep-copied. ``nbytes``: the buffers' total."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: Any) -> Any:
        cuda: torch.device | None = None  # the GPU the copies were issued on
        staged_once: dict[tuple[Any, ...], torch.Tensor] = {}

        def copy(x: Any, path: tuple[Any, ...]) -> Any:
            nonlocal cuda
            if isinstance(x, DTensor):
                local = copy(x.to_local(), path)
                return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False,
                                          shape=x.shape, stride=x.stride())  # fmt: skip
            if isinstance(x, torch.Tensor):
                alias = (x.untyped_storage().data_ptr(), x.storage_offset(), x.shape,
                         x.stride(), x.dtype)  # fmt: skip
                if alias in staged_once:  # a tied tensor under two names: one copy
                    return staged_once[alias]
                buf = self._buffers.get(path)
                if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
                    buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=x.is_cuda)
                    self._buffers[path] = buf
                if x.is_cuda:
                    cuda = x.device
                buf.copy_(x.detach(), non_blocking=x.is_cuda)
                staged_once[alias] = buf
                return buf
            if isinstance(x, dict):
                return {k: copy(v, (*path, k)) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(copy(v, (*path, i)) for i, v in enumerate(x))
            return deepcopy(x)

        staged = copy(state, ())
        if cuda is not None:  # the copies are in host memory before anyone reads them
            torch.cuda.synchronize(cuda)
        return staged
