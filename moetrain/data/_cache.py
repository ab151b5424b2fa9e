"""Cache directory and crash-safe publishing of cache files shared by concurrent ranks."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def cache_root(cache_dir: str | None) -> Path:
    """The moetrain cache directory: ``data.cache_dir`` or ``~/.cache/moetrain``."""
    root = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "moetrain"
    root.mkdir(parents=True, exist_ok=True)
    return root


def short_hash(*parts: object) -> str:
    """A 16-hex-digit digest of ``parts`` for cache keys."""
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def publish(final: Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Write ``final`` through ``write(fileobj)`` into a temp file, then publish it atomically.

    Several ranks may build the same cache file at once. Publishing uses "first writer wins"
    (a hard link fails if the file exists) so every reader sees one complete file and no rank
    keeps an in-memory copy that differs from what is on disk. Readers never see a partial file.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, final)
        except FileExistsError:
            pass  # another process published first; its file is the one everybody uses
        except OSError:
            os.replace(tmp, final)  # filesystem without hard links: atomic rename instead
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final
