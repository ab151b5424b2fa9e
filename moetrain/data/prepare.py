"""``moetrain prepare-data``: tokenize a dataset once, in parallel, into a prepared dataset.

The train and eval splits are read exactly as training would read them (``load_split``:
the same documents, the same hold-out, in the same order), cut into shards of about
``--shard-mb`` million characters of text, tokenized by a pool of worker processes, and
written as the format of ``moetrain.data.prepared``. Work goes to a staging directory next
to ``--out`` (``.<name>.partial``); each finished shard is recorded there, so an
interrupted run started again redoes only the unfinished shards. When every shard is
written, the manifest goes in and the staging directory is renamed to ``--out`` in one
step: a dataset directory with a manifest is always complete.

One module (about 600 lines) because it is one command read top to bottom: the shard plan,
the staging directory and its resume, the worker pool and the publish share the staging
state and the failure handling; the per-shard tokenizer runs in
``moetrain.data.tokenize_worker`` and the reader in ``moetrain.data.prepared``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.compute as pc
from datasets import Dataset

from moetrain.config import DataConfig
from moetrain.data.dataset import check_text, load_split, resolve_source
from moetrain.data.errors import DataError
from moetrain.data.fast_bpe import choose_engine
from moetrain.data.prepared import (
    FORMAT_VERSION,
    TOKENIZER_FILE,
    Manifest,
    build_manifest,
    is_prepared,
    publish_dir,
    read_manifest,
    sha256_file,
    token_dtype,
    write_json_atomic,
)
from moetrain.data.tokenize_worker import ShardTokenizer, init_worker, write_shard
from moetrain.data.tokenizer import Tokenizer, load_tokenizer
from moetrain.data.verify import check_files, record_verified, stamp_file, verify_checksums

if TYPE_CHECKING:
    from moetrain.data.dataset import AnyDataset

log = logging.getLogger(__name__)

MAX_SHARD_MB = 64.0
"""Most millions of characters of text per shard (about 30 MB of uint16 tokens for English)."""

MIN_SHARD_MB = 1.0
"""Fewest millions of characters per shard when the size is chosen automatically."""

STREAM_SHARD_MB = 16.0
"""Shard size for a streamed source, whose total size is not known up front."""

CACHE_SHARD_MB = 256.0
"""Shard size of the token cache that on-the-fly tokenization writes."""

PROOF_CHARS = 2_000_000
"""Characters of the data on which tiktoken must give the tokenizer's ids before it is used."""

_PLAN = "plan.json"
_DONE = ".done"
_LOCK = ".lock"
_ROLES = ("train", "eval")


# ----------------------------------------------------------------------------- texts -> shards


def _shard_texts(ds: AnyDataset, column: str, shard_chars: int) -> Iterator[tuple[list[str], int]]:
    """The split's non-empty texts in order, cut into shards of ``shard_chars`` characters:
    (texts, rows read for them, empty ones included)."""
    texts: list[str] = []
    chars = rows = 0
    for batch in ds.iter(batch_size=1000):
        for value in batch[column]:
            rows += 1
            text = check_text(value, column)  # streamed rows are not checked up front
            if not text:
                continue  # an empty row would add a bare EOS to the stream
            texts.append(text)
            chars += len(text)
            if chars >= shard_chars:
                yield texts, rows
                texts, chars, rows = [], 0, 0
    if texts or rows:
        yield texts, rows


def _sample_texts(ds: AnyDataset, column: str, chars: int = PROOF_CHARS) -> list[str]:
    """The first non-empty texts of a split, about ``chars`` characters: the sample on which
    a faster engine must give the tokenizer's ids (``fast_bpe.choose_engine``)."""
    out: list[str] = []
    total = 0
    for batch in ds.iter(batch_size=256):
        for value in batch[column]:
            if isinstance(value, str) and value:
                out.append(value)
                total += len(value)
        if total >= chars:
            break
    return out


def auto_shard_chars(splits: dict[str, AnyDataset], column: str) -> int:
    """Characters per shard: 1/64 of the text (so that the workers stay evenly busy to the
    end), between ``MIN_SHARD_MB`` and ``MAX_SHARD_MB`` million. It depends on the data
    alone, so that a resumed run cuts the same shards whatever its worker count."""
    if not all(isinstance(ds, Dataset) for ds in splits.values()):
        return int(STREAM_SHARD_MB * 1e6)
    total = 0.0
    for ds in splits.values():
        table = ds.data  # the whole file's rows: scale to the rows this split selects
        chars = pc.sum(pc.utf8_length(table.column(column))).as_py() or 0
        total += chars * ds.num_rows / max(1, table.num_rows)
    return int(min(max(total / 64, MIN_SHARD_MB * 1e6), MAX_SHARD_MB * 1e6))


