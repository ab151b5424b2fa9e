"""The on-disk layout of a run's checkpoints: names, the manifest format, the error type.

Under ``root`` (``<train.output_dir>/checkpoints``)::

    step_00000100/      one complete checkpoint: .metadata + __<rank>_0.distcp (DCP),
                        extra.pt (or extra_rank<r>.pt) and manifest.json
    latest              the name of the newest published checkpoint, replaced atomically
    .tmp-step_.../      a save in progress (or one that crashed); never read
    .trash-step_.../    a checkpoint being deleted; never read
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

FORMAT = "moetrain-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
DCP_METADATA = ".metadata"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
STEP_RE = re.compile(r"^step_(\d{8,})$")
EXTRA_RE = re.compile(r"^extra(_rank\d+)?\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved, found or loaded. The message names the path and the cause."""


def step_dir_name(step: int) -> str:
    """``step_00000100``: zero-padded so that names sort like steps."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def extra_name(rank: int | None) -> str:
    """The extra-state file: ``extra.pt`` (rank 0's), or ``extra_rank<r>.pt`` per rank."""
    return "extra.pt" if rank is None else f"extra_rank{rank}.pt"


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


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step_*`` directory under ``root``, oldest first, verified or
    not."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STEP_RE.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)
