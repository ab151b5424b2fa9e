"""Every way a dataset can be unusable raises DataError naming the key, from check_data."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moetrain.data import DataError, PackedBatches, check_data

Setup = Callable[[Path, SimpleNamespace], dict[str, Any]]


def _jsonl(rows: list[dict], **extra: Any) -> Setup:
    def setup(tmp: Path, h: SimpleNamespace) -> dict[str, Any]:
        return {"dataset": str(h.write_jsonl(tmp / "d.jsonl", rows)), **extra}

    return setup


def _ok_jsonl(**extra: Any) -> Setup:
    def setup(tmp: Path, h: SimpleNamespace) -> dict[str, Any]:
        rows = [{"text": t, "title": "t"} for t in h.make_docs(10)]
        return {"dataset": str(h.write_jsonl(tmp / "d.jsonl", rows)), **extra}

    return setup


def _dir(files: dict[str, str]) -> Setup:
    def setup(tmp: Path, h: SimpleNamespace) -> dict[str, Any]:
        root = tmp / "data"
        root.mkdir()
        for name, content in files.items():
            (root / name).write_text(content)
        return {"dataset": str(root)}

    return setup


def _parquet_ints(tmp: Path, h: SimpleNamespace) -> dict[str, Any]:
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp / "d.parquet")
    return {"dataset": str(tmp / "d.parquet")}


def _bad_tokenizer(tmp: Path, h: SimpleNamespace) -> dict[str, Any]:
    (tmp / "tok.json").write_text("{not json")
    return {"tokenizer": str(tmp / "tok.json")}


def _csv(tmp: Path, h: SimpleNamespace) -> dict[str, Any]:
    (tmp / "d.csv").write_text("text\nhello\n")
    return {"dataset": str(tmp / "d.csv")}


ONE = '{"text": "one document"}\n'

# (id, setup(tmp_path) -> DataConfig overrides, key the message starts with, a phrase in it)
CASES = [
    (
        "path-missing",
        lambda t, h: {"dataset": str(t / "nope" / "d.jsonl")},
        "data.dataset",
        "does not exist",
    ),
    (
        "relative-path-missing",
        lambda t, h: {"dataset": "./no/such/dir"},
        "data.dataset",
        "does not exist",
    ),
    (
        "glob-no-match",
        lambda t, h: {"dataset": str(t / "*.jsonl")},
        "data.dataset",
        "no files match",
    ),
    ("dir-without-data", _dir({"README.md": "hi"}), "data.dataset", "holds no"),
    (
        "hub-offline",
        lambda t, h: {"dataset": "no-such-owner/no-such-dataset"},
        "data.dataset",
        "not found or unreachable",
    ),
    ("corrupt-json", _dir({"d.jsonl": '{"text": "a"\n'}), "data.dataset", "cannot read"),
    ("empty-file", _dir({"d.jsonl": ""}), "data.dataset", "empty"),
    ("all-rows-empty", _jsonl([{"text": ""}, {"text": ""}]), "data.dataset", "empty"),
    ("split-missing", _ok_jsonl(split="validation"), "data.split", "has train"),
    ("eval-split-missing", _ok_jsonl(eval_split="test"), "data.eval_split", "has train"),
    (
        "default-eval-split-missing",
        lambda t, h: {"eval_split": "test"},
        "data.eval_split",
        "has eval, train",
    ),
    ("column-missing", _ok_jsonl(text_column="body"), "data.text_column", "are text, title"),
    ("rows-are-ints", _jsonl([{"text": 1}, {"text": 2}]), "data.text_column", "not strings"),
    ("rows-mixed", _jsonl([{"text": "a"}, {"text": 2}]), "data.text_column", "not strings"),
    ("rows-null", _jsonl([{"text": "a"}, {"text": None}]), "data.text_column", "null"),
    ("parquet-ints", _parquet_ints, "data.text_column", "not strings"),
    (
        "stream-column-missing",
        _ok_jsonl(text_column="body", streaming=True),
        "data.text_column",
        "are text, title",
    ),
    ("stream-rows-ints", _jsonl([{"text": 3}], streaming=True), "data.text_column", "not a string"),
    (
        "stream-split-missing",
        _ok_jsonl(split="validation", streaming=True),
        "data.split",
        "has train",
    ),
    ("unknown-extension", _csv, "data.format", "cannot infer"),
    ("mixed-formats", _dir({"a.jsonl": ONE, "b.txt": "hello\n"}), "data.format", "mixes"),
    ("one-document-no-holdout", _jsonl([{"text": "only one"}]), "data.eval_fraction", "too few"),
    (
        "trust-remote-code",
        lambda t, h: {"dataset": "owner/scripted", "trust_remote_code": True},
        "data.trust_remote_code",
        "loading scripts",
    ),
    ("tokenizer-corrupt", _bad_tokenizer, "data.tokenizer", "not a valid tokenizer.json"),
]


@pytest.mark.parametrize("setup,key,phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check_data_raises_data_error_naming_the_key(
    tmp_path, data_cfg, helpers, setup, key, phrase
):
    cfg = data_cfg(**setup(tmp_path, helpers))
    with pytest.raises(DataError) as info:
        check_data(cfg)
    message = str(info.value)
    assert message.startswith(f"{key}: "), message
    assert phrase in message, message
    assert isinstance(info.value, ValueError)


def test_streaming_bad_row_after_the_checked_prefix_fails_clearly(
    tmp_path, data_cfg, helpers, tokenizer
):
    rows = [{"text": t} for t in helpers.make_docs(100)] + [{"text": 7}]
    cfg = data_cfg(
        dataset=str(helpers.write_jsonl(tmp_path / "d.jsonl", rows)), streaming=True, seq_len=64
    )
    check_data(cfg)  # the first rows are fine
    batches = PackedBatches(cfg, tokenizer, "train", 4, 4)
    with pytest.raises(DataError, match=r"^data\.text_column: .* int 7, not a string"):
        for _ in range(1000):
            batches.next_step()


def test_batch_sizes_that_do_not_divide(data_cfg, tokenizer):
    with pytest.raises(DataError, match=r"^train\.global_batch_size: "):
        PackedBatches(
            data_cfg(),
            tokenizer,
            "train",
            global_batch_size=6,
            micro_batch_size=2,
            dp_rank=0,
            dp_size=2,
        )
    with pytest.raises(ValueError, match="dp_rank"):
        PackedBatches(data_cfg(), tokenizer, "train", 4, 2, dp_rank=2, dp_size=2)