def _tokenizer_info(tokenizer: Tokenizer) -> dict[str, Any]:
    return {
        "fingerprint": tokenizer.fingerprint,
        "source": tokenizer.source,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "eos_token": tokenizer.eos_token,
    }


def tokenize_to_cache(
    ds: Dataset,
    column: str,
    tokenizer: Tokenizer,
    final: Path,
    split: str,
    literal_special_tokens: str = "text",
) -> None:
    """Tokenize one map-style split in this process into ``final``, a prepared dataset
    holding only ``split`` (the token cache of on-the-fly data). Several processes may do
    this at once: each writes its own staging directory and the first to finish publishes."""
    chars = pc.sum(pc.utf8_length(ds.data.column(column))).as_py() or 0
    if chars > 1e8:
        log.warning(
            "tokenizing about %.0f M characters of text in this process (every rank does the "
            "same); `moetrain prepare-data` does it once, in parallel, and training on its "
            "output starts in about a second",
            chars / 1e6,
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}.{uuid.uuid4().hex[:8]}.partial"
    staging.mkdir()
    try:
        dtype = token_dtype(tokenizer.vocab_size)
        worker = ShardTokenizer(tokenizer.to_str(), tokenizer.eos_id, dtype, literal_special_tokens)
        shard_chars = int(CACHE_SHARD_MB * 1e6)
        entries = [
            worker.write(staging, split, i, texts)
            for i, (texts, _) in enumerate(_shard_texts(ds, column, shard_chars))
        ]
        if not sum(e["n_docs"] for e in entries):
            raise DataError("data.dataset: the split has no non-empty documents")
        manifest = build_manifest(
            _tokenizer_info(tokenizer),
            dtype,
            {split: entries},
            {"cache": ds._fingerprint},
            literal_special_tokens,
        )
        write_json_atomic(staging / "manifest.json", manifest)
        publish_dir(staging, final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


# ----------------------------------------------------------------------------- prepare-data


@contextlib.contextmanager
def _datasets_without_torch() -> Iterator[None]:
    """Read with ``datasets`` as if torch were not installed, while this process has not
    loaded it. Each streaming ``IterableDataset`` imports torch (about a CPU-second and
    200 MB of the parent's memory) only to share its epoch counter with DataLoader workers;
    preparation has none. ``datasets.config.TORCH_AVAILABLE`` is the switch its ``USE_TORCH``
    variable sets; it is restored on the way out."""
    import datasets.config

    saved = datasets.config.TORCH_AVAILABLE
    if "torch" not in sys.modules:
        datasets.config.TORCH_AVAILABLE = False
    try:
        yield
    finally:
        datasets.config.TORCH_AVAILABLE = saved


def _source_description(cfg: DataConfig, splits: dict[str, AnyDataset]) -> dict[str, Any]:
    """What was read: enough to tell, on resume, whether the input is still the same."""
    source = resolve_source(cfg)
    desc: dict[str, Any] = {
        "dataset": cfg.dataset,
        "kind": source.kind,
        "dataset_config": cfg.dataset_config,
        "format": source.builder,
        "split": cfg.split,
        "eval_split": cfg.eval_split,
        "eval_fraction": cfg.eval_fraction,
        "text_column": cfg.text_column,
        "streaming": cfg.streaming,
    }
    if source.files:
        desc["files"] = {
            split: [[f, os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files]
            for split, files in source.files.items()
        }
    desc["fingerprints"] = {
        role: ds._fingerprint for role, ds in splits.items() if isinstance(ds, Dataset)
    }
    return desc


class _Staging:
    """The staging directory of one ``--out``: its plan, lock and finished shards."""

    def __init__(self, out: Path, plan: dict[str, Any]) -> None:
        self.dir = out.parent / f".{out.name}.partial"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.dir / _LOCK, "w")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise DataError(
                f"--out: another prepare-data is writing {str(self.dir)!r}; wait for it"
            ) from None
        plan_file = self.dir / _PLAN
        if plan_file.is_file():
            old = json.loads(plan_file.read_text())
            if old != plan:
                changed = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
                self.close()
                raise DataError(
                    f"--out: {str(self.dir)!r} holds an interrupted preparation of other data "
                    f"or settings (differing: {', '.join(changed)}); delete it to start "
                    "over, or run with the settings it was started with"
                )
        else:
            write_json_atomic(plan_file, plan)
        (self.dir / _DONE).mkdir(exist_ok=True)
        for leftover in self.dir.glob(".*.tmp"):  # shards a killed worker left half-written
            leftover.unlink()

    def done(self) -> dict[tuple[str, int], dict[str, Any]]:
        """Finished shards whose files are whole (size and checksum); others are redone."""
        out = {}
        for record_file in sorted((self.dir / _DONE).glob("*.json")):
            record = json.loads(record_file.read_text())
            entry = record["entry"]
            ok = all(
                (self.dir / entry[f]).is_file()
                and (self.dir / entry[f]).stat().st_size == entry[f"{f}_bytes"]
                and sha256_file(self.dir / entry[f]) == entry[f"{f}_sha256"]
                for f in ("tokens", "index")
            )
            if ok:
                out[record["split"], record["index"]] = record
            else:
                record_file.unlink()
        return out

    def record(self, split: str, index: int, entry: dict[str, Any], rows: int) -> None:
        record = {"split": split, "index": index, "entry": entry, "rows": rows}
        write_json_atomic(self.dir / _DONE / f"{split}-{index:05d}.json", record)

    def close(self) -> None:
        self._lock.close()


def _run(
    tasks: Iterator[tuple[str, int, list[str], int]],
    workers: int,
    init_args: tuple[Any, ...],
    directory: Path,
    on_done: Callable[[str, int, dict[str, Any], int], None],
) -> None:
    """Tokenize every (split, index, texts, rows) task into its shard: in this process when
    ``workers`` is 0, else in a pool of that many spawned processes, with at most
    ``workers + 2`` shards of text in flight (memory bounded by the shard size)."""
    if workers == 0:
        worker = ShardTokenizer(*init_args[:5])
        for split, index, texts, rows in tasks:
            on_done(split, index, worker.write(directory, split, index, texts), rows)
        return
    ctx = get_context("spawn")  # no fork: the parent may hold threads and torch's pools
    with ProcessPoolExecutor(workers, ctx, init_worker, init_args) as pool:
        pending: dict[Future[dict[str, Any]], tuple[str, int, int]] = {}

        def collect(block: bool) -> None:
            finished, _ = (
                wait(pending, return_when=FIRST_COMPLETED)
                if block
                else ([f for f in pending if f.done()], None)
            )
            for future in finished:
                split, index, rows = pending.pop(future)
                on_done(split, index, future.result(), rows)

        try:
            for split, index, texts, rows in tasks:
                while len(pending) >= workers + 2:
                    collect(block=True)
                pending[pool.submit(write_shard, str(directory), split, index, texts)] = (
                    split,
                    index,
                    rows,
                )
                collect(block=False)
            while pending:
                collect(block=True)
        except BaseException:
            for future in pending:
                future.cancel()
            raise


def prepare_dataset(
    cfg: DataConfig,
    out: str | os.PathLike[str],
    workers: int | None = None,
    shard_mb: float | None = None,
    progress: bool = True,
    arrow_cache: bool = False,
) -> Manifest:
    """Tokenize ``cfg``'s train and eval splits into the prepared dataset ``out``.

    ``workers``: tokenizing processes (None: one per CPU core; 0: this process).
    ``shard_mb``: millions of characters of text per shard (None: ``auto_shard_chars``).
    Local files (and the default corpus) are streamed in record batches: memory stays flat
    in the corpus size and no Arrow copy of the corpus is left behind; ``arrow_cache`` reads
    them through ``datasets``' Arrow cache instead (a second copy of the corpus, kept).
    Resumes an interrupted run with the same settings; returns the finished manifest.
    """
    out = Path(out).expanduser().absolute()
    if cfg.mix is not None:
        raise DataError(
            "data.mix: prepare-data prepares one dataset (data.dataset); "
            "prepare each part of a mixture on its own"
        )
    if is_prepared(cfg.dataset):
        raise DataError(f"data.dataset: {cfg.dataset!r} is already a prepared dataset")
    if workers is None:
        workers = os.cpu_count() or 1
    if workers < 0 or (shard_mb is not None and not shard_mb > 0):
        raise DataError(f"--workers must be >= 0 and --shard-mb > 0, got {workers}, {shard_mb}")
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.cache_dir)
    if out.exists() and not is_prepared(out):
        raise DataError(
            f"--out: {str(out)!r} exists and is not a prepared dataset; choose a new directory"
        )
    with _datasets_without_torch():
        return _plan_and_prepare(cfg, out, tokenizer, workers, shard_mb, progress, arrow_cache)


