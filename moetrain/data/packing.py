"""Documents -> one global token stream -> packed sequences -> this rank's micro-batches.

The stream is the documents of epoch 0 in a seeded order, each followed by EOS, then those of
epoch 1 in a new order, and so on; it is cut into consecutive sequences of ``seq_len + 1``
tokens (inputs ``[:-1]``, labels ``[1:]``). A step's global batch is the next
``global_batch_size`` sequences of that stream, and data-parallel rank r reads the contiguous
block ``[r * G / dp, (r + 1) * G / dp)`` of it, cut into micro-batches. Nothing depends on
the layout, so dp=1 with 4 micro-batches sees the same sequences as dp=2 with 2 each.

The position in the stream is three integers (epoch, document, token offset in it); that is
the whole resumable state, identical on every rank.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
from datasets import Dataset, IterableDataset

from moetrain.config import DataConfig
from moetrain.data._cache import cache_root, publish, short_hash
from moetrain.data.corpus import corpus_dir
from moetrain.data.dataset import check_text, load_split, plan_split
from moetrain.data.errors import DataError
from moetrain.data.tokenizer import Tokenizer

Batch = dict[str, torch.Tensor]

STREAM_SHUFFLE_BUFFER = 10_000
"""Documents held in the seeded shuffle buffer of a streaming dataset."""


_TOKENIZE_BATCH = 1024  # documents per encode_batch call (tokenizers parallelizes inside)
_STATE_VERSION = 1


# ----------------------------------------------------------------------------- documents


class DocSource(Protocol):
    """Tokenized documents (each ending in EOS) of one split, in a per-epoch order."""

    def docs(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        """The documents of ``epoch`` in order, from position ``start`` on."""
        ...

    def sample_tokens(self, max_tokens: int) -> np.ndarray:
        """Tokens of the split (the first ``max_tokens`` of epoch 0 when it is bigger)."""
        ...


class InMemoryDocs:
    """A map-style split tokenized into one flat array.

    Epoch order: a permutation seeded by (seed, epoch), or storage order when seed is None.
    """

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, seed: int | None) -> None:
        if len(offsets) < 2:
            raise DataError("data.dataset: the split has no non-empty documents")
        self.tokens = tokens
        self.offsets = offsets
        self.seed = seed
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def n_docs(self) -> int:
        """Number of (non-empty) documents in the split."""
        return len(self.offsets) - 1

    def order(self, epoch: int) -> np.ndarray:
        """Document indices of ``epoch``: a permutation drawn from (seed, epoch) alone."""
        if self.seed is None:
            return np.arange(self.n_docs)
        if self._order is None or self._order[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_docs)
            self._order = (epoch, perm)
        return self._order[1]

    def docs(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        """The documents of ``epoch`` from position ``start`` (views into the flat array)."""
        offsets = self.offsets
        for d in self.order(epoch)[start:]:
            yield self.tokens[offsets[d] : offsets[d + 1]]

    def sample_tokens(self, max_tokens: int) -> np.ndarray:
        """All tokens of the split (or the first ``max_tokens`` in storage order)."""
        return self.tokens[:max_tokens]


class StreamingDocs:
    """An ``IterableDataset`` read through a seeded shuffle buffer and tokenized on the fly.

    Each epoch re-reads the stream from its start; resuming at document k skips the first k
    texts out of the shuffle buffer (read, not tokenized). seed None: stream order, no buffer.
    """

    def __init__(
        self,
        ds: IterableDataset,
        tokenizer: Tokenizer,
        column: str,
        seed: int | None,
        buffer_size: int = STREAM_SHUFFLE_BUFFER,
    ) -> None:
        self.ds = ds
        self.tokenizer = tokenizer
        self.column = column
        self.seed = seed
        self.buffer_size = buffer_size

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

    def docs(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        """The documents of ``epoch`` from position ``start``, tokenized in batches."""
        texts = itertools.islice(self._shuffled(epoch), start, None)
        dtype = token_dtype(self.tokenizer.vocab_size)
        while batch := list(itertools.islice(texts, 64)):
            for ids in self.tokenizer.encode_batch(batch):
                ids.append(self.tokenizer.eos_id)
                yield np.asarray(ids, dtype=dtype)

    def sample_tokens(self, max_tokens: int) -> np.ndarray:
        """The first ``max_tokens`` tokens of epoch 0 (a sample of the stream)."""
        parts, total = [], 0
        for doc in self.docs(0, 0):
            parts.append(doc)
            total += len(doc)
            if total >= max_tokens:
                break
        if not parts:
            raise DataError("data.dataset: the streamed split has no non-empty documents")
        return np.concatenate(parts)[:max_tokens]


def token_dtype(vocab_size: int) -> type[np.unsignedinteger[Any]]:
    """Smallest unsigned dtype holding every id (uint16 for vocabularies up to 65536)."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def tokenize_dataset(
    ds: Dataset, tokenizer: Tokenizer, column: str
) -> tuple[np.ndarray, np.ndarray]:
    """Flat token array (EOS after each non-empty document) and document offsets (n + 1)."""
    dtype = token_dtype(tokenizer.vocab_size)
    chunks: list[np.ndarray] = []
    lengths: list[int] = []
    for batch in ds.iter(batch_size=_TOKENIZE_BATCH):
        texts = [t for t in batch[column] if t]
        for ids in tokenizer.encode_batch(texts):
            ids.append(tokenizer.eos_id)
            chunks.append(np.asarray(ids, dtype=dtype))
            lengths.append(len(ids))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return tokens, offsets


