"""Where the documents come from: the default corpus, a hub dataset or local files.

``load_split(cfg, role)`` turns a ``DataConfig`` into the ``datasets`` split that training
("train") or evaluation ("eval") reads, and checks it on the way: the path exists, the split
and the text column are there, the rows are strings, there is text at all. Every failure is a
``DataError`` naming the key to change, raised before any training work.

The default corpus and a user's local files go through the same ``load_local_files`` call
(``datasets.load_dataset("json" | "text" | "parquet", data_files=...)``).
"""

from __future__ import annotations

import glob
import inspect
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from moetrain.config import DataConfig
from moetrain.data._cache import cache_root
from moetrain.data.corpus import corpus_files
from moetrain.data.errors import DataError

if TYPE_CHECKING:  # ``datasets`` (and pyarrow) load only where a split is read: a run over
    # the default corpus's token cache or a prepared dataset never imports them (1.7 s)
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

    AnyDataset = Dataset | IterableDataset

Role = Literal["train", "eval"]

FORMATS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
"""File extension -> ``datasets`` builder, used when ``data.format`` is null."""

# Hugging Face's own split keywords for files in a folder (train.jsonl, dev/x.parquet, ...).
_SPLIT_WORDS = {
    "train": "train",
    "training": "train",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "validation",
    "test": "test",
    "testing": "test",
    "eval": "test",
    "evaluation": "test",
}

_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class Source:
    """A resolved ``data.dataset``: what to load and how."""

    kind: Literal["default", "local", "hub"]
    name: str
    """What the user wrote (for messages)."""
    files: dict[str, list[str]] | None = None
    """default/local: split -> files."""
    builder: str | None = None
    """default/local: the ``datasets`` builder ("json", "text", "parquet")."""


def resolve_source(cfg: DataConfig) -> Source:
    """Classify ``data.dataset`` and, for local data, find its files and their format."""
    if cfg.dataset == "default":
        files = corpus_files(cfg.cache_dir)
        return Source("default", "default", {s: [str(p)] for s, p in files.items()}, "json")
    if (Path(cfg.dataset).expanduser() / "manifest.json").is_file():
        raise DataError(
            f"data.dataset: {cfg.dataset!r} is a prepared dataset: it holds token ids, not "
            "text (PackedBatches reads it; prepare-data takes the original text)"
        )
    files = _local_files(cfg.dataset, cfg.format)
    if files is None:
        return Source("hub", cfg.dataset)
    return Source("local", cfg.dataset, _split_files(cfg.dataset, files), _builder(files, cfg))


def _local_files(spec: str, fmt: str | None) -> list[Path] | None:
    """The files ``spec`` names, or None when it reads as a hub dataset name."""
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        found = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
            and (fmt is not None or p.suffix.lower() in FORMATS)
        )
        if not found:
            raise DataError(
                f"data.dataset: directory {spec!r} holds no "
                f"{'/'.join(FORMATS)} files (set data.format to read others)"
            )
        return found
    if glob.has_magic(spec):
        matches = sorted(Path(m) for m in glob.glob(str(path), recursive=True))
        matches = [m for m in matches if m.is_file()]
        if not matches:
            raise DataError(f"data.dataset: no files match {spec!r}")
        return matches
    # A hub name is "name" or "owner/name"; anything that can only be a path is an error here.
    if spec.startswith(("/", "./", "../", "~")) or path.suffix.lower() in FORMATS:
        raise DataError(f"data.dataset: local path {spec!r} does not exist")
    return None


def _builder(files: list[Path], cfg: DataConfig) -> str:
    if cfg.format is not None:
        return cfg.format
    kinds = {FORMATS.get(f.suffix.lower()) for f in files}
    if None in kinds:
        odd = next(f for f in files if f.suffix.lower() not in FORMATS)
        raise DataError(
            f"data.format: cannot infer the format of {str(odd)!r} from its "
            f"extension; set data.format to text, json or parquet"
        )
    if len(kinds) > 1:
        raise DataError(
            f"data.format: {cfg.dataset!r} mixes formats {sorted(kinds)}; point "
            "data.dataset at files of one format or set data.format"
        )
    return kinds.pop()


