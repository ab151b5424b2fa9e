"""Integrity of prepared datasets: tokenizer, files, checksums, and when each is checked.

Start-up must take about a second at any size, so ``check_prepared`` (what ``check_data``
runs) reads no shard whole: it checks the manifest, the tokenizer fingerprint and one
``stat`` per shard file, then the checksums of only those files this machine has not
verified since they were last written. Verified files are recorded per manifest in
``<cache_dir>/verified/`` with their size, modification time and inode; ``prepare-data``
records the files it writes (it hashed them as it wrote them), and ``prepare-data --verify``
re-reads everything regardless of the records.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.data._cache import cache_root, short_hash
from moetrain.data.errors import DataError
from moetrain.data.prepared import (
    TOKENIZER_FILE,
    Manifest,
    read_manifest,
    sha256_file,
    write_json_atomic,
)

log = logging.getLogger(__name__)


def check_tokenizer(manifest: Manifest, fingerprint: str, eos_id: int, spec: str) -> None:
    """``DataError`` unless the dataset was tokenized by the tokenizer ``spec`` loads."""
    want = manifest.tokenizer
    if want["fingerprint"] != fingerprint or want.get("eos_id", eos_id) != eos_id:
        copy = manifest.root / TOKENIZER_FILE
        raise DataError(
            f"data.tokenizer: {str(manifest.path)!r} was prepared with tokenizer "
            f"{want.get('source')!r} (fingerprint {want['fingerprint']}, eos id "
            f"{want.get('eos_id')}), but data.tokenizer={spec!r} is another one (fingerprint "
            f"{fingerprint}, eos id {eos_id}); set data.tokenizer={str(copy)!r} "
            "or prepare the data again with this tokenizer"
        )


def check_files(manifest: Manifest, key: str = "data.dataset") -> None:
    """Every shard file is there with the size the manifest gives (a stat per file)."""
    itemsize = np.dtype(manifest.data["dtype"]).itemsize
    for split in manifest.data["splits"].values():
        for shard in split["shards"]:
            sizes = {
                shard["tokens"]: shard["n_tokens"] * itemsize,
                shard["index"]: (shard["n_docs"] + 1) * 8,
            }
            for file_name, want in sizes.items():
                file = manifest.root / file_name
                try:
                    got = file.stat().st_size
                except FileNotFoundError:
                    raise DataError(
                        f"{key}: shard {str(file)!r} listed in {str(manifest.path)!r} is "
                        "missing; copy it again or prepare the data again"
                    ) from None
                if got != want:
                    raise DataError(
                        f"{key}: shard {str(file)!r} holds {got} bytes, {str(manifest.path)!r} "
                        f"says {want}: it is truncated or was not fully copied"
                    )


def _stamp_of(file: Path) -> list[int]:
    st = file.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def verify_checksums(
    manifest: Manifest,
    stamps_path: Path | None = None,
    key: str = "data.dataset",
    force: bool = False,
) -> int:
    """Compare shard files with their SHA-256 in the manifest; return the bytes hashed.

    ``stamps_path`` records (size, mtime, inode, checksum) of the files verified: a file whose
    stat still matches its record is not read again unless ``force``. Verification thus costs
    one pass per shard per machine, and a file written since (corrupted, replaced, copied
    over) is read again.
    """
    stamps: dict[str, Any] = {}
    if stamps_path is not None and stamps_path.is_file() and not force:
        try:
            stamps = json.loads(stamps_path.read_text())
        except ValueError:
            stamps = {}
    todo = []
    for split in manifest.data["splits"].values():
        for shard in split["shards"]:
            for name, digest in (
                (shard["tokens"], shard["tokens_sha256"]),
                (shard["index"], shard.get("index_sha256")),
            ):
                stamp = _stamp_of(manifest.root / name) + [digest]
                if stamps.get(name) != stamp and digest is not None:
                    todo.append((name, stamp))
    total = sum(stamp[0] for _, stamp in todo)
    if total > 1 << 28:
        log.info(
            "verifying the checksums of %d files (%.1f GB) of %s, once",
            len(todo),
            total / 1e9,
            manifest.root,
        )
    for i, (name, stamp) in enumerate(todo):
        file = manifest.root / name
        if sha256_file(file) != stamp[-1]:
            raise DataError(
                f"{key}: shard {str(file)!r} does not match its checksum in "
                f"{str(manifest.path)!r}: the file is corrupt; copy it again or prepare "
                "the data again"
            )
        stamps[name] = stamp
        # Record as we go (every 64 files): an interrupted pass keeps most of its work.
        if stamps_path is not None and (i % 64 == 63 or i == len(todo) - 1):
            stamps_path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(stamps_path, stamps)
    return total


def stamp_file(cache_dir: str | None, manifest: Manifest) -> Path:
    """Where this machine records which shards of ``manifest`` passed their checksums."""
    return cache_root(cache_dir) / "verified" / f"{short_hash(str(manifest.path))}.json"


def record_verified(manifest: Manifest, stamps: Path) -> None:
    """Record every shard of ``manifest`` as verified without reading it: for files whose
    checksums were computed as they were written (``prepare-data``)."""
    record = {}
    for split in manifest.data["splits"].values():
        for shard in split["shards"]:
            for name, digest in (
                (shard["tokens"], shard["tokens_sha256"]),
                (shard["index"], shard.get("index_sha256")),
            ):
                record[name] = _stamp_of(manifest.root / name) + [digest]
    stamps.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(stamps, record)


def check_prepared(
    path: str | os.PathLike[str],
    fingerprint: str,
    eos_id: int,
    tokenizer_spec: str,
    cache_dir: str | None,
    key: str = "data.dataset",
) -> Manifest:
    """Everything ``check_data`` checks of a prepared dataset, cheapest first: the manifest
    and its version, the tokenizer, every shard's presence and size, then the checksums of
    the shards this machine has not verified since they were last written."""
    manifest = read_manifest(path, key)
    check_tokenizer(manifest, fingerprint, eos_id, tokenizer_spec)
    check_files(manifest, key)
    verify_checksums(manifest, stamp_file(cache_dir, manifest), key)
    return manifest
