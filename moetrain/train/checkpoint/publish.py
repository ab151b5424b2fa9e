"""Publishing: how a fully written ``.tmp-<name>`` becomes the current checkpoint, and how
old checkpoints go.

Rank 0 writes the manifest, verifies the directory, renames it into place and only then
moves ``latest``: a crash at any point leaves the previous checkpoint and the pointer as
they were. Deleting renames to ``.trash-*`` first, so that a crash mid-delete never leaves a
half-deleted ``step_*`` directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from moetrain.train.checkpoint.layout import (
    EXTRA_RE,
    FORMAT,
    LATEST,
    MANIFEST,
    TRASH_PREFIX,
    CheckpointError,
    list_checkpoints,
)
from moetrain.train.checkpoint.verify import checkpoint_problems, file_sha256
from moetrain.train.checkpoint.write import fsync_dir, write_file

log = logging.getLogger(__name__)


def publish(
    root: Path,
    step: int,
    tmp: Path,
    final: Path,
    *,
    world_size: int,
    fingerprint: dict[str, Any] | None,
    per_rank: bool,
) -> None:
    """Rank 0: manifest, verify, rename ``tmp`` to ``final``, move ``latest`` to it."""
    files: dict[str, dict[str, Any]] = {}
    for entry in sorted(tmp.rglob("*")):
        if entry.is_file():
            rel = entry.relative_to(tmp).as_posix()
            files[rel] = {"size": entry.stat().st_size}
            if EXTRA_RE.match(rel):
                files[rel]["sha256"] = file_sha256(entry)
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "per_rank_extra": per_rank,
        "fingerprint": fingerprint,
        "torch_version": torch.__version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
    }
    write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    fsync_dir(tmp)
    problems = checkpoint_problems(tmp)
    if problems:
        raise CheckpointError(
            f"the checkpoint written to {tmp} does not verify: {'; '.join(problems)}"
        )
    # Saving a step that already exists (a run resumed from an earlier checkpoint): move
    # the old one aside first, since a directory cannot be replaced by rename.
    old = None
    if final.exists():
        old = root / f"{TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    fsync_dir(root)
    pointer_tmp = root / f".{LATEST}.tmp"
    write_file(pointer_tmp, f"{final.name}\n".encode())
    os.replace(pointer_tmp, root / LATEST)
    # Published: from here on nothing may raise, or the error would claim otherwise.
    try:
        fsync_dir(root)
    except OSError as exc:
        log.warning("could not fsync %s after publishing %s: %s", root, final, exc)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(root: Path, published_step: int, keep_last: int) -> None:
    """Rank 0: keep the ``keep_last`` newest verified checkpoints up to the one just
    published (which counts); delete everything older than the oldest kept.

    Directories newer than the one just published (left by an earlier run that went
    further before this one resumed from an older checkpoint) are not touched, nor are
    unverifiable ones among the kept, which may still be worth a look.
    """
    kept = 1
    for step, path in reversed(list_checkpoints(root)):
        if step >= published_step:
            continue
        if kept < keep_last:
            kept += not checkpoint_problems(path)
            continue
        trash = root / f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            # Renamed first so that a crash mid-delete leaves no half-deleted step_* dir.
            os.replace(path, trash)
            shutil.rmtree(trash)
        except OSError as exc:
            log.warning("could not delete old checkpoint %s: %s", path, exc)
