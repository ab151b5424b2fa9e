"""Documents -> one global token stream -> packed sequences -> this rank's micro-batches.

The stream is the documents of epoch 0 in a seeded order, each followed by EOS, then those of
epoch 1 in a new order, and so on; it is cut into consecutive sequences of ``seq_len + 1``
tokens (inputs ``[:-1]``, labels ``[1:]``). A step's global batch is the next
``global_batch_size`` sequences of that stream, and data-parallel rank r reads the contiguous
block ``[r * G / dp, (r + 1) * G / dp)`` of it, cut into micro-batches. Nothing depends on
the layout, so dp=1 with 4 micro-batches sees the same sequences as dp=2 with 2 each.

The position in the stream is three integers (epoch, document, token offset in it); that is
the whole resumable state, identical on every rank. On an indexed source (a prepared dataset
or the token cache) a rank moves past the other ranks' blocks by document lengths alone and
reads the tokens of its own block only. A mixture (``data.mix``) draws each global sequence
from one of several such streams, each with its own position.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch

from moetrain.config import DataConfig
from moetrain.data.errors import DataError
from moetrain.data.sampling import permutation_slice, weighted_choice
from moetrain.data.sources import IndexedDocs, StreamingDocs, build_doc_source, open_prepared
from moetrain.data.tokenizer import Tokenizer

Batch = dict[str, torch.Tensor]

_STATE_VERSION = 2
"""2: documents ordered by ``sampling.permutation_slice`` (1: a numpy permutation array)."""


# ----------------------------------------------------------------------------- streams


class IndexedStream:
    """The infinite token stream of an indexed source; its position is (epoch, doc, offset).

    ``advance(n)`` moves ``n`` tokens on, reading the lengths of the documents it passes and,
    only when asked for them, their tokens. seed None: every epoch in stored order.
    """

    def __init__(self, source: IndexedDocs, seed: int | None) -> None:
        if source.n_docs == 0:
            raise DataError("data.dataset: the split has no non-empty documents")
        self.source = source
        self.seed = seed
        self.epoch = self.doc = self.offset = 0
        self._avg = max(1.0, source.n_tokens / source.n_docs)

    def order(self, epoch: int) -> np.ndarray:
        """All document indices of ``epoch`` in order (tests and tools; training reads
        windows of it)."""
        return permutation_slice(self.seed, epoch, self.source.n_docs, 0, self.source.n_docs)

    def seek(self, epoch: int, doc: int, offset: int) -> None:
        self.epoch, self.doc, self.offset = epoch, doc, offset
        if self.doc >= self.source.n_docs and self.offset == 0:
            self.epoch, self.doc = self.epoch + 1, 0

    def advance(
        self, n: int, out: list[np.ndarray] | None = None, ends: list[bool] | None = None
    ) -> None:
        """Move ``n`` tokens on; append the tokens passed to ``out`` when it is given, and
        to ``ends`` whether each of those pieces ends its document."""
        src = self.source
        while n > 0:
            if self.doc >= src.n_docs:
                raise ValueError(
                    f"data state: document {self.doc} is past the end of epoch {self.epoch} "
                    f"({src.n_docs} documents); the state was saved for other data"
                )
            window = min(src.n_docs - self.doc, int((n + self.offset) / self._avg * 1.25) + 8)
            ids = permutation_slice(self.seed, self.epoch, src.n_docs, self.doc, window)
            lens = src.lengths(ids)
            if self.offset >= lens[0]:
                raise ValueError(
                    f"data state: offset {self.offset} is past the end of document {self.doc} "
                    f"({lens[0]} tokens); the state was saved for other data"
                )
            avail = np.cumsum(lens) - self.offset  # tokens up to the end of each document
            if avail[-1] <= n:
                last, end = len(ids) - 1, int(lens[-1])
            else:
                last = int(np.searchsorted(avail, n, side="left"))
                end = int(lens[last] - (avail[last] - n))
            if out is not None:
                for j in range(last + 1):
                    start = self.offset if j == 0 else 0
                    stop = end if j == last else int(lens[j])
                    out.append(src.read(int(ids[j]), start, stop))
                    if ends is not None:
                        ends.append(stop == int(lens[j]))
            n -= int(avail[last]) - (int(lens[last]) - end)
            if end == lens[last]:
                self.doc, self.offset = self.doc + last + 1, 0
            else:
                self.doc, self.offset = self.doc + last, end
            if self.doc == src.n_docs:  # the epoch is over: the next one, in a new order
                self.epoch, self.doc = self.epoch + 1, 0


class SequentialStream:
    """The token stream of a streamed split, read document by document from its start.

    Moving past tokens means reading (and tokenizing) them: there are no lengths to skip by.
    """

    def __init__(self, source: StreamingDocs) -> None:
        self.source = source
        self.seed = source.seed
        self.epoch = self.doc = self.offset = 0
        self._docs: Iterator[np.ndarray] | None = None
        self._current: np.ndarray | None = None

    def seek(self, epoch: int, doc: int, offset: int) -> None:
        self.epoch, self.doc, self.offset = epoch, doc, offset
        close = getattr(self._docs, "close", None)
        if close is not None:
            close()
        self._docs = self._current = None

    def advance(
        self, n: int, out: list[np.ndarray] | None = None, ends: list[bool] | None = None
    ) -> None:
        while n:
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
            k = min(len(cur) - self.offset, n)
            if out is not None:
                out.append(cur[self.offset : self.offset + k])
                if ends is not None:
                    ends.append(self.offset + k == len(cur))
            self.offset += k
            n -= k
            if self.offset == len(cur):
                self.doc += 1
                self.offset = 0
                self._current = None


Stream = IndexedStream | SequentialStream


def _take(stream: Stream, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The next ``n`` tokens and, for each, whether it is the last of its document (its
    separator): the boundaries come from the source's documents, never from token ids."""
    parts: list[np.ndarray] = []
    ends: list[bool] = []
    stream.advance(n, parts, ends)
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    doc_end = np.zeros(n, dtype=bool)
    last = np.cumsum([len(p) for p in parts]) - 1
    doc_end[last[np.asarray(ends, dtype=bool)]] = True
    return np.concatenate(parts), doc_end


