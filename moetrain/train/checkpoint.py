"""Checkpoints: DCP shards + extra.pt + manifest.json, published atomically, verified on read.

Layout under ``root`` (``<train.output_dir>/checkpoints``)::

    step_00000100/      one complete checkpoint: .metadata + __<rank>_0.distcp (DCP),
                        extra.pt (or extra_rank<r>.pt) and manifest.json
    latest              the name of the newest published checkpoint, replaced atomically
    .tmp-step_.../      a save in progress (or one that crashed); never read
    .trash-step_.../    a checkpoint being deleted; never read

A save writes everything into ``.tmp-<name>``, has rank 0 write and check the manifest, then
renames the directory into place and only then moves ``latest``: a crash at any point leaves
the previous checkpoint and the pointer as they were. ``docs/checkpoints.md`` is the user's
version of this.

Tensors go through ``torch.distributed.checkpoint`` (DCP), so sharded DTensor/FSDP state saves
per rank and reloads under another layout; the caller flattens model and optimizer with
``torch.distributed.checkpoint.state_dict.get_state_dict`` and passes the state dicts in.
Single-process runs need no process group.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from moetrain.train.resilience import FaultInjector

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "read_manifest",
    "step_dir_name",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT = "moetrain-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
DCP_METADATA = ".metadata"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_EXTRA_RE = re.compile(r"^extra(_rank\d+)?\.pt$")
_T = TypeVar("_T")


# ----------------------------------------------------------------------------- safe loading
# Loading a checkpoint must never execute code from it. DCP unpickles its .metadata with a
# plain pickle.load and reads non-tensor items with torch.load(weights_only=False); the two
# classes below replace both with loaders that only rebuild known, inert types.

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


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved, found or loaded. The message names the path and the cause."""