def _split_files(spec: str, files: list[Path]) -> dict[str, list[str]]:
    """A single file or a glob is one "train" split; a folder's files are assigned to splits
    by Hugging Face's keywords in their relative path (train/valid/dev/test/eval...)."""
    root = Path(spec).expanduser()
    if not root.is_dir():
        return {"train": [str(f) for f in files]}
    splits: dict[str, list[str]] = {}
    for f in files:
        words = re.split(r"[^a-z0-9]+", f.relative_to(root).with_suffix("").as_posix().lower())
        split = next((_SPLIT_WORDS[w] for w in words if w in _SPLIT_WORDS), "train")
        splits.setdefault(split, []).append(str(f))
    return splits


# ----------------------------------------------------------------------------- loading


def load_local_files(
    files: list[str] | dict[str, list[str]],
    builder: str,
    cache_dir: str | None,
    streaming: bool = False,
) -> DatasetDict | IterableDatasetDict:
    """``datasets.load_dataset(builder, data_files=files)``: the one path for local files and
    the default corpus. Arrow caches go under ``<cache_dir>/datasets``."""
    import datasets

    data_files = files if isinstance(files, dict) else {"train": files}
    # Zero-byte files hold no rows, and some builders stumble on them (json raises
    # StopIteration): leave them out, and call a split made only of them empty.
    data_files = {
        split: [f for f in fs if os.path.getsize(f) > 0] for split, fs in data_files.items()
    }
    empty = [split for split, fs in data_files.items() if not fs]
    if empty:
        raise DataError(f"data.dataset: the files of split {empty[0]!r} are all empty")
    try:
        return datasets.load_dataset(
            builder,
            data_files=data_files,
            cache_dir=None if streaming else str(cache_root(cache_dir) / "datasets"),
            streaming=streaming,
        )
    except Exception as exc:  # a malformed file surfaces as any of pyarrow's/datasets' errors
        cause = exc.__cause__ or exc
        raise DataError(
            f"data.dataset: cannot read {builder} files {_short(data_files)}: "
            f"{type(cause).__name__}: {cause}"
        ) from exc


def plan_split(cfg: DataConfig, role: Role, kind: str) -> tuple[str, str, bool | None]:
    """(split name, config key that names it, hold-out selection) for ``role``.

    The selection is None to read the whole split, False/True to keep the training/held-out
    documents of ``data.split`` when there is no eval split.
    """
    holdout = cfg.eval_split is None and kind != "default"
    if role == "train":
        return cfg.split, "data.split", (False if holdout else None)
    if cfg.eval_split is not None:
        return cfg.eval_split, "data.eval_split", None
    if kind == "default":
        return "eval", "data.dataset", None  # the corpus ships its own eval split
    return cfg.split, "data.split", True


def load_split(cfg: DataConfig, role: Role) -> AnyDataset:
    """The checked split that training ("train") or evaluation ("eval") reads.

    Eval is ``data.eval_split`` when set, the default corpus's own eval split, or else the
    ``data.eval_fraction`` of ``data.split``'s documents held out by index (the same
    documents in streaming and map-style mode, whatever ``data.seed`` is).
    """
    source = resolve_source(cfg)
    split, key, keep = plan_split(cfg, role, source.kind)
    ds = _load(source, split, key, cfg)
    _check_rows(ds, cfg, f"{source.name!r} split {split!r}")
    if keep is not None:
        ds = _hold_out(ds, cfg.eval_fraction, keep_held_out=keep, what=source.name)
    return ds


def _load(source: Source, split: str, key: str, cfg: DataConfig) -> AnyDataset:
    if source.kind != "hub":
        assert source.files is not None and source.builder is not None
        loaded = load_local_files(source.files, source.builder, cfg.cache_dir, cfg.streaming)
        if split not in loaded:
            raise DataError(
                f"{key}: {split!r} is not a split of {source.name!r}; it has "
                f"{', '.join(sorted(loaded))}"
            )
        return loaded[split]
    return _load_hub(source.name, split, key, cfg)