# ----------------------------------------------------------------------------- rows


class _SingleRows:
    """Rows of one stream: sequence i of the run is tokens [i * L, (i + 1) * L)."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def next_rows(
        self, total: int, lo: int, hi: int, row_len: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``[lo, hi)`` of the next ``total`` sequences and their document ends (each
        token: the last of its document?); moves past all ``total``."""
        self.stream.advance(lo * row_len)
        tokens, ends = _take(self.stream, (hi - lo) * row_len)
        self.stream.advance((total - hi) * row_len)
        return tokens.reshape(hi - lo, row_len), ends.reshape(hi - lo, row_len)

    def state(self) -> dict[str, int]:
        s = self.stream
        return {"epoch": s.epoch, "doc": s.doc, "offset": s.offset}

    def load(self, state: dict[str, Any]) -> None:
        if "mix" in state:
            raise DataError(
                f"data.mix: the checkpoint's data state is for a mixture of "
                f"{len(state['mix'])} datasets; this run reads one (data.mix is null)"
            )
        missing = {"epoch", "doc", "offset"} - set(state)
        if missing:
            raise ValueError(f"data state is missing {sorted(missing)}")
        self.stream.seek(int(state["epoch"]), int(state["doc"]), int(state["offset"]))

    def sample_tokens(self, max_tokens: int) -> np.ndarray:
        return self.stream.source.sample_tokens(max_tokens)


