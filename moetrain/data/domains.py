"""The data domain of every eval token, for the expert-specialization view.

Evaluation reads the eval split as one token stream in stored order (each document followed
by EOS, epoch after epoch in the same order: ``moetrain.data.packing``), cut into sequences
of ``seq_len + 1`` tokens. The domain of input token j of eval sequence i is the domain of
the document that stream position ``i * (seq_len + 1) + j`` falls in. Document domains come
from ``data.domain_column``: the embedded corpus has one (``domain``: prose or code), other
datasets name theirs. Prepared datasets, mixtures and streams keep only the text.
"""

from __future__ import annotations

import numpy as np

from moetrain.config import DataConfig
from moetrain.data.dataset import check_text, load_split
from moetrain.data.errors import DataError
from moetrain.data.packing import PackedBatches
from moetrain.data.prepared import is_prepared
from moetrain.data.tokenizer import Tokenizer

DEFAULT_CORPUS_COLUMN = "domain"
"""The embedded corpus's domain column (``moetrain.data.corpus``: "prose" or "code")."""


def domain_column(cfg: DataConfig) -> str | None:
    """The column naming each document's domain, or None when the data has none."""
    if cfg.domain_column is not None:
        return cfg.domain_column
    if cfg.dataset == "default" and cfg.mix is None and not cfg.streaming:
        return DEFAULT_CORPUS_COLUMN
    return None


def check_domain_column(cfg: DataConfig) -> None:
    """Raise ``DataError`` naming ``data.domain_column`` if it cannot be read."""
    if cfg.domain_column is None:
        return
    if is_prepared(cfg.dataset):
        raise DataError(f"data.domain_column: {cfg.dataset!r} is a prepared dataset; it keeps "
                        "only the tokens of the text (unset data.domain_column)")
    ds = load_split(cfg, "eval")
    if cfg.domain_column not in ds.column_names:
        raise DataError(f"data.domain_column: the eval split has no column "
                        f"{cfg.domain_column!r}; its columns are {', '.join(ds.column_names)}")


def document_domains(cfg: DataConfig) -> list[str] | None:
    """The domain of each document of the eval split in stored order (documents with empty
    text are not in the token stream and are left out), or None without a domain column."""
    column = domain_column(cfg)
    if column is None:
        return None
    ds = load_split(cfg, "eval")
    texts, labels = ds[cfg.text_column], ds[column]
    return [str(d) for t, d in zip(texts, labels, strict=True) if check_text(t, cfg.text_column)]


def eval_token_domains(
    cfg: DataConfig, tokenizer: Tokenizer, n_sequences: int
) -> tuple[list[str], np.ndarray] | None:
    """(domain names, int (n_sequences, seq_len) index into them) for the input tokens of the
    first ``n_sequences`` eval sequences, or None when the data has no domain column."""
    docs = document_domains(cfg)
    if docs is None:
        return None
    source = PackedBatches(cfg, tokenizer, "eval", 1, 1).source
    if source is None or source.n_docs != len(docs):
        raise DataError(f"data.domain_column: {len(docs)} documents have a domain, the eval "
                        "token stream holds "
                        f"{'another number' if source is None else source.n_docs}")
    names = sorted(set(docs))
    doc_domain = np.array([names.index(d) for d in docs], dtype=np.int64)
    ends = np.cumsum(source.lengths(np.arange(source.n_docs)))
    L = cfg.seq_len
    pos = np.arange(n_sequences)[:, None] * (L + 1) + np.arange(L)[None, :]
    doc = np.searchsorted(ends, pos % ends[-1], side="right")  # every epoch: the same order
    return names, doc_domain[doc]