def _plan_and_prepare(
    cfg: DataConfig,
    out: Path,
    tokenizer: Tokenizer,
    workers: int,
    shard_mb: float | None,
    progress: bool,
    arrow_cache: bool,
) -> Manifest:
    stream = not arrow_cache and resolve_source(cfg).kind != "hub"
    read_cfg = dataclasses.replace(cfg, streaming=True) if stream else cfg
    splits = {role: load_split(read_cfg, role) for role in _ROLES}
    dtype = token_dtype(tokenizer.vocab_size)
    if shard_mb is None:
        shard_chars = auto_shard_chars(splits, cfg.text_column)
    else:
        shard_chars = max(1, int(shard_mb * 1e6))
    plan = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.fingerprint,
        "dtype": dtype,
        "shard_chars": shard_chars,
        "literal_special_tokens": cfg.literal_special_tokens,
        "source": _source_description(cfg, splits),
    }
    if is_prepared(out):
        manifest = read_manifest(out, "--out")
        same = manifest.tokenizer["fingerprint"] == tokenizer.fingerprint
        same = same and manifest.literal_special_tokens == cfg.literal_special_tokens
        if not same or json.loads(json.dumps(plan["source"])) != manifest.data["source"]:
            raise DataError(
                f"--out: {str(out)!r} already holds a dataset prepared from other data or "
                "with another tokenizer; choose another --out"
            )
        log.info("%s is already prepared", out)
        return manifest
    staging = _Staging(out, plan)
    try:
        return _prepare(
            cfg, out, staging, splits, tokenizer, dtype, shard_chars, plan, workers, progress
        )
    finally:
        staging.close()


