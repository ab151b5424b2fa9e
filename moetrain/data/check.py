"""``check_data``: every data error, raised before any model or process group is built."""

from __future__ import annotations

from moetrain.config import DataConfig
from moetrain.data.dataset import load_split
from moetrain.data.tokenizer import load_tokenizer


def check_data(cfg: DataConfig) -> None:
    """Raise ``DataError`` (naming the key) if training on ``cfg`` would fail for its data.

    Loads the tokenizer and both splits, and checks the path, splits, text column, row types
    and that there is text. The default corpus and tokenizer are built here on first use.
    """
    load_tokenizer(cfg.tokenizer, cfg.cache_dir)
    for role in ("train", "eval"):
        load_split(cfg, role)
