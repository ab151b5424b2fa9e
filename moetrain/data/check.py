"""``check_data``: every data error, raised before any model or process group is built."""

from __future__ import annotations

from moetrain.config import DataConfig
from moetrain.data.dataset import load_split
from moetrain.data.domains import check_domain_column
from moetrain.data.errors import DataError
from moetrain.data.prepared import is_prepared
from moetrain.data.sources import token_cache
from moetrain.data.tokenizer import Tokenizer, load_tokenizer
from moetrain.data.verify import check_prepared


def check_data(cfg: DataConfig, document_mask: bool = False) -> None:
    """Raise ``DataError`` (naming the key) if training on ``cfg`` would fail for its data.

    Loads the tokenizer. A prepared dataset (or each one of ``data.mix``) is checked through
    its manifest: format version, tokenizer, every shard present with its size, and the
    checksums of shards this machine has not verified since they were written (see
    docs/data.md); nothing else is read, so this takes about a second at any size. Other
    data: both splits are loaded, and the path, splits, text column, row types and that
    there is text are checked, and ``data.domain_column`` when it is set. The default corpus
    and tokenizer are built here on first use. Once both splits of the default corpus or of
    local files are in the token cache for this tokenizer (they were checked when it was
    written; see ``token_cache``), nothing is loaded.

    ``document_mask`` (``model.document_mask``): a prepared dataset of format 1 is refused,
    since it encoded special-token text inside documents as special tokens.
    """
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.cache_dir)
    check_domain_column(cfg)
    prepared = [(path, "data.mix") for path, _ in cfg.mix_entries()]
    if not prepared and is_prepared(cfg.dataset):
        prepared = [(cfg.dataset, "data.dataset")]
    for path, key in prepared:
        manifest = check_prepared(
            path, tokenizer.fingerprint, tokenizer.eos_id, tokenizer.source, cfg.cache_dir, key
        )
        if document_mask and manifest.literal_special_tokens is None:
            raise DataError(
                f"{key}: {path!r} was prepared by an earlier moetrain (format 1), which "
                "encoded special-token text inside documents (such as '<|endoftext|>') as "
                "the separator id: its documents may hold separators that end nothing, "
                "while model.document_mask=true takes the separator for a document's end; "
                "prepare it again with `moetrain prepare-data` (or set "
                "model.document_mask=false)"
            )
    if prepared or _tokenized(cfg, tokenizer):
        return
    for role in ("train", "eval"):
        load_split(cfg, role)


def _tokenized(cfg: DataConfig, tokenizer: Tokenizer) -> bool:
    """Whether both splits are in the token cache for ``tokenizer``: they were loaded and
    checked (``load_split``) when it was written, so a run that reads them needs neither
    ``datasets`` nor the text again."""
    if cfg.streaming:
        return False
    paths = [token_cache(cfg, tokenizer, role) for role in ("train", "eval")]
    return all(path is not None and is_prepared(path) for path in paths)