def _prepare(
    cfg: DataConfig,
    out: Path,
    staging: _Staging,
    splits: dict[str, AnyDataset],
    tokenizer: Tokenizer,
    dtype: str,
    shard_chars: int,
    plan: dict[str, Any],
    workers: int,
    progress: bool,
) -> Manifest:
    from tqdm import tqdm

    (staging.dir / TOKENIZER_FILE).write_text(tokenizer.to_str())
    done = staging.done()
    records: dict[tuple[str, int], dict[str, Any]] = dict(done)
    rows_known = all(isinstance(ds, Dataset) for ds in splits.values())
    total = sum(ds.num_rows for ds in splits.values()) if rows_known else None
    bar = tqdm(
        total=total,
        initial=sum(r["rows"] for r in done.values()),
        unit="doc",
        unit_scale=True,
        desc=f"prepare-data {out.name}",
        disable=not progress,
        dynamic_ncols=True,
    )
    tokens = sum(r["entry"]["n_tokens"] for r in done.values())
    started = time.perf_counter()
    new_tokens = 0

    def on_done(split: str, index: int, entry: dict[str, Any], rows: int) -> None:
        nonlocal tokens, new_tokens
        staging.record(split, index, entry, rows)
        records[split, index] = {"entry": entry, "rows": rows}
        tokens += entry["n_tokens"]
        new_tokens += entry["n_tokens"]
        bar.update(rows)
        bar.set_postfix(tokens=f"{tokens / 1e6:.1f}M", shards=len(records), refresh=False)

    def tasks() -> Iterator[tuple[str, int, list[str], int]]:
        for role, ds in splits.items():
            for index, (texts, rows) in enumerate(_shard_texts(ds, cfg.text_column, shard_chars)):
                if (role, index) not in done:  # finished shards are read past, not redone
                    yield role, index, texts, rows

    engine = choose_engine(
        tokenizer.to_str(), _sample_texts(splits["train"], cfg.text_column),
        cfg.literal_special_tokens,
    )  # fmt: skip
    init_args = (
        tokenizer.to_str(),
        tokenizer.eos_id,
        dtype,
        cfg.literal_special_tokens,
        engine,
        workers == 1,
    )
    try:
        _run(tasks(), workers, init_args, staging.dir, on_done)
    finally:
        bar.close()
    shards = {
        role: [records[key]["entry"] for key in sorted(k for k in records if k[0] == role)]
        for role in _ROLES
    }
    for role, entries in shards.items():
        if not sum(e["n_docs"] for e in entries):
            raise DataError(f"data.dataset: the {role} split has no non-empty documents")
    manifest_data = build_manifest(
        _tokenizer_info(tokenizer), dtype, shards, plan["source"], cfg.literal_special_tokens
    )
    write_json_atomic(staging.dir / "manifest.json", manifest_data)
    publish_dir(staging.dir, out)
    shutil.rmtree(out / _DONE, ignore_errors=True)  # bookkeeping of the staging directory
    for name in (_PLAN, _LOCK):
        (out / name).unlink(missing_ok=True)
    manifest = read_manifest(out, "--out")
    check_files(manifest, "--out")
    record_verified(manifest, stamp_file(cfg.cache_dir, manifest))
    seconds = time.perf_counter() - started
    log.info(
        "prepared %s: %d train / %d eval documents, %.1fM tokens in %d shards; tokenized "
        "%.1fM tokens in %.1f s (%.0f tokens/s, %d workers)",
        out,
        manifest.split("train")["n_docs"],
        manifest.split("eval")["n_docs"],
        tokens / 1e6,
        sum(len(v) for v in shards.values()),
        new_tokens / 1e6,
        seconds,
        new_tokens / max(seconds, 1e-9),
        workers,
    )
    return manifest


