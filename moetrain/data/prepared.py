"""The prepared-dataset format: sharded token files, their document indexes and a manifest.

A prepared dataset is a directory::

    manifest.json          format, version, tokenizer fingerprint, counts, shards + checksums
    tokenizer.json         a copy of the tokenizer it was tokenized with
    train-00000.bin        token ids (uint16 up to 65536 ids, else uint32), documents back
    train-00000.idx        to back, each ending in EOS; .idx: int64 offsets of its documents
    ...                    (n_docs + 1 of them, from 0 to n_tokens)
    eval-00000.bin / .idx  the held-out split, likewise

Document k of a split is document k - first_doc(s) of the shard s holding it, in the order
``load_split`` reads the source, so a prepared split and the same data tokenized on the fly
are the same documents in the same order. Readers map the index files with ``np.memmap``
and read the token ranges they need with ``pread``; nothing is loaded whole.

This module imports numpy and the standard library only: tokenizing worker processes import
it, and must start in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from moetrain.data.errors import DataError

FORMAT = "moetrain-prepared"
FORMAT_VERSION = 2
"""Version of the format this code writes, and the newest it reads. 2: the manifest records
``literal_special_tokens`` (how special-token text inside documents was encoded); version 1
encoded it as the special tokens, so the separator id may occur inside its documents."""
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "eval")
OPEN_SHARDS = 64
"""Shards a reader keeps mapped at once (each map holds a file descriptor)."""


def token_dtype(vocab_size: int) -> str:
    """Smallest unsigned dtype holding every id (uint16 for vocabularies up to 65536)."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


_CHUNK = 1 << 24  # bytes per read while hashing a file


