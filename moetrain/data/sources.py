"""Tokenized documents of one split: from a prepared dataset, a token cache, or a stream.

Two kinds, read differently by the packer:

- **indexed** (``PreparedSplit``): a prepared dataset (``moetrain prepare-data``), or a
  map-style split tokenized once into the token cache, which has the same format. Document
  k's length and tokens are read by index from memory maps; nothing is loaded whole.
- **sequential** (``StreamingDocs``): a streamed split, read through a seeded shuffle buffer
  and tokenized ahead of the packer by a background thread.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from moetrain.config import DataConfig
from moetrain.data._cache import cache_root, short_hash
from moetrain.data.corpus import corpus_dir
from moetrain.data.dataset import check_text, load_split, plan_split, resolve_source
from moetrain.data.errors import DataError
from moetrain.data.prepared import PreparedSplit, is_prepared, read_manifest, token_dtype
from moetrain.data.tokenizer import Tokenizer
from moetrain.data.verify import check_files, check_tokenizer

if TYPE_CHECKING:  # datasets loads only where a split is read (moetrain.data.dataset)
    from datasets import IterableDataset

log = logging.getLogger(__name__)

Role = Literal["train", "eval"]

STREAM_SHUFFLE_BUFFER = 10_000
"""Documents held in the seeded shuffle buffer of a streaming dataset."""

PREFETCH_DOCS = 4096
"""Documents a streaming source tokenizes ahead of the packer, in its background thread."""

_STREAM_ENCODE_BATCH = 64  # documents per encode_batch call when streaming


class IndexedDocs(Protocol):
    """Documents (each ending in EOS) read by index: what the packer needs to skip ahead."""

    n_docs: int
    n_tokens: int

    def lengths(self, ids: np.ndarray) -> np.ndarray:
        """Token counts of documents ``ids``."""
        ...

    def read(self, doc: int, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of document ``doc``."""
        ...

    def sample_tokens(self, max_tokens: int) -> np.ndarray:
        """The first ``max_tokens`` tokens in stored order."""
        ...


# ----------------------------------------------------------------------------- streaming


def _produce(
    make: Callable[[], Iterator[Any]], out: queue.Queue[Any], stop: threading.Event
) -> None:
    """Thread body of ``_Prefetcher`` (no reference to it, so dropping it stops the thread)."""

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in make():
            if not put(item):
                return
        put(_Prefetcher.END)
    except BaseException as exc:  # handed to the consumer, raised there
        put(exc)