def verify_dataset(path: str | os.PathLike[str], cache_dir: str | None = None) -> int:
    """Read every shard of the prepared dataset ``path`` and compare it with its checksum
    (``DataError`` naming the first file that differs); record the result for this machine.
    Returns the bytes read."""
    manifest = read_manifest(path, "--verify")
    check_files(manifest, "--verify")
    return verify_checksums(manifest, stamp_file(cache_dir, manifest), "--verify", force=True)


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``moetrain prepare-data``: exit status 0, 2 for bad input, 130 when interrupted."""
    parser = argparse.ArgumentParser(
        prog="moetrain prepare-data",
        description="Tokenize the dataset that the data.* keys name, once and in parallel, "
        "into a prepared dataset (sharded token files, a memory-mapped document index, "
        "and a manifest); train on it with data.dataset=DIR.",
    )
    parser.add_argument("--config", help="YAML experiment file (its data section is read)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides (data.*)")
    parser.add_argument("--out", help="directory to create (resumed if interrupted)")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizing processes (default: one per CPU core; 0: this one)",
    )
    parser.add_argument(
        "--shard-mb",
        type=float,
        default=None,
        help="millions of characters of text per shard (default: 1/64 of the text, "
        f"between {MIN_SHARD_MB:g} and {MAX_SHARD_MB:g}; {STREAM_SHARD_MB:g} when streaming)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--arrow-cache",
        action="store_true",
        help="read local files through datasets' Arrow cache (a second copy of the corpus, "
        "kept under data.cache_dir) instead of streaming them in record batches",
    )
    parser.add_argument(
        "--verify",
        metavar="DIR",
        help="check every shard of a prepared dataset against its checksum",
    )
    args = parser.parse_intermixed_args(argv)  # options and key=value in any order
    if (args.out is None) == (args.verify is None):
        parser.error("give --out DIR to prepare, or --verify DIR to check")

    from moetrain.config import ConfigError, load_config

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        if args.verify is not None:
            start = time.perf_counter()
            nbytes = verify_dataset(args.verify, cfg.data.cache_dir)
            print(
                f"{args.verify}: every shard matches its checksum ({nbytes / 1e6:.1f} MB "
                f"read in {time.perf_counter() - start:.1f} s)"
            )
            return 0
        import datasets

        datasets.disable_progress_bars()
        manifest = prepare_dataset(
            cfg.data,
            args.out,
            args.workers,
            args.shard_mb,
            progress=not args.no_progress and sys.stderr.isatty(),
            arrow_cache=args.arrow_cache,
        )
        train = manifest.split("train")
        print(
            f"{manifest.root}: {train['n_docs']} training documents, "
            f"{train['n_tokens']} tokens; train on it with data.dataset={manifest.root}"
        )
    except ConfigError as exc:
        print(f"moetrain: config error: {exc}", file=sys.stderr)
        return 2
    except DataError as exc:
        print(f"moetrain: data error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "moetrain: prepare-data interrupted; run the same command again to resume "
            "(finished shards are kept)",
            file=sys.stderr,
        )
        return 130
    return 0
