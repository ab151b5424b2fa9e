"""Data: Hugging Face datasets -> tokens (once, into memory-mapped shards) -> packed,
per-DP-rank, resumable batches.

Public API::

    check_data(cfg)                      # every data error, before training
    load_tokenizer(spec, cache_dir)      # "default" BPE, tokenizer.json or HF folder
    PackedBatches(cfg, tokenizer, split, global_batch_size, micro_batch_size,
                  dp_rank=0, dp_size=1)  # .next_step(), .reset(), .state_dict() ...
    unigram_entropy(tokenizer, cfg)      # nats/token of the training tokens
    eval_token_domains(cfg, tokenizer, n) # the data domain of each eval token (or None)
    prepare_dataset(cfg, out, workers)   # what `moetrain prepare-data` runs

docs/data.md describes the default corpus, local/hub data, prepared datasets, mixtures,
packing order and resume.

Names are imported on first use (PEP 562): the tokenizing worker processes of
``prepare-data`` import ``moetrain.data.tokenize_worker`` without paying for torch and
``datasets``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "DataError": "moetrain.data.errors",
    "PackedBatches": "moetrain.data.packing",
    "Source": "moetrain.data.dataset",
    "Tokenizer": "moetrain.data.tokenizer",
    "build_doc_source": "moetrain.data.sources",
    "check_data": "moetrain.data.check",
    "corpus_files": "moetrain.data.corpus",
    "eval_token_domains": "moetrain.data.domains",
    "is_prepared": "moetrain.data.prepared",
    "load_local_files": "moetrain.data.dataset",
    "load_split": "moetrain.data.dataset",
    "load_tokenizer": "moetrain.data.tokenizer",
    "prepare_dataset": "moetrain.data.prepare",
    "resolve_source": "moetrain.data.dataset",
    "token_entropy": "moetrain.data.packing",
    "unigram_entropy": "moetrain.data.packing",
    "verify_dataset": "moetrain.data.prepare",
}

__all__ = [
    "DataError",
    "PackedBatches",
    "Source",
    "Tokenizer",
    "build_doc_source",
    "check_data",
    "corpus_files",
    "eval_token_domains",
    "is_prepared",
    "load_local_files",
    "load_split",
    "load_tokenizer",
    "prepare_dataset",
    "resolve_source",
    "token_entropy",
    "unigram_entropy",
    "verify_dataset",
]

if TYPE_CHECKING:
    from moetrain.data.check import check_data
    from moetrain.data.corpus import corpus_files
    from moetrain.data.dataset import Source, load_local_files, load_split, resolve_source
    from moetrain.data.domains import eval_token_domains
    from moetrain.data.errors import DataError
    from moetrain.data.packing import PackedBatches, token_entropy, unigram_entropy
    from moetrain.data.prepare import prepare_dataset, verify_dataset
    from moetrain.data.prepared import is_prepared
    from moetrain.data.sources import build_doc_source
    from moetrain.data.tokenizer import Tokenizer, load_tokenizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moetrain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