class _Prefetcher:
    """Runs an iterator in a daemon thread, ``depth`` items ahead of the consumer.

    Items come out in the iterator's order, so prefetching changes nothing but timing; an
    exception in the thread is raised in the consumer when it reaches that point. The thread
    stops when the prefetcher is closed or dropped.
    """

    END = object()

    def __init__(self, make: Callable[[], Iterator[Any]], depth: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        threading.Thread(
            target=_produce,
            args=(make, self._queue, self._stop),
            name="moetrain-tokenize",
            daemon=True,
        ).start()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is self.END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            self.close()
            raise item
        return item

    def close(self) -> None:
        """Stop the thread (it exits at its next hand-over) and drop what it read ahead."""
        self._stop.set()

    def __del__(self) -> None:
        self._stop.set()


class StreamingDocs:
    """An ``IterableDataset`` read through a seeded shuffle buffer and tokenized on the fly.

    Each epoch re-reads the stream from its start; resuming at document k skips the first k
    texts out of the shuffle buffer (read, not tokenized). seed None: stream order, no buffer.
    ``docs()`` tokenizes in a background thread ``prefetch`` documents ahead (0: inline).
    """

    def __init__(
        self,
        ds: IterableDataset,
        tokenizer: Tokenizer,
        column: str,
        seed: int | None,
        buffer_size: int = STREAM_SHUFFLE_BUFFER,
        prefetch: int = PREFETCH_DOCS,
        literal_special_tokens: str = "text",
    ) -> None:
        self.ds = ds
        self.literal_special_tokens = literal_special_tokens
        self.tokenizer = tokenizer
        self.column = column
        self.seed = seed
        self.buffer_size = buffer_size
        self.prefetch = prefetch

    def _texts(self) -> Iterator[str]:
        for batch in self.ds.iter(batch_size=256):
            for value in batch[self.column]:
                text = check_text(value, self.column)
                if text:  # an empty row would add a bare EOS to the stream
                    yield text

    def _shuffled(self, epoch: int) -> Iterator[str]:
        if self.seed is None or self.buffer_size <= 1:
            yield from self._texts()
            return
        # random.Random seeded by a string is stable across Python versions and platforms.
        rng = random.Random(f"moetrain-stream:{self.seed}:{epoch}")
        buffer: list[str] = []
        for text in self._texts():
            if len(buffer) < self.buffer_size:
                buffer.append(text)
                continue
            j = rng.randrange(self.buffer_size)
            yield buffer[j]
            buffer[j] = text
        rng.shuffle(buffer)
        yield from buffer

    def _tokenized(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        texts = itertools.islice(self._shuffled(epoch), start, None)
        dtype = token_dtype(self.tokenizer.vocab_size)
        eos = np.array([self.tokenizer.eos_id], dtype=dtype)
        while batch := list(itertools.islice(texts, _STREAM_ENCODE_BATCH)):
            for ids in self.tokenizer.encode_batch(batch, self.literal_special_tokens):
                yield np.concatenate([np.asarray(ids, dtype=dtype), eos])

    def docs(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        """The documents of ``epoch`` from position ``start``, tokenized (EOS appended)."""
        if self.prefetch <= 0:
            return self._tokenized(epoch, start)
        return _Prefetcher(lambda: self._tokenized(epoch, start), self.prefetch)

    def sample_tokens(self, max_tokens: int) -> np.ndarray:
        """The first ``max_tokens`` tokens of epoch 0 (a sample of the stream)."""
        parts, total = [], 0
        docs = self._tokenized(0, 0)
        for doc in docs:
            parts.append(doc)
            total += len(doc)
            if total >= max_tokens:
                break
        if not parts:
            raise DataError("data.dataset: the streamed split has no non-empty documents")
        return np.concatenate(parts)[:max_tokens]


# ----------------------------------------------------------------------------- building


def open_prepared(
    path: str, tokenizer: Tokenizer, split: str, key: str = "data.dataset"
) -> PreparedSplit:
    """Split ``split`` of the prepared dataset at ``path``, checked against ``tokenizer``
    (manifest, version, tokenizer, shard sizes: no file is read whole)."""
    manifest = read_manifest(path, key)
    check_tokenizer(manifest, tokenizer.fingerprint, tokenizer.eos_id, tokenizer.source)
    check_files(manifest, key)
    return PreparedSplit(manifest, split, key)


def build_doc_source(cfg: DataConfig, tokenizer: Tokenizer, role: Role) -> Any:
    """The tokenized documents training ("train") or evaluation ("eval") reads from
    ``data.dataset``: a ``PreparedSplit`` or a ``StreamingDocs``.

    A prepared dataset is read in place. Any other map-style split is tokenized once into
    ``<cache_dir>/tokens/<key>/`` (the prepared format, keyed by the data and the tokenizer)
    and read from there; for the default corpus the key is known without loading the corpus,
    so a second run starts in about a second.
    """
    if is_prepared(cfg.dataset):
        return open_prepared(cfg.dataset, tokenizer, role)
    if cfg.streaming:
        from datasets import IterableDataset

        ds = load_split(cfg, role)
        assert isinstance(ds, IterableDataset)
        # Eval reads its documents in stored order: the same sequences whatever data.seed
        # is, and a streamed eval needs no shuffle buffer to fill before the first batch.
        seed = cfg.seed if role == "train" else None
        return StreamingDocs(
            ds, tokenizer, cfg.text_column, seed, literal_special_tokens=cfg.literal_special_tokens
        )
    path = token_cache(cfg, tokenizer, role)
    if path is None or not is_prepared(path):
        from datasets import Dataset

        ds = load_split(cfg, role)
        assert isinstance(ds, Dataset)
        if path is None:
            # datasets' content-derived cache key of the split (after any hold-out).
            path = _token_cache(cfg, ds._fingerprint, "", tokenizer)
        if not is_prepared(path):
            from moetrain.data.prepare import tokenize_to_cache

            tokenize_to_cache(
                ds, cfg.text_column, tokenizer, path, role, cfg.literal_special_tokens
            )
    manifest = read_manifest(path, "data.dataset", splits=(role,))
    return PreparedSplit(manifest, role)


def token_cache(cfg: DataConfig, tokenizer: Tokenizer, role: Role) -> Path | None:
    """Where ``role``'s map-style split is (or will be) tokenized by ``tokenizer``, when that is
    known without loading the split, else None.

    Known for the default corpus (keyed by its name) and for local files, keyed by each file's
    path, size and modification time, the builder and the hold-out: a file written again is
    tokenized again. A hub dataset's key is ``datasets``' fingerprint of the loaded split.
    """
    if cfg.dataset == "default":
        split, _, _ = plan_split(cfg, role, "default")
        return _token_cache(cfg, corpus_dir(cfg.cache_dir).name, split, tokenizer)
    source = resolve_source(cfg)
    if source.kind != "local":
        return None
    assert source.files is not None
    split, _, keep = plan_split(cfg, role, source.kind)
    files = source.files.get(split)
    if not files:
        return None  # load_split names the missing split
    stats = []
    for f in files:
        st = os.stat(f)
        stats.append((os.path.abspath(f), st.st_size, st.st_mtime_ns))
    holdout = None if keep is None else (keep, cfg.eval_fraction)
    return _token_cache(cfg, short_hash(source.builder, stats, holdout), split, tokenizer)


def _token_cache(cfg: DataConfig, data_key: str, split: str, tokenizer: Tokenizer) -> Path:
    key = short_hash(
        data_key, split, cfg.text_column, tokenizer.fingerprint, cfg.literal_special_tokens
    )
    return cache_root(cfg.cache_dir) / "tokens" / key
