"""``CheckpointManager``: saves, finds and loads the checkpoints of one run, on every rank.

The manager orders the work and keeps the ranks in step; the files are written by
``write.py``, made current by ``publish.py``, checked by ``verify.py`` and read back through
``safe_load.py``. Each collective phase exchanges failures instead of raising at once, so a
rank that fails never leaves the others waiting in the next collective.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.train.checkpoint.layout import (
    LATEST,
    MANIFEST,
    STEP_RE,
    TMP_PREFIX,
    CheckpointError,
    extra_name,
    list_checkpoints,
    read_manifest,
    step_dir_name,
)
from moetrain.train.checkpoint.publish import prune, publish
from moetrain.train.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from moetrain.train.checkpoint.verify import (
    checkpoint_problems,
    fingerprint_diff,
    verify_checkpoint,
)
from moetrain.train.checkpoint.write import (
    Staging,
    make_tmp_dir,
    quiet_single_process,
    serialize_extra,
    write_dcp,
    write_extra,
)
from moetrain.train.resilience import FaultInjector

log = logging.getLogger(__name__)

_T = TypeVar("_T")


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


def _yield_to_training() -> None:
    """Give the calling (writing) thread the lowest CPU priority (Linux: a thread's own nice
    value, 19; inherited by the threads it starts): where training's threads keep every
    core busy, the write takes the cores they leave idle instead of slowing their steps. The
    write's own time grows instead; its I/O is not affected."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: the default priority
        pass


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
        self._staging = Staging()
        self._writer: ThreadPoolExecutor | None = None
        self._in_flight: tuple[int, Future[Path]] | None = None

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
        return list_checkpoints(self.root)

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
        if STEP_RE.match(name):
            named = self.root / name
            problems = checkpoint_problems(named)
            if not problems:
                return named
            log.warning(
                "%s names %s, which is not usable (%s); looking for another checkpoint",
                self.root / LATEST,
                named,
                "; ".join(problems),
            )
        for _, path in reversed(self.checkpoints()):
            if path != named and not checkpoint_problems(path):
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
            self._phase(lambda: write_dcp(app_state, tmp, self.process_group, self.distributed))
            FaultInjector(self.rank).maybe_fail(step, point="write")  # the shards are written
            self._phase(lambda: write_extra(tmp, blob, self.rank if per_rank else None))
            # Written, not yet published: where a crash must leave `latest` untouched.
            FaultInjector(self.rank).maybe_fail(step, point="save")
            self._phase(
                lambda: (
                    publish(
                        self.root,
                        step,
                        tmp,
                        final,
                        world_size=self.world_size,
                        fingerprint=fingerprint,
                        per_rank=per_rank,
                    )
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
            prune(self.root, step, self.keep_last)
        self._barrier()
        return final

    # -------------------------------------------------------------- saving while training

    def save_async(
        self,
        step: int,
        app_state: dict[str, Any],
        extra: dict[str, Any],
        *,
        fingerprint: dict[str, Any] | None = None,
        per_rank: bool = False,
    ) -> None:
        """Stage checkpoint ``step`` and let a background thread write, verify and publish it
        (``save``) while training goes on; ``wait`` returns its path or raises its error.

        Staging copies ``app_state``'s tensors into host buffers reused from one save to the
        next (pinned on a GPU; ``Staging``) and ``extra`` as plain data: what training does
        next cannot reach what is written. At most one save is in flight: a save still
        running when the next one starts is waited for first, and the log says for how long.
        The manager's process group must be one that nothing else uses while a save runs
        (the trainer makes one): the save's collectives run beside training's.

        Collective, like ``save``; a kill at any moment leaves the last published checkpoint
        as it was (the save writes into ``.tmp-*`` and publishes by renames)."""
        self._check_layout()
        busy, previous, start = self.busy, self.in_flight, time.perf_counter()
        self.wait()  # raises a failed previous save's error here, even if it already ended
        if busy:
            log.info("checkpoint step %d: waited %.2f s for the save of step %d to finish "
                     "(one save in flight at a time)", step, time.perf_counter() - start,
                     previous)  # fmt: skip
        staged = self._staging.stage(app_state)
        extra = copy.deepcopy(extra)
        FaultInjector(self.rank).maybe_fail(step, point="stage")
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="moetrain-checkpoint")

        def write() -> Path:
            _yield_to_training()
            path = self.save(step, staged, extra, fingerprint=fingerprint, per_rank=per_rank)
            log.info("saved checkpoint %s (written while training went on)", path)
            return path

        self._in_flight = (step, self._writer.submit(write))

    @property
    def in_flight(self) -> int | None:
        """The step of the asynchronous save not yet waited for, or None."""
        return None if self._in_flight is None else self._in_flight[0]

    @property
    def busy(self) -> bool:
        """Whether the asynchronous save in flight is still being written."""
        return self._in_flight is not None and not self._in_flight[1].done()

    @property
    def staging_bytes(self) -> int:
        """Bytes of the host buffers the asynchronous saves stage into (0 before the first)."""
        return self._staging.nbytes

    def wait(self) -> Path | None:
        """Block until the asynchronous save in flight (if any) is published and return its
        path; raise its CheckpointError if it failed. None when no save is in flight."""
        if self._in_flight is None:
            return None
        _, future = self._in_flight
        self._in_flight = None
        return future.result()

    def close(self) -> None:
        """Wait for the save in flight, then stop the background thread."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

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
        blob = serialize_extra(extra) if (per_rank or self.rank == 0) else None
        if self.rank == 0:
            make_tmp_dir(self.root, tmp)
        return blob

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
            with quiet_single_process():
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
                lambda: torch.load(path / extra_name(rank), map_location="cpu", weights_only=True)
            )
        except _RankFailures as failures:
            raise CheckpointError(
                f"cannot load checkpoint {path}: {failures.text(self.world_size)}"
            ) from failures.__cause__

    def peek(
        self, path: str | Path, *, expected_fingerprint: dict[str, Any] | None = None
    ) -> tuple[Path, dict[str, Any]]:
        """The checkpoint ``path`` stands for (a checkpoint root: its ``latest()``), checked
        as ``load`` checks it, and its extra (rank 0's when extras are per rank: the step and
        the job config are the same in every one), without reading a tensor: what a resume
        decides on before it loads the weights. Collective; raises CheckpointError."""
        self._check_layout()

        def read() -> tuple[Path, dict[str, Any]]:
            found, manifest = self._check_loadable(Path(path), expected_fingerprint)
            name = extra_name(0 if manifest.get("per_rank_extra") else None)
            return found, torch.load(found / name, map_location="cpu", weights_only=True)

        try:
            return self._phase(read)
        except _RankFailures as failures:
            raise CheckpointError(failures.text(self.world_size)) from failures.__cause__

    def _check_loadable(
        self, path: Path, expected: dict[str, Any] | None
    ) -> tuple[Path, dict[str, Any]]:
        if not (path / MANIFEST).exists() and (
            (path / LATEST).exists() or any(STEP_RE.match(p.name) for p in path.glob("step_*"))
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
            diffs = fingerprint_diff(saved, expected)
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