def is_prepared(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a prepared dataset (a directory with a manifest)."""
    return (Path(path).expanduser() / MANIFEST).is_file()


def shard_files(split: str, index: int) -> tuple[str, str]:
    """File names of shard ``index`` of ``split``: (tokens, document index)."""
    return f"{split}-{index:05d}.bin", f"{split}-{index:05d}.idx"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 16 MB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: Path, obj: Any) -> None:
    """``path`` holds ``obj`` as JSON, replaced atomically (a reader sees old or new)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- writing


class _HashingFile:
    """A binary file that hashes what is written to it."""

    def __init__(self, path: Path) -> None:
        self.f: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.sha.update(data)
        self.nbytes += memoryview(data).nbytes  # len() of a uint16 view counts elements

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


class ShardWriter:
    """Writes one shard: documents appended as token arrays (each ending in EOS).

    The files are written under temporary names, hashed as they are written, and renamed to
    their final names by ``close()``, which returns the shard's manifest entry.
    """

    def __init__(self, directory: Path, split: str, index: int, dtype: str) -> None:
        self.dir = directory
        self.bin_name, self.idx_name = shard_files(split, index)
        self.dtype = np.dtype(dtype)
        self._bin = _HashingFile(directory / f".{self.bin_name}.tmp")
        self._idx = _HashingFile(directory / f".{self.idx_name}.tmp")
        self._idx.write(np.zeros(1, dtype="<i8").tobytes())
        self.n_docs = self.n_tokens = 0
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0

    def add(self, doc: np.ndarray) -> None:
        """Append one document (token ids, EOS included)."""
        self._pending.append(doc)
        self._pending_tokens += len(doc)
        if self._pending_tokens >= 1 << 20:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        lengths = np.fromiter((len(d) for d in self._pending), np.int64, len(self._pending))
        ends = self.n_tokens + np.cumsum(lengths)
        self._bin.write(np.concatenate(self._pending).astype(self.dtype).data)
        self._idx.write(ends.astype("<i8").data)
        self.n_docs += len(self._pending)
        self.n_tokens = int(ends[-1])
        self._pending, self._pending_tokens = [], 0

    def close(self) -> dict[str, Any]:
        """Finish both files, move them to their final names, return the manifest entry."""
        self._flush()
        self._bin.close()
        self._idx.close()
        os.replace(self.dir / f".{self.bin_name}.tmp", self.dir / self.bin_name)
        os.replace(self.dir / f".{self.idx_name}.tmp", self.dir / self.idx_name)
        return {
            "tokens": self.bin_name,
            "index": self.idx_name,
            "n_docs": self.n_docs,
            "n_tokens": self.n_tokens,
            "tokens_bytes": self._bin.nbytes,
            "index_bytes": self._idx.nbytes,
            "tokens_sha256": self._bin.sha.hexdigest(),
            "index_sha256": self._idx.sha.hexdigest(),
        }

    def abort(self) -> None:
        """Close and delete the temporary files (an interrupted shard leaves nothing)."""
        for part in (self._bin, self._idx):
            if not part.f.closed:
                part.f.close()
        for name in (self.bin_name, self.idx_name):
            (self.dir / f".{name}.tmp").unlink(missing_ok=True)


def build_manifest(
    tokenizer_info: dict[str, Any],
    dtype: str,
    splits: dict[str, list[dict[str, Any]]],
    source: dict[str, Any],
    literal_special_tokens: str = "text",
) -> dict[str, Any]:
    """The manifest of a dataset whose shards (per split, in order) are ``splits``."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "literal_special_tokens": literal_special_tokens,
        "tokenizer": tokenizer_info,
        "dtype": dtype,
        "source": source,
        "splits": {
            name: {
                "n_docs": sum(s["n_docs"] for s in shards),
                "n_tokens": sum(s["n_tokens"] for s in shards),
                "shards": shards,
            }
            for name, shards in splits.items()
        },
    }


def publish_dir(staging: Path, final: Path) -> bool:
    """Rename the finished ``staging`` directory to ``final`` (atomic). False, and
    ``staging`` deleted, when ``final`` already exists (another process published first)."""
    try:
        os.rename(staging, final)
        return True
    except OSError:
        if not is_prepared(final):
            raise
        shutil.rmtree(staging, ignore_errors=True)
        return False


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Manifest:
    """A parsed, checked ``manifest.json``."""

    path: Path
    """The manifest file."""
    data: dict[str, Any]

    @property
    def root(self) -> Path:
        return self.path.parent

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.data["tokenizer"]

    @property
    def literal_special_tokens(self) -> str | None:
        """How special-token text inside documents was encoded ("text" or "special"); None
        for format 1, which encoded it as special tokens without saying so."""
        return self.data.get("literal_special_tokens")

    def split(self, name: str) -> dict[str, Any]:
        return self.data["splits"][name]


def read_manifest(
    path: str | os.PathLike[str], key: str = "data.dataset", splits: tuple[str, ...] = SPLITS
) -> Manifest:
    """The manifest of the prepared dataset ``path``; ``DataError`` naming the file if it is
    missing, unreadable, of another format, of a newer version than this code reads, or
    without one of ``splits``."""
    file = Path(path).expanduser() / MANIFEST
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise DataError(
            f"{key}: {str(file)!r} does not exist; {str(path)!r} is not a "
            "prepared dataset (make one with `moetrain prepare-data`)"
        ) from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{key}: cannot read {str(file)!r}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DataError(f"{key}: {str(file)!r} is not a moetrain prepared-dataset manifest")
    version = data.get("format_version")
    if not isinstance(version, int):
        raise DataError(f"{key}: {str(file)!r} has no integer format_version")
    if version > FORMAT_VERSION:
        raise DataError(
            f"{key}: {str(file)!r} is format version {version}; this moetrain reads versions "
            f"up to {FORMAT_VERSION}. Upgrade moetrain, or prepare the data again with this one"
        )
    if not isinstance(data.get("splits"), dict):
        raise DataError(f"{key}: {str(file)!r} is incomplete: no splits")
    missing = [name for name in splits if name not in data["splits"]]
    if missing:
        raise DataError(f"{key}: {str(file)!r} has no {missing[0]!r} split")
    try:
        for split in data["splits"].values():
            for shard in split["shards"]:
                for field in ("tokens", "index", "n_docs", "n_tokens", "tokens_sha256"):
                    shard[field]  # noqa: B018 - presence check
        data["tokenizer"]["fingerprint"]  # noqa: B018
        np.dtype(data["dtype"])
    except (KeyError, TypeError) as exc:
        raise DataError(f"{key}: {str(file)!r} is incomplete: no {exc}") from None
    return Manifest(file.resolve(), data)


class _Shard:
    """One open shard: its document index mapped, its token file open for ``pread``."""

    def __init__(self, root: Path, shard: dict[str, Any], dtype: np.dtype, key: str) -> None:
        self.index = np.memmap(root / shard["index"], dtype="<i8", mode="r")
        self.tokens = open(root / shard["tokens"], "rb", buffering=0)  # noqa: SIM115
        self.path = root / shard["tokens"]
        self.dtype = dtype
        n_tokens = os.fstat(self.tokens.fileno()).st_size // dtype.itemsize
        index = self.index
        if len(index) != shard["n_docs"] + 1 or index[0] != 0 or index[-1] != n_tokens:
            self.tokens.close()
            raise DataError(
                f"{key}: shard {str(root / shard['index'])!r} does not index "
                f"{str(self.path)!r}: the files are corrupt; run "
                f"`moetrain prepare-data --verify {str(root)}`"
            )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the shard, read with one ``pread``."""
        size = self.dtype.itemsize
        data = os.pread(self.tokens.fileno(), (stop - start) * size, start * size)
        if len(data) != (stop - start) * size:
            raise DataError(f"data.dataset: shard {str(self.path)!r} was truncated while read")
        return np.frombuffer(data, dtype=self.dtype)


class PreparedSplit:
    """One split of a prepared dataset, read in place.

    ``lengths(ids)`` reads the document index, mapped with ``np.memmap`` (8 bytes a document,
    read at random); ``read(k, a, b)`` reads a token range with one ``pread``, so a reader's
    memory holds the tokens it asked for and nothing else: mapped token files would count
    every page the kernel maps around a read (2 MB per touched region with large page-cache
    folios) in the reader's resident set. At most ``OPEN_SHARDS`` shards are open at once.
    """

    def __init__(self, manifest: Manifest, split: str, key: str = "data.dataset") -> None:
        info = manifest.split(split)
        self.manifest = manifest
        self.split = split
        self.key = key
        self.dtype = np.dtype(manifest.data["dtype"])
        self.shards = [s for s in info["shards"] if s["n_docs"]]
        self.n_docs = int(info["n_docs"])
        self.n_tokens = int(info["n_tokens"])
        counts = np.array([s["n_docs"] for s in self.shards], dtype=np.int64)
        self._first_doc = np.concatenate([[0], np.cumsum(counts)])
        self._open: OrderedDict[int, _Shard] = OrderedDict()

    def _shard(self, s: int) -> _Shard:
        shard = self._open.get(s)
        if shard is not None:
            self._open.move_to_end(s)
            return shard
        shard = _Shard(self.manifest.root, self.shards[s], self.dtype, self.key)
        self._open[s] = shard
        if len(self._open) > OPEN_SHARDS:
            _, oldest = self._open.popitem(last=False)
            oldest.tokens.close()
        return shard

    def _locate(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._first_doc, ids, side="right") - 1

    def lengths(self, ids: np.ndarray) -> np.ndarray:
        """Token counts (EOS included) of documents ``ids``: int64."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty(len(ids), dtype=np.int64)
        shard_of = self._locate(ids)
        for s in np.unique(shard_of):
            sel = shard_of == s
            local = ids[sel] - self._first_doc[s]
            index = self._shard(int(s)).index
            out[sel] = index[local + 1] - index[local]
        return out

    def read(self, doc: int, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of document ``doc``."""
        s = int(self._locate(np.array([doc]))[0])
        shard = self._shard(s)
        base = int(shard.index[doc - self._first_doc[s]])
        return shard.read(base + start, base + stop)

    def sample_tokens(self, max_tokens: int) -> np.ndarray:
        """The first ``max_tokens`` tokens in stored order."""
        parts, total = [], 0
        for s, info in enumerate(self.shards):
            n = min(info["n_tokens"], max_tokens - total)
            parts.append(self._shard(s).read(0, n))
            total += n
            if total >= max_tokens:
                break
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)
