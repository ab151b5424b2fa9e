"""Data: Hugging Face datasets -> tokens -> packed, per-DP-rank, resumable batches.

Public API::

    check_data(cfg)                      # every data error, before training
    load_tokenizer(spec, cache_dir)      # "default" BPE, tokenizer.json or HF folder
    PackedBatches(cfg, tokenizer, split, global_batch_size, micro_batch_size,
                  dp_rank=0, dp_size=1)  # .next_step(), .reset(), .state_dict() ...
    unigram_entropy(tokenizer, cfg)      # nats/token of the training tokens

docs/data.md describes the default corpus, local/hub data, packing order and resume.
"""

from moetrain.data.check import check_data
from moetrain.data.corpus import corpus_files
from moetrain.data.dataset import Source, load_local_files, load_split, resolve_source
from moetrain.data.errors import DataError
from moetrain.data.packing import (
    PackedBatches,
    build_doc_source,
    token_entropy,
    unigram_entropy,
)
from moetrain.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "DataError",
    "PackedBatches",
    "Source",
    "Tokenizer",
    "build_doc_source",
    "check_data",
    "corpus_files",
    "load_local_files",
    "load_split",
    "load_tokenizer",
    "resolve_source",
    "token_entropy",
    "unigram_entropy",
]