def step_dir_name(step: int) -> str:
    """``step_00000100``: zero-padded so that names sort like steps."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def _extra_name(rank: int | None) -> str:
    return "extra.pt" if rank is None else f"extra_rank{rank}.pt"


# ----------------------------------------------------------------------------- verification


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The parsed ``manifest.json`` of checkpoint ``path`` (not verified)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} is missing (an unfinished save, "
            "or not a moetrain checkpoint)"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a {FORMAT} manifest")
    # Shape checks up front so that verification never trips over a hand-edited manifest.
    files = manifest.get("files")
    well_formed = (
        isinstance(manifest.get("step"), int)
        and isinstance(manifest.get("world_size"), int)
        and isinstance(files, dict)
        and all(
            isinstance(info, dict) and isinstance(info.get("size"), int) for info in files.values()
        )
    )
    if not well_formed:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} is malformed (needs an int step, "
            "an int world_size and a size for every file)"
        )
    return manifest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _problems(path: Path) -> list[str]:
    """Everything wrong with checkpoint ``path``; empty when it is complete and consistent.

    Checks: the manifest parses; every file it lists exists with the recorded size (and sha256
    for the small extra files); DCP's .metadata unpickles and every byte range it points to
    lies inside a listed file; the extra files the manifest promises are there; a ``step_*``
    directory holds the step its name says. Shards are checked by size, not hashed: hashing
    gigabytes on every resume costs more than the truncation it would add to catch.
    """
    if not path.is_dir():
        return [f"{path} does not exist or is not a directory"]
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        return [str(exc).removeprefix(f"checkpoint {path}: ")]
    problems = []
    files: dict[str, dict[str, Any]] = manifest["files"]
    sizes: dict[str, int] = {}
    for rel, info in sorted(files.items()):
        try:
            size = (path / rel).stat().st_size
        except FileNotFoundError:
            problems.append(f"{rel} is missing")
            continue
        sizes[rel] = size
        if size != info["size"]:
            problems.append(
                f"{rel} is {size} bytes but {MANIFEST} records {info['size']} "
                "(truncated or overwritten)"
            )
        elif "sha256" in info and _sha256(path / rel) != info["sha256"]:
            problems.append(f"{rel} does not match its sha256 in {MANIFEST} (corrupted)")
    if DCP_METADATA not in files:
        problems.append(f"{MANIFEST} lists no DCP {DCP_METADATA}")
    elif DCP_METADATA in sizes and not problems:
        try:
            metadata = SafeFileSystemReader(path).read_metadata()
        except Exception as exc:  # a damaged pickle can raise nearly anything
            problems.append(f"{DCP_METADATA} is unreadable ({type(exc).__name__}: {exc})")
        else:
            ends: dict[str, int] = {}
            for info in (metadata.storage_data or {}).values():
                ends[info.relative_path] = max(
                    ends.get(info.relative_path, 0), info.offset + info.length
                )
            for rel, end in sorted(ends.items()):
                if rel not in sizes:
                    problems.append(f"{rel} (a shard named in {DCP_METADATA}) is not in {MANIFEST}")
                elif sizes[rel] < end:
                    problems.append(
                        f"{rel} is {sizes[rel]} bytes but {DCP_METADATA} needs {end} (truncated)"
                    )
    world_size = manifest["world_size"]
    ranks = range(world_size) if manifest.get("per_rank_extra") else [None]
    for rank in ranks:
        if _extra_name(rank) not in files:
            problems.append(f"{MANIFEST} lists no {_extra_name(rank)}")
    match = _STEP_RE.match(path.name)
    if match and int(match.group(1)) != manifest.get("step"):
        problems.append(
            f"the directory is named for step {int(match.group(1))} but "
            f"{MANIFEST} says step {manifest.get('step')}"
        )
    return problems


def verify_checkpoint(path: str | Path) -> None:
    """Raise CheckpointError listing everything wrong with checkpoint ``path``."""
    path = Path(path)
    problems = _problems(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is not usable: {'; '.join(problems)}")


def _fingerprint_diff(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    # Compare through JSON so that a tuple in this run equals the list the manifest holds.
    expected = json.loads(json.dumps(expected))
    diffs = []
    for key in sorted(set(saved) | set(expected)):
        if key not in expected:
            diffs.append(f"{key}: only in the checkpoint (= {saved[key]!r})")
        elif key not in saved:
            diffs.append(f"{key}: not in the checkpoint (this run has {expected[key]!r})")
        elif saved[key] != expected[key]:
            diffs.append(f"{key}: checkpoint has {saved[key]!r}, this run has {expected[key]!r}")
    return diffs


# ----------------------------------------------------------------------------- small helpers


def _check_plain(obj: Any, where: str) -> None:
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
            _check_plain(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; extra "
        "holds only dicts, lists, tuples, str, int, float, bool, None and "
        "plain tensors (convert numpy arrays and scalars to lists or tensors)"
    )


def _serialize_extra(extra: dict[str, Any]) -> bytes:
    _check_plain(extra, "extra")
    buf = io.BytesIO()
    torch.save(extra, buf)
    blob = buf.getvalue()
    # The real test of "plain": what resume will do with it.
    torch.load(io.BytesIO(blob), weights_only=True)
    return blob


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
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
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every call without a process group; single-process is a supported mode here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _root_causes(exc: BaseException) -> list[BaseException]:
    """The exceptions behind ``exc``: DCP wraps each rank's failure in a CheckpointException."""
    if isinstance(exc, CheckpointException):
        return [c for inner, _ in exc.failures.values() for c in _root_causes(inner)]
    return [exc]


def _describe(exc: BaseException) -> tuple[str, bool]:
    """(one-line description, whether the disk or the quota is full)."""
    causes = _root_causes(exc)
    # Our own errors already read as sentences; others get their type, e.g. "OSError: [Errno
    # 28] No space left on device".
    texts = list(
        dict.fromkeys(
            str(c) if isinstance(c, CheckpointError) else f"{type(c).__name__}: {c}" for c in causes
        )
    )
    full = any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT) for c in causes)
    full = full or any("No space left on device" in t for t in texts)
    return "; ".join(texts), full


class _RankFailures(Exception):
    """Some ranks failed a phase; ``reports`` is [(rank, description, disk_full)]."""

    def __init__(self, reports: list[tuple[int, str, bool]]) -> None:
        super().__init__(reports)
        self.reports = reports

    def text(self, world_size: int) -> str:
        unique = list(dict.fromkeys(desc for _, desc, _ in self.reports))
        if world_size == 1:
            return "; ".join(unique)
        if len(unique) == 1 and len(self.reports) == world_size:
            return f"all ranks: {unique[0]}"
        return "; ".join(f"rank {r}: {desc}" for r, desc, _ in self.reports)

    @property
    def disk_full(self) -> bool:
        return any(full for _, _, full in self.reports)


