"""The ``data`` section: which dataset, tokenizer and mixture a run reads, and how it is
split and packed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moetrain.config.errors import _fail, _positive


@dataclass
class DataConfig:
    dataset: str = "default"
    """"default" (the embedded corpus), a Hugging Face hub dataset name, local files (a file,
    a directory or a glob of .txt/.json/.jsonl/.parquet files), or a prepared dataset: a
    directory written by ``moetrain prepare-data``, read through memory maps (the keys that
    say what to read and how to split it were applied when it was prepared)."""
    dataset_config: str | None = None
    """Hub dataset configuration name (the second argument of ``load_dataset``)."""
    format: Literal["text", "json", "parquet"] | None = None
    """Format of local files. null: inferred from the file extension."""
    split: str = "train"
    """Split to train on."""
    eval_split: str | None = None
    """Split for the held-out eval loss. null: the default corpus's own eval split; for any
    other dataset, ``eval_fraction`` of ``split``'s documents, held out by index (training
    then skips them)."""
    eval_fraction: float = 0.02
    """Fraction of ``split``'s documents held out for eval when ``eval_split`` is null (unused
    with the default corpus, which has its own eval split)."""
    text_column: str = "text"
    """Column holding the text."""
    domain_column: str | None = None
    """Column naming each document's domain (e.g. "web", "code"), for the expert-
    specialization view: each expert's share of every domain's eval tokens. null: "domain"
    for the embedded corpus (prose and code), none for other datasets. Not available with
    prepared datasets, mixtures or streaming (their documents keep only the text)."""
    streaming: bool = False
    """Stream the dataset instead of downloading/materialising it. Every rank reads and
    tokenizes the whole stream (in a background thread); for large corpora use
    ``moetrain prepare-data`` instead. Not used for prepared datasets."""
    trust_remote_code: bool = False
    """Allow a hub dataset to run its own loading script. Off: nothing loaded runs code."""
    tokenizer: str = "default"
    """"default" (byte-level BPE trained once on the embedded corpus and cached), a
    tokenizer.json file, or a local Hugging Face tokenizer folder."""
    seq_len: int = 256
    """Tokens per packed training sequence."""
    literal_special_tokens: Literal["text", "special"] = "text"
    """How the text of a special token inside a document (such as "<|endoftext|>") is
    encoded: "text", as the ordinary text it is (its characters' tokens), so that only the
    separator moetrain appends after each document carries the end-of-text id; "special",
    as the special token's id (moetrain's earlier behaviour, and what a tokenizer's plain
    encode does: such text then reads as a document boundary)."""
    seed: int = 0
    """Seed of the document shuffle; the data order depends on it alone."""
    cache_dir: str | None = None
    """Where the default corpus, tokenizer and token caches live. null: ~/.cache/moetrain."""
    mix: str | None = None
    """Train on several prepared datasets (``moetrain prepare-data`` directories) mixed by
    weight: "DIR:WEIGHT,DIR:WEIGHT,...". Each training sequence comes from one of them, drawn
    with probability weight / sum of weights from (``seed``, sequence index); eval mixes their
    eval splits the same way. null: train on ``dataset`` (which must then stay "default")."""

    def mix_entries(self) -> list[tuple[str, float]]:
        """``mix`` parsed: [(directory, weight), ...]; empty when ``mix`` is null."""
        if self.mix is None:
            return []
        entries = []
        for item in self.mix.split(","):
            path, sep, weight = item.strip().rpartition(":")
            try:
                value = float(weight)
            except ValueError:
                value = math.nan
            if not sep or not path or not (value > 0 and math.isfinite(value)):
                _fail("data.mix", f"{item.strip()!r} is not DIR:WEIGHT with a weight > 0; "
                      "write e.g. 'data/web:0.7,data/code:0.3'")
            entries.append((path, value))
        return entries

    def validate(self) -> None:
        _positive("data", self, "seq_len")
        if not self.dataset:
            _fail("data.dataset", "must be 'default', a hub dataset name or a local path")
        if self.mix is not None:
            entries = self.mix_entries()
            paths = [p for p, _ in entries]
            dup = next((p for p in paths if paths.count(p) > 1), None)
            if dup is not None:
                _fail("data.mix", f"{dup!r} is listed twice; give each dataset one weight")
            missing = next((p for p in paths if not Path(p).expanduser().is_dir()), None)
            if missing is not None:
                _fail("data.mix", f"{missing!r} is not a directory; list prepared datasets "
                      "(made by `moetrain prepare-data`)")
            if self.dataset != "default":
                _fail("data.mix", f"set, and data.dataset={self.dataset!r} too: the mixture "
                      "replaces data.dataset; leave data.dataset unset")
        if not 0 < self.eval_fraction < 1:
            _fail("data.eval_fraction", f"must be in (0, 1), got {self.eval_fraction}")
        if not self.text_column:
            _fail("data.text_column", "must be a non-empty column name")
        if self.domain_column is not None:
            if not self.domain_column:
                _fail("data.domain_column", "must be a non-empty column name or null")
            if self.mix is not None or self.streaming:
                _fail("data.domain_column", "needs a map-style dataset: not available with "
                      "data.mix or data.streaming (their documents keep only the text)")
        tok = self.tokenizer
        if tok != "default" and not Path(tok).expanduser().exists():
            _fail("data.tokenizer", f"{tok!r} does not exist; use 'default', a tokenizer.json "
                  "file or a local Hugging Face tokenizer folder")