def build_doc_source(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    role: Literal["train", "eval"],
) -> DocSource:
    """The tokenized documents training ("train") or evaluation ("eval") reads.

    Map-style splits are tokenized once and cached as ``<cache_dir>/tokens/<key>.npz``; for
    the default corpus the key is known without loading the corpus, so a second run starts
    in about a second.
    """
    # Eval reads its documents in stored order: the same sequences whatever data.seed is,
    # and a streamed eval needs no shuffle buffer to fill before the first batch.
    seed = cfg.seed if role == "train" else None
    if cfg.streaming:
        ds = load_split(cfg, role)
        assert isinstance(ds, IterableDataset)
        return StreamingDocs(ds, tokenizer, cfg.text_column, seed)
    path = None
    if cfg.dataset == "default":
        split, _, _ = plan_split(cfg, role, "default")
        path = _token_cache(cfg, corpus_dir(cfg.cache_dir).name, split, tokenizer)
    if path is None or not path.is_file():
        ds = load_split(cfg, role)
        assert isinstance(ds, Dataset)
        fingerprint = getattr(ds, "_fingerprint", None)  # datasets' content-derived cache key
        if path is None and fingerprint:
            path = _token_cache(cfg, fingerprint, "", tokenizer)
        if path is None or not path.is_file():
            tokens, offsets = tokenize_dataset(ds, tokenizer, cfg.text_column)
            if path is not None:
                publish(path, lambda f: np.savez(f, tokens=tokens, offsets=offsets))
            return InMemoryDocs(tokens, offsets, seed)
    with np.load(path) as cached:
        return InMemoryDocs(cached["tokens"], cached["offsets"], seed)


def _token_cache(cfg: DataConfig, data_key: str, split: str, tokenizer: Tokenizer) -> Path:
    key = short_hash(data_key, split, cfg.text_column, tokenizer.fingerprint)
    return cache_root(cfg.cache_dir) / "tokens" / f"{key}.npz"


# ----------------------------------------------------------------------------- packing


class _Packer:
    """Reads the infinite token stream; its position is (epoch, doc, offset)."""

    def __init__(self, source: DocSource) -> None:
        self.source = source
        self.epoch = self.doc = self.offset = 0
        self._docs: Iterator[np.ndarray] | None = None
        self._current: np.ndarray | None = None

    def seek(self, epoch: int, doc: int, offset: int) -> None:
        self.epoch, self.doc, self.offset = epoch, doc, offset
        self._docs = self._current = None

    def take(self, n: int) -> np.ndarray:
        parts: list[np.ndarray] = []
        need = n
        while need:
            if self._current is None:
                if self._docs is None:
                    self._docs = self.source.docs(self.epoch, self.doc)
                self._current = next(self._docs, None)
                if self._current is None:
                    if self.doc == 0:
                        raise DataError("data.dataset: the split has no non-empty documents")
                    self.seek(self.epoch + 1, 0, 0)  # wrap: a new epoch, a new order
                    continue
            cur = self._current
            if self.offset >= len(cur):
                raise ValueError(
                    f"data state: offset {self.offset} is past the end of document {self.doc} "
                    f"({len(cur)} tokens); the state was saved for other data"
                )
            k = min(len(cur) - self.offset, need)
            parts.append(cur[self.offset : self.offset + k])
            self.offset += k
            need -= k
            if self.offset == len(cur):
                self.doc += 1
                self.offset = 0
                self._current = None
        return np.concatenate(parts)