# ----------------------------------------------------------------------------- the manager


class CheckpointManager:
    """Saves, finds and loads the checkpoints of one run under ``root``.

    Every rank constructs one and calls ``save``/``load`` together (they are collective when
    torch.distributed is initialized); ``root`` must be a filesystem all ranks share. Only
    rank 0 writes the manifest, renames, moves ``latest`` and deletes. ``rank`` and
    ``world_size`` default to those of ``process_group`` (the default group when None), or
    0 and 1 without torch.distributed; explicit values are checked against it.
    """

    def __init__(
        self,
        root: str | Path,
        keep_last: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        process_group: Any = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.process_group = process_group
        self._rank = rank
        self._world_size = world_size

    # -------------------------------------------------------------- distributed plumbing

    @property
    def distributed(self) -> bool:
        """Whether save/load are collective (torch.distributed is initialized)."""
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        if self.distributed:
            return dist.get_rank(self.process_group)
        return 0 if self._rank is None else self._rank

    @property
    def world_size(self) -> int:
        if self.distributed:
            return dist.get_world_size(self.process_group)
        return 1 if self._world_size is None else self._world_size

    def _check_layout(self) -> None:
        given = (self._rank, self._world_size)
        actual = (self.rank, self.world_size)
        if self.distributed:
            for name, g, a in zip(("rank", "world_size"), given, actual, strict=True):
                if g is not None and g != a:
                    raise CheckpointError(
                        f"CheckpointManager({name}={g}) but the process group says {name}={a}"
                    )
        elif actual != (0, 1):
            raise CheckpointError(
                f"CheckpointManager(rank={actual[0]}, world_size={actual[1]}) "
                "needs torch.distributed to be initialized"
            )

    def _phase(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on this rank, then learn whether every rank succeeded.

        Failures are exchanged rather than raised straight away: a rank that raised while the
        others went on to the next collective would leave them hanging until the timeout.
        """
        result: Any = None
        failure: BaseException | None = None
        try:
            result = fn()
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            failure = exc
        mine = None if failure is None else (self.rank, *_describe(failure))
        if self.distributed:
            reports: list[Any] = [None] * self.world_size
            dist.all_gather_object(reports, mine, group=self.process_group)
        else:
            reports = [mine]
        failed = [r for r in reports if r is not None]
        if failed:
            raise _RankFailures(failed) from failure
        return result

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.process_group)

    # -------------------------------------------------------------- finding checkpoints

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every ``step_*`` directory, oldest first, verified or not."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _STEP_RE.match(entry.name)
            if match and entry.is_dir():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def latest(self) -> Path | None:
        """The checkpoint to resume from: the one ``latest`` names if it verifies, else the
        newest ``step_*`` that verifies (e.g. after a crash between publishing a directory
        and writing the pointer), else None. Never a ``.tmp-*`` directory. Reads only."""
        named: Path | None = None
        try:
            name = (self.root / LATEST).read_text().strip()
        except FileNotFoundError:
            name = ""
        except OSError as exc:
            log.warning("cannot read %s: %s", self.root / LATEST, exc)
            name = ""
        if _STEP_RE.match(name):
            named = self.root / name
            problems = _problems(named)
            if not problems:
                return named
            log.warning(
                "%s names %s, which is not usable (%s); looking for another checkpoint",
                self.root / LATEST,
                named,
                "; ".join(problems),
            )
        for _, path in reversed(self.checkpoints()):
            if path != named and not _problems(path):
                return path
        return None

    # -------------------------------------------------------------- saving

    def save(
        self,
        step: int,
        app_state: dict[str, Any],
        extra: dict[str, Any],
        *,
        fingerprint: dict[str, Any] | None = None,
        per_rank: bool = False,
    ) -> Path:
        """Write checkpoint ``step`` and publish it; returns ``root/step_XXXXXXXX``.

        ``app_state``: name -> state dict (e.g. ``{"model": model_sd, "optim": optim_sd}``
        from ``get_state_dict``) or an object with ``state_dict``/``load_state_dict``; saved
        with DCP by every rank. ``extra``: small plain data (scheduler, data-iterator and RNG
        states, step, config), saved by rank 0 as extra.pt, or by every rank as
        extra_rank<r>.pt when ``per_rank``. ``fingerprint``: a flat JSON-able dict describing
        the model; it goes into manifest.json and ``load`` compares it.

        Collective. On any failure the partial save is removed, ``latest`` is untouched and
        every rank raises CheckpointError saying why and which checkpoint is still good.
        """
        self._check_layout()
        name = step_dir_name(step)
        tmp = self.root / f"{TMP_PREFIX}{name}"
        final = self.root / name
        try:
            blob = self._phase(lambda: self._prepare(extra, fingerprint, per_rank, tmp))
            self._phase(lambda: self._write_dcp(app_state, tmp))
            self._phase(lambda: self._write_extra(blob, per_rank, tmp))
            # Written, not yet published: where a crash must leave `latest` untouched.
            FaultInjector(self.rank).maybe_fail(step, point="save")
            self._phase(
                lambda: (
                    self._publish(step, tmp, final, fingerprint, per_rank)
                    if self.rank == 0
                    else None
                )
            )
        except _RankFailures as failures:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self._barrier()  # nobody looks for the previous checkpoint while tmp is going away
            raise CheckpointError(self._save_failed(step, failures)) from failures.__cause__
        except BaseException:
            # KeyboardInterrupt and the like: still leave no half-written directory behind.
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.rank == 0:
            self._prune(step)
        self._barrier()
        return final

    def _save_failed(self, step: int, failures: _RankFailures) -> str:
        cause = failures.text(self.world_size)
        head = f"saving checkpoint step {step} under {self.root} failed: "
        head += f"the disk is full ({cause})" if failures.disk_full else cause
        previous = self.latest()
        if previous is None:
            tail = f"No earlier checkpoint exists in {self.root}."
        else:
            tail = f"The previous checkpoint {previous} is intact and is what resume will use."
        advice = " Free some space and resume from it." if failures.disk_full else ""
        return f"{head}. The partial save was removed. {tail}{advice}"

    def _prepare(
        self, extra: dict[str, Any], fingerprint: dict[str, Any] | None, per_rank: bool, tmp: Path
    ) -> bytes | None:
        """Check the inputs before any byte is written; rank 0 makes a clean ``tmp``."""
        if fingerprint is not None:
            try:
                json.dumps(fingerprint, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise CheckpointError(
                    f"fingerprint must be a JSON-serialisable dict: {exc}"
                ) from None
        blob = _serialize_extra(extra) if (per_rank or self.rank == 0) else None
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            # Leftovers of crashed saves and deletions: nobody else writes here during a save.
            for entry in self.root.iterdir():
                if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and entry.is_dir():
                    shutil.rmtree(entry)
            tmp.mkdir()
        return blob

    def _write_dcp(self, app_state: dict[str, Any], tmp: Path) -> None:
        writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
        with _quiet_single_process():
            dcp.save(
                app_state,
                storage_writer=writer,
                process_group=self.process_group,
                no_dist=not self.distributed,
            )

    def _write_extra(self, blob: bytes | None, per_rank: bool, tmp: Path) -> None:
        if blob is not None:
            _write_file(tmp / _extra_name(self.rank if per_rank else None), blob)

    def _publish(
        self, step: int, tmp: Path, final: Path, fingerprint: dict[str, Any] | None, per_rank: bool
    ) -> None:
        """Rank 0: manifest, verify, rename into place, move ``latest``."""
        files: dict[str, dict[str, Any]] = {}
        for entry in sorted(tmp.rglob("*")):
            if entry.is_file():
                rel = entry.relative_to(tmp).as_posix()
                files[rel] = {"size": entry.stat().st_size}
                if _EXTRA_RE.match(rel):
                    files[rel]["sha256"] = _sha256(entry)
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": self.world_size,
            "per_rank_extra": per_rank,
            "fingerprint": fingerprint,
            "torch_version": torch.__version__,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": files,
        }
        _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        _fsync_dir(tmp)
        problems = _problems(tmp)
        if problems:
            raise CheckpointError(
                f"the checkpoint written to {tmp} does not verify: {'; '.join(problems)}"
            )
        # Saving a step that already exists (a run resumed from an earlier checkpoint): move
        # the old one aside first, since a directory cannot be replaced by rename.
        old = None
        if final.exists():
            old = self.root / f"{TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            if old is not None:
                os.replace(old, final)
            raise
        _fsync_dir(self.root)
        pointer_tmp = self.root / f".{LATEST}.tmp"
        _write_file(pointer_tmp, f"{final.name}\n".encode())
        os.replace(pointer_tmp, self.root / LATEST)
        # Published: from here on nothing may raise, or the error would claim otherwise.
        try:
            _fsync_dir(self.root)
        except OSError as exc:
            log.warning("could not fsync %s after publishing %s: %s", self.root, final, exc)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _prune(self, published_step: int) -> None:
        """Rank 0: keep the ``keep_last`` newest verified checkpoints up to the one just
        published (which counts); delete everything older than the oldest kept.

        Directories newer than the one just published (left by an earlier run that went
        further before this one resumed from an older checkpoint) are not touched, nor are
        unverifiable ones among the kept, which may still be worth a look.
        """
        kept = 1
        for step, path in reversed(self.checkpoints()):
            if step >= published_step:
                continue
            if kept < self.keep_last:
                kept += not _problems(path)
                continue
            trash = self.root / f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
            try:
                # Renamed first so that a crash mid-delete leaves no half-deleted step_* dir.
                os.replace(path, trash)
                shutil.rmtree(trash)
            except OSError as exc:
                log.warning("could not delete old checkpoint %s: %s", path, exc)

    # -------------------------------------------------------------- loading

    def load(
        self,
        path: str | Path,
        app_state: dict[str, Any],
        *,
        expected_fingerprint: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Load checkpoint ``path`` into ``app_state`` in place and return its extra.

        ``app_state`` has the shape given to ``save``: state dicts (from ``get_state_dict``;
        the caller applies them with ``set_state_dict``) or stateful objects. ``path`` may
        also be a checkpoint root, meaning its ``latest()``. With ``expected_fingerprint``,
        a checkpoint of a different model is refused before anything is read. Returns this
        rank's extra (per-rank extras need the world size they were saved with). Collective.

        Raises CheckpointError naming the path and the problem: missing or truncated files,
        an unreadable .metadata, a fingerprint mismatch (the differing keys), a tensor
        missing from the checkpoint or of another shape.
        """
        self._check_layout()
        path = Path(path)
        try:
            path, manifest = self._phase(lambda: self._check_loadable(path, expected_fingerprint))
        except _RankFailures as failures:
            raise CheckpointError(failures.text(self.world_size)) from failures.__cause__
        rank = self.rank if manifest.get("per_rank_extra") else None
        try:
            with _quiet_single_process():
                self._phase(
                    lambda: dcp.load(
                        app_state,
                        storage_reader=SafeFileSystemReader(path),
                        planner=SafeLoadPlanner(),
                        process_group=self.process_group,
                        no_dist=not self.distributed,
                    )
                )
            return self._phase(
                lambda: torch.load(path / _extra_name(rank), map_location="cpu", weights_only=True)
            )
        except _RankFailures as failures:
            raise CheckpointError(
                f"cannot load checkpoint {path}: {failures.text(self.world_size)}"
            ) from failures.__cause__

    def _check_loadable(
        self, path: Path, expected: dict[str, Any] | None
    ) -> tuple[Path, dict[str, Any]]:
        if not (path / MANIFEST).exists() and (
            (path / LATEST).exists() or any(_STEP_RE.match(p.name) for p in path.glob("step_*"))
        ):
            found = CheckpointManager(path, keep_last=1).latest()
            if found is None:
                raise CheckpointError(
                    f"{path} is a checkpoint directory without a usable checkpoint"
                )
            path = found
        verify_checkpoint(path)
        manifest = read_manifest(path)
        saved = manifest.get("fingerprint")
        if expected is not None and saved is None:
            log.warning("checkpoint %s has no fingerprint; loading it unchecked", path)
        elif expected is not None:
            diffs = _fingerprint_diff(saved, expected)
            if diffs:
                raise CheckpointError(
                    f"checkpoint {path} was saved for a different model: {'; '.join(diffs)}"
                )
        if manifest.get("per_rank_extra") and manifest.get("world_size") != self.world_size:
            raise CheckpointError(
                f"checkpoint {path} has per-rank extra state from "
                f"{manifest.get('world_size')} ranks; this job has "
                f"{self.world_size}"
            )
        return path, manifest
