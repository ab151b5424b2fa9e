"""Where ``import-hf`` and ``export-hf`` write: a directory that is new, empty, or replaced
whole with ``--force``, never one of the command's sources and never a training run.

    with staged_output(out, force=..., sources=[...], key=...) as tmp:
        ...write everything into tmp...

Everything is written into a temporary directory beside the target (same filesystem) and
renamed into place at the end: a crash or an error leaves the target as it was (and no
half-written directory under its name), and a replaced directory is never mixed with the
new files. A refusal is one ``OutputDirError`` naming the key and the problem, raised
before anything is written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from moetrain.config import ConfigError


class OutputDirError(ConfigError):
    """The output directory of import-hf / export-hf cannot be written (one line)."""


def _resolved(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()


def _overlap(a: Path, b: Path) -> bool:
    """a is b, inside b, or holds b."""
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def is_run_dir(path: Path) -> bool:
    """A moetrain run or checkpoint directory: a checkpoint itself, a checkpoint root, or a
    directory with ``checkpoints/``."""
    return (
        (path / "manifest.json").is_file()
        or (path / "latest").is_file()
        or any(path.glob("step_*"))
        or (path / "checkpoints").is_dir()
    )


def is_import_dir(path: Path) -> bool:
    """A directory ``import-hf`` wrote: one step-0 checkpoint that records its source, and
    nothing that training writes."""
    import torch

    from moetrain.train.checkpoint.layout import list_checkpoints

    found = list_checkpoints(path / "checkpoints")
    if [step for step, _ in found] != [0] or (path / "tb").exists():
        return False
    try:
        extra = torch.load(found[0][1] / "extra.pt", map_location="cpu", weights_only=True)
    except Exception:
        return False
    return isinstance(extra, dict) and "source" in extra


def check_output(
    out: str | Path,
    *,
    force: bool,
    sources: Iterable[tuple[str, str | Path]],
    key: str,
    replaceable_run: bool = False,
) -> Path:
    """The resolved target, or OutputDirError when it may not be written.

    ``sources``: (what it is, path) of every directory the command reads; the target may be
    none of them, inside none and hold none, even with ``force``. A run directory is never
    replaced (``replaceable_run``: except one that only ``import-hf`` wrote), nor the current
    directory or one that holds it."""
    target = _resolved(out)
    if target.exists() and not target.is_dir():
        raise OutputDirError(f"{key}: {str(out)!r} exists and is not a directory; name a "
                             "new or empty directory")  # fmt: skip
    sources = [(what, path) for what, path in sources if path is not None]
    # The one it is, else the first it overlaps (callers list the largest first).
    exact = [(w, p) for w, p in sources if _resolved(p) == target]
    for what, path in exact + sources:
        if _overlap(target, _resolved(path)):
            raise OutputDirError(
                f"{key}: {str(out)!r} is or overlaps {what} {str(path)!r}, which this command "
                "never writes; name another directory"
            )
    cwd = Path.cwd().resolve()
    if cwd.is_relative_to(target) or target == Path.home().resolve():
        raise OutputDirError(f"{key}: {str(out)!r} holds the current directory; name a new "
                             "or empty directory")  # fmt: skip
    if not target.is_dir() or not any(target.iterdir()):
        return target
    if is_run_dir(target) and not (replaceable_run and is_import_dir(target)):
        raise OutputDirError(f"{key}: {str(out)!r} is a moetrain run (it holds checkpoints), "
                             "which this command never writes, even with --force; name "
                             "another directory")  # fmt: skip
    if not force:
        entries = sorted(p.name for p in target.iterdir())
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise OutputDirError(f"{key}: {str(out)!r} is not empty ({shown}); pass --force to "
                             "replace it (its files are removed)")  # fmt: skip
    return target


@contextlib.contextmanager
def staged_output(
    out: str | Path,
    *,
    force: bool,
    sources: Iterable[tuple[str, str | Path]],
    key: str,
    replaceable_run: bool = False,
) -> Iterator[Path]:
    """Check the target (``check_output``), yield a new temporary directory beside it, and
    when the block ends without an error rename it into place (an old target, empty or
    replaced with ``force``, is moved aside first and deleted afterwards). On an error the
    temporary directory is removed and the target is untouched."""
    target = check_output(out, force=force, sources=sources, key=key,
                          replaceable_run=replaceable_run)  # fmt: skip
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
        try:
            os.replace(tmp, target)
        except BaseException:
            if old is not None:
                os.replace(old, target)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
