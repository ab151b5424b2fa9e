"""Verification: whether a checkpoint directory is complete and consistent, and whether it
belongs to this run's model. Reads only."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from moetrain.train.checkpoint.layout import (
    DCP_METADATA,
    MANIFEST,
    STEP_RE,
    CheckpointError,
    extra_name,
    read_manifest,
)
from moetrain.train.checkpoint.safe_load import SafeFileSystemReader


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_problems(path: Path) -> list[str]:
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
        elif "sha256" in info and file_sha256(path / rel) != info["sha256"]:
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
        if extra_name(rank) not in files:
            problems.append(f"{MANIFEST} lists no {extra_name(rank)}")
    match = STEP_RE.match(path.name)
    if match and int(match.group(1)) != manifest.get("step"):
        problems.append(
            f"the directory is named for step {int(match.group(1))} but "
            f"{MANIFEST} says step {manifest.get('step')}"
        )
    return problems


def verify_checkpoint(path: str | Path) -> None:
    """Raise CheckpointError listing everything wrong with checkpoint ``path``."""
    path = Path(path)
    problems = checkpoint_problems(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is not usable: {'; '.join(problems)}")


def fingerprint_diff(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
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