def _load_hub(name: str, split: str, key: str, cfg: DataConfig) -> AnyDataset:
    import datasets

    kwargs: dict[str, Any] = {}
    if cfg.trust_remote_code:
        if "trust_remote_code" not in inspect.signature(datasets.load_dataset).parameters:
            raise DataError(
                f"data.trust_remote_code: datasets {datasets.__version__} no longer "
                "runs dataset loading scripts; use a dataset stored as data files "
                "(parquet/json) or set data.trust_remote_code=false"
            )
        kwargs["trust_remote_code"] = True
    try:
        return datasets.load_dataset(
            name, cfg.dataset_config, split=split, streaming=cfg.streaming, **kwargs
        )
    except ValueError as exc:
        msg = str(exc)
        if "split" in msg.lower():
            raise DataError(
                f"{key}: {split!r} is not a split of hub dataset {name!r}: {msg}"
            ) from None
        if "config" in msg.lower():
            raise DataError(
                f"data.dataset_config: {cfg.dataset_config!r} is not a "
                f"configuration of {name!r}: {msg}"
            ) from None
        raise DataError(f"data.dataset: cannot load hub dataset {name!r}: {msg}") from None
    except (OSError, datasets.exceptions.DatasetNotFoundError) as exc:
        # ConnectionError and FileNotFoundError are OSErrors: offline, unknown or private.
        raise DataError(
            f"data.dataset: hub dataset {name!r} not found or unreachable "
            f"({exc}); if you meant local files, that path does not exist"
        ) from None


def _check_rows(ds: AnyDataset, cfg: DataConfig, what: str) -> None:
    import datasets
    import pyarrow.compute as pc

    col = cfg.text_column
    if isinstance(ds, datasets.Dataset):
        if col not in ds.column_names:
            raise DataError(
                f"data.text_column: {what} has no column {col!r}; its columns are "
                f"{', '.join(ds.column_names)}"
            )
        feature = ds.features[col]
        dtype = getattr(feature, "dtype", None)
        if not isinstance(feature, datasets.Value) or dtype not in ("string", "large_string"):
            raise DataError(
                f"data.text_column: column {col!r} of {what} holds {feature}, not strings"
            )
        if ds.num_rows == 0:
            raise DataError(f"data.dataset: {what} is empty")
        column = ds.data.column(col)
        if column.null_count:
            raise DataError(
                f"data.text_column: {column.null_count} rows of column {col!r} of "
                f"{what} are null, not strings"
            )
        if not pc.max(pc.utf8_length(column)).as_py():
            raise DataError(f"data.dataset: every row of column {col!r} of {what} is empty")
        return
    # Streaming: the schema is often unknown until read; look at the first rows.
    try:
        rows = list(ds.take(64))
    except Exception as exc:  # malformed files only show up when read
        raise DataError(f"data.dataset: cannot read {what}: {type(exc).__name__}: {exc}") from exc
    if not rows:
        raise DataError(f"data.dataset: {what} is empty")
    if col not in rows[0]:
        raise DataError(
            f"data.text_column: {what} has no column {col!r}; its columns are {', '.join(rows[0])}"
        )
    for i, row in enumerate(rows):
        check_text(row[col], col, i)


def check_text(value: Any, column: str, index: int | None = None) -> str:
    """``value`` if it is a string, else the ``data.text_column`` error (streaming rows)."""
    if not isinstance(value, str):
        where = f"row {index}" if index is not None else "a row"
        raise DataError(
            f"data.text_column: {where} of column {column!r} is "
            f"{type(value).__name__} {value!r:.40}, not a string"
        )
    return value


def is_held_out(index: int | Any, fraction: float) -> bool | Any:
    """Whether document ``index`` (int or numpy array) belongs to the held-out eval share.

    frac(index * golden ratio) is equidistributed, so any prefix of the documents holds out
    very nearly ``fraction`` of them, and the choice needs no pass over the data (streaming).
    """
    return (index * _GOLDEN) % 1.0 < fraction


def _hold_out(ds: AnyDataset, fraction: float, keep_held_out: bool, what: str) -> AnyDataset:
    from datasets import IterableDataset

    if isinstance(ds, IterableDataset):
        return ds.filter(
            lambda _, i: bool(is_held_out(i, fraction)) == keep_held_out, with_indices=True
        )
    mask = is_held_out(np.arange(ds.num_rows), fraction) == keep_held_out
    if not mask.any():
        side = "eval" if keep_held_out else "train"
        raise DataError(
            f"data.eval_fraction: {what!r} has {ds.num_rows} document(s), too few "
            f"to hold out a {side} share; set data.eval_split or add documents"
        )
    return ds.select(np.flatnonzero(mask))


def _short(data_files: dict[str, list[str]]) -> str:
    names = [f for files in data_files.values() for f in files]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