class PackedBatches:
    """Packed, layout-independent, resumable batches of one split for one data-parallel rank.

    ``next_step()`` returns this rank's micro-batches of the next optimizer step: a list of
    ``global_batch_size / (dp_size * micro_batch_size)`` dicts with ``input_ids`` and
    ``labels``, LongTensors of shape [micro_batch_size, seq_len]. The "train" split is
    shuffled by ``data.seed`` with a new order per epoch; the "eval" split is read in stored
    order, and ``reset()`` rewinds it so every evaluation reads the same sequences.
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        split: Literal["train", "eval"] = "train",
        global_batch_size: int = 16,
        micro_batch_size: int = 8,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if micro_batch_size <= 0 or global_batch_size % (dp_size * micro_batch_size):
            raise DataError(
                f"train.global_batch_size: {global_batch_size} is not a multiple of "
                f"micro_batch_size {micro_batch_size} x data-parallel degree "
                f"{dp_size}"
            )
        self.cfg = cfg
        self.split = split
        self.seq_len = cfg.seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.source = build_doc_source(cfg, tokenizer, split)
        self._packer = _Packer(self.source)
        self.steps = 0

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches this rank runs per optimizer step (gradient accumulation steps)."""
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    def next_global_batch(self) -> np.ndarray:
        """The step's global batch: [global_batch_size, seq_len + 1] tokens (all ranks')."""
        rows = self._packer.take(self.global_batch_size * (self.seq_len + 1))
        self.steps += 1
        return rows.reshape(self.global_batch_size, self.seq_len + 1)

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next optimizer step."""
        rows = self.next_global_batch()
        per_rank = self.global_batch_size // self.dp_size
        mine = torch.from_numpy(
            rows[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank].astype(np.int64)
        )
        mb = self.micro_batch_size
        return [
            {
                "input_ids": mine[i : i + mb, :-1].contiguous(),
                "labels": mine[i : i + mb, 1:].contiguous(),
            }
            for i in range(0, per_rank, mb)
        ]

    def __iter__(self) -> Iterator[list[Batch]]:
        return self

    def __next__(self) -> list[Batch]:
        return self.next_step()

    def reset(self) -> None:
        """Rewind to the start of the stream (what evaluation does before each pass)."""
        self._packer.seek(0, 0, 0)
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        """The stream position: plain ints, the same on every rank and for every layout."""
        p = self._packer
        return {
            "version": _STATE_VERSION,
            "seed": self.cfg.seed,
            "epoch": p.epoch,
            "doc": p.doc,
            "offset": p.offset,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue exactly where the iterator that saved ``state`` stopped."""
        missing = {"epoch", "doc", "offset", "seed"} - set(state)
        if missing:
            raise ValueError(f"data state is missing {sorted(missing)}")
        if int(state["seed"]) != self.cfg.seed:
            raise DataError(
                f"data.seed: the checkpoint's data order used seed {state['seed']}, "
                f"this run has {self.cfg.seed}; resuming would replay or skip "
                "documents"
            )
        self._packer.seek(int(state["epoch"]), int(state["doc"]), int(state["offset"]))
        self.steps = int(state.get("steps", 0))

    def sample_tokens(self, max_tokens: int = 2_000_000) -> np.ndarray:
        """Tokens of this split (a prefix of the stream when streaming)."""
        return self.source.sample_tokens(max_tokens)


# ----------------------------------------------------------------------------- entropy


def token_entropy(tokens: np.ndarray | torch.Tensor | list[int]) -> float:
    """Unigram entropy of ``tokens`` in nats/token: the loss of a model that ignores context."""
    ids = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens)
    if ids.size == 0:
        raise ValueError("no tokens")
    counts = np.bincount(ids.reshape(-1).astype(np.int64))
    p = counts[counts > 0] / ids.size
    return float(-(p * np.log(p)).sum())


def unigram_entropy(tokenizer: Tokenizer, cfg: DataConfig, max_tokens: int = 2_000_000) -> float:
    """Unigram entropy (nats/token) of the training split's tokens, EOS included.

    An eval loss below it means the model uses context. Streaming splits are sampled from
    the first ``max_tokens`` tokens.
    """
    return token_entropy(build_doc_source(cfg, tokenizer, "train").sample_tokens(max_tokens))
