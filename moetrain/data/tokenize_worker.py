"""Tokenizing one shard: the work of a ``prepare-data`` worker process (or of the caller).

Workers are started with ``spawn``, so this module imports only numpy, tokenizers and the
format module: a worker starts in a fraction of a second, without torch or datasets.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from moetrain.data.fast_bpe import tiktoken_encoding, tiktoken_ids, tokenizers_ids
from moetrain.data.prepared import ShardWriter

ENCODE_BATCH = 256
"""Documents per ``encode_batch`` call."""

_worker: ShardTokenizer | None = None


class ShardTokenizer:
    """Writes shards of token ids from lists of texts with one tokenizer."""

    def __init__(
        self,
        tokenizer_json: str,
        eos_id: int,
        dtype: str,
        literal_special_tokens: str = "text",
        engine: str = "tokenizers",
    ) -> None:
        # data.literal_special_tokens: "text" encodes special-token text inside a document as
        # ordinary text; only the EOS appended below separates documents.
        self.literal_special_tokens = literal_special_tokens
        # engine "tiktoken": proven to give the tokenizer's ids (fast_bpe.choose_engine).
        self.tiktoken = tiktoken_encoding(tokenizer_json) if engine == "tiktoken" else None
        self.tok = HFTokenizer.from_str(tokenizer_json)
        self.eos = np.array([eos_id], dtype=dtype)
        self.dtype = dtype

    def write(self, directory: Path, split: str, index: int, texts: list[str]) -> dict[str, Any]:
        """Tokenize ``texts`` (non-empty documents, in order) into shard ``index`` of
        ``split`` in ``directory``; return its manifest entry."""
        writer = ShardWriter(directory, split, index, self.dtype)
        try:
            for i in range(0, len(texts), ENCODE_BATCH):
                batch = texts[i : i + ENCODE_BATCH]
                for ids in self._encode(batch):
                    writer.add(np.concatenate([np.asarray(ids, dtype=self.dtype), self.eos]))
            return writer.close()
        except BaseException:
            writer.abort()
            raise

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if self.tiktoken is not None:
            return tiktoken_ids(self.tiktoken, texts, self.literal_special_tokens)
        return tokenizers_ids(self.tok, texts, self.literal_special_tokens)


def init_worker(
    tokenizer_json: str,
    eos_id: int,
    dtype: str,
    literal_special_tokens: str,
    engine: str,
    parallel: bool,
) -> None:
    """Process-pool initializer: one tokenizer per worker process. ``parallel`` False turns
    off the tokenizer's own threads (the pool already uses the cores)."""
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
    _worker = ShardTokenizer(tokenizer_json, eos_id, dtype, literal_special_tokens, engine)


def write_shard(directory: str, split: str, index: int, texts: list[str]) -> dict[str, Any]:
    """Pool task: ``ShardTokenizer.write`` with this worker's tokenizer."""
    assert _worker is not None, "init_worker was not called"
    return _worker.write(Path(directory), split, index, texts)