class _MixedRows:
    """Each global sequence from one of several streams, drawn from (key, sequence index)."""

    def __init__(self, streams: list[IndexedStream], weights: list[float], key: int | str):
        self.streams = streams
        self.weights = weights
        self.key = key
        self.sequences = 0

    def next_rows(
        self, total: int, lo: int, hi: int, row_len: int
    ) -> tuple[np.ndarray, np.ndarray]:
        picks = weighted_choice(self.key, self.weights, self.sequences, total)
        rows = np.empty((hi - lo, row_len), dtype=np.int64)
        row_ends = np.zeros((hi - lo, row_len), dtype=bool)
        for k, stream in enumerate(self.streams):
            mine = picks[lo:hi] == k
            stream.advance(int((picks[:lo] == k).sum()) * row_len)
            n = int(mine.sum())
            if n:
                tokens, ends = _take(stream, n * row_len)
                rows[mine] = tokens.reshape(n, row_len)
                row_ends[mine] = ends.reshape(n, row_len)
            stream.advance(int((picks[hi:] == k).sum()) * row_len)
        self.sequences += total
        return rows, row_ends

    def state(self) -> dict[str, Any]:
        return {
            "sequences": self.sequences,
            "weights": list(self.weights),
            "mix": [[s.epoch, s.doc, s.offset] for s in self.streams],
        }

    def load(self, state: dict[str, Any]) -> None:
        positions = state.get("mix")
        if positions is None:
            raise DataError(
                f"data.mix: the checkpoint's data state is for one dataset; this run mixes "
                f"{len(self.streams)} (set data.mix as the checkpointed run did)"
            )
        weights = [float(w) for w in state.get("weights", [])]
        if len(positions) != len(self.streams) or weights != self.weights:
            raise DataError(
                f"data.mix: the checkpoint's mixture has weights {weights}, this run "
                f"{self.weights}; resuming would draw other sequences"
            )
        for stream, (epoch, doc, offset) in zip(self.streams, positions, strict=True):
            stream.seek(int(epoch), int(doc), int(offset))
        self.sequences = int(state["sequences"])

    def sample_tokens(self, max_tokens: int) -> np.ndarray:
        total = sum(self.weights)
        parts = [
            s.source.sample_tokens(max(1, int(max_tokens * w / total)))
            for s, w in zip(self.streams, self.weights, strict=True)
        ]
        return np.concatenate(parts)


def _build_rows(cfg: DataConfig, tokenizer: Tokenizer, split: str) -> _SingleRows | _MixedRows:
    seed = cfg.seed if split == "train" else None
    entries = cfg.mix_entries()
    if entries:
        sources = [open_prepared(path, tokenizer, split, "data.mix") for path, _ in entries]
        streams = [IndexedStream(s, seed) for s in sources]
        key: int | str = cfg.seed if split == "train" else "eval"
        return _MixedRows(streams, [w for _, w in entries], key)
    source = build_doc_source(cfg, tokenizer, split)  # type: ignore[arg-type]
    if isinstance(source, StreamingDocs):
        return _SingleRows(SequentialStream(source))
    return _SingleRows(IndexedStream(source, seed))


# ----------------------------------------------------------------------------- batches


class PackedBatches:
    """Packed, layout-independent, resumable batches of one split for one data-parallel rank.

    ``next_step()`` returns this rank's micro-batches of the next optimizer step: a list of
    ``global_batch_size / (dp_size * micro_batch_size)`` dicts with ``input_ids`` and
    ``labels``, LongTensors of shape [micro_batch_size, seq_len], and ``doc_ends``, a bool
    tensor of that shape: True where an input token is the last of its document (its
    separator; the label there is the next document's first token). The boundaries are the
    source's documents (a prepared dataset's index, the documents a stream reads), never
    guessed from token ids. The "train" split is
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
        self._rows = _build_rows(cfg, tokenizer, split)
        self.steps = 0

    @property
    def source(self) -> Any:
        """The tokenized documents (one dataset; None for a mixture)."""
        rows = self._rows
        return rows.stream.source if isinstance(rows, _SingleRows) else None

    @property
    def stream(self) -> Stream | None:
        """The token stream and its position (one dataset; None for a mixture)."""
        return self._rows.stream if isinstance(self._rows, _SingleRows) else None

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches this rank runs per optimizer step (gradient accumulation steps)."""
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    def _next_rows(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        rows = self._rows.next_rows(self.global_batch_size, lo, hi, self.seq_len + 1)
        self.steps += 1
        return rows

    def next_global_batch(self) -> np.ndarray:
        """The step's global batch: [global_batch_size, seq_len + 1] tokens (all ranks')."""
        return self._next_rows(0, self.global_batch_size)[0]

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next optimizer step (reading only its rows)."""
        per_rank = self.global_batch_size // self.dp_size
        lo = self.dp_rank * per_rank
        rows, ends = self._next_rows(lo, lo + per_rank)
        mine = torch.from_numpy(rows.astype(np.int64))
        doc_ends = torch.from_numpy(ends[:, :-1])
        mb = self.micro_batch_size
        return [
            {
                "input_ids": mine[i : i + mb, :-1].contiguous(),
                "labels": mine[i : i + mb, 1:].contiguous(),
                "doc_ends": doc_ends[i : i + mb].contiguous(),
            }
            for i in range(0, per_rank, mb)
        ]

    def __iter__(self) -> Iterator[list[Batch]]:
        return self

    def __next__(self) -> list[Batch]:
        return self.next_step()

    def reset(self) -> None:
        """Rewind to the start of the stream (what evaluation does before each pass)."""
        self.load_state_dict(self._initial_state())

    def _initial_state(self) -> dict[str, Any]:
        rows = self._rows
        base: dict[str, Any] = {"version": _STATE_VERSION, "seed": self.cfg.seed, "steps": 0}
        if isinstance(rows, _MixedRows):
            return {
                **base,
                "sequences": 0,
                "weights": list(rows.weights),
                "mix": [[0, 0, 0]] * len(rows.streams),
            }
        return {**base, "epoch": 0, "doc": 0, "offset": 0}

    def state_dict(self) -> dict[str, Any]:
        """The stream position: plain ints (and, for a mixture, lists of them and the
        weights), the same on every rank and for every layout."""
        return {
            "version": _STATE_VERSION,
            "seed": self.cfg.seed,
            **self._rows.state(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the iterator that saved ``state`` stopped."""
        if "seed" not in state:
            raise ValueError("data state is missing ['seed']")
        if int(state["seed"]) != self.cfg.seed:
            raise DataError(
                f"data.seed: the checkpoint's data order used seed {state['seed']}, "
                f"this run has {self.cfg.seed}; resuming would replay or skip "
                "documents"
            )
        version = int(state.get("version", 1))
        sequential = isinstance(self.stream, SequentialStream)
        # Version 1 ordered map-style documents by a permutation array; a stream's order
        # (the shuffle buffer) is unchanged.
        if version > _STATE_VERSION or (version < _STATE_VERSION and not sequential):
            raise DataError(
                f"data.dataset: the checkpoint's data state is version {version}, this "
                f"moetrain's is {_STATE_VERSION} (another document order); resuming would "
                "replay or skip documents. Start a new train.output_dir"
            )
        self._rows.load(state)
        self.steps = int(state.get("steps", 0))

    def sample_tokens(self, max_tokens: int = 2_000_000) -> np.ndarray:
        """Tokens of this split (a prefix of each dataset's stored order; a mixture gives
        each dataset its weight's share)."""
        return self._rows.sample_tokens(max_tokens)


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

    An eval loss below it means the model uses context. At most ``max_tokens`` tokens are
    read: a prefix of the stored order (of the stream, when streaming; of each dataset, in
    proportion to its weight, for a mixture).
    """
    return token_entropy(_build_rows(cfg, tokenizer, "train").sample_tokens(max_tokens))
