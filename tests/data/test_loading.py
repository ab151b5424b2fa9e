"""Local files in every format, folders with splits, globs, held-out eval, and streaming."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from moetrain.data import PackedBatches, check_data, load_split, resolve_source
from moetrain.data.dataset import is_held_out
from moetrain.data.sources import StreamingDocs


def _texts(ds) -> list[str]:
    return [row["text"] for row in ds]


def _flat(batches: PackedBatches, steps: int) -> torch.Tensor:
    rows = []
    for _ in range(steps):
        for b in batches.next_step():
            rows.append(torch.cat([b["input_ids"], b["labels"][:, -1:]], 1))
    return torch.cat(rows)


@pytest.fixture
def one_line_docs(docs: list[str]) -> list[str]:
    return [d.replace("\n", " ") for d in docs]  # a .txt file holds one document per line


@pytest.fixture
def three_formats(tmp_path: Path, one_line_docs: list[str], helpers) -> dict[str, Path]:
    txt = tmp_path / "d.txt"
    txt.write_text("\n".join(one_line_docs) + "\n")
    jsonl = helpers.write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in one_line_docs])
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": one_line_docs, "n": list(range(len(one_line_docs)))}), parquet)
    return {"text": txt, "json": jsonl, "parquet": parquet}


def test_text_json_parquet_load_the_same_documents(
    data_cfg, tokenizer, three_formats, one_line_docs
):
    streams = {}
    for fmt, path in three_formats.items():
        cfg = data_cfg(dataset=str(path), seq_len=32)
        assert resolve_source(cfg).builder == fmt
        check_data(cfg)
        train, held = _texts(load_split(cfg, "train")), _texts(load_split(cfg, "eval"))
        held_idx = [i for i in range(len(one_line_docs)) if is_held_out(i, cfg.eval_fraction)]
        assert held == [one_line_docs[i] for i in held_idx]
        assert sorted(train + held) == sorted(one_line_docs)
        streams[fmt] = _flat(PackedBatches(cfg, tokenizer, "train", 4, 2), 3)
    assert torch.equal(streams["text"], streams["json"])
    assert torch.equal(streams["json"], streams["parquet"])


def test_packed_local_text_decodes_to_the_documents(data_cfg, tokenizer, jsonl_file, docs):
    cfg = data_cfg(dataset=str(jsonl_file), seq_len=128)
    tokens = _flat(PackedBatches(cfg, tokenizer, "train", 2, 2), 4).flatten().tolist()
    pieces = tokenizer.decode(tokens).split("<|endoftext|>")
    whole = pieces[1:-1]  # the first and last pieces are cut by the window
    assert whole and all(p in docs for p in whole)


def test_folder_splits_glob_and_format_override(tmp_path: Path, data_cfg, helpers):
    root = tmp_path / "corpus"
    helpers.write_jsonl(root / "train-00.jsonl", [{"text": t} for t in helpers.make_docs(5, "a")])
    helpers.write_jsonl(root / "train-01.jsonl", [{"text": t} for t in helpers.make_docs(5, "b")])
    helpers.write_jsonl(root / "valid" / "x.jsonl", [{"text": "held out"}])
    cfg = data_cfg(dataset=str(root), eval_split="validation")
    assert sorted(resolve_source(cfg).files) == ["train", "validation"]
    assert len(load_split(cfg, "train")) == 10
    assert _texts(load_split(cfg, "eval")) == ["held out"]
    glob_cfg = data_cfg(dataset=str(root / "train-*.jsonl"))
    assert len(resolve_source(glob_cfg).files["train"]) == 2
    odd = tmp_path / "rows.data"
    odd.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n')
    assert resolve_source(data_cfg(dataset=str(odd), format="json")).builder == "json"
    odd_cfg = data_cfg(dataset=str(odd), format="json", eval_fraction=0.3)
    assert _texts(load_split(odd_cfg, "train")) == ["b"]  # frac(i * 0.618) < 0.3 for i = 0, 2
    assert _texts(load_split(odd_cfg, "eval")) == ["a", "c"]


def test_streaming_reads_the_same_held_out_documents(data_cfg, jsonl_file):
    plain = data_cfg(dataset=str(jsonl_file))
    streamed = data_cfg(dataset=str(jsonl_file), streaming=True)
    for role in ("train", "eval"):
        assert _texts(load_split(streamed, role)) == _texts(load_split(plain, role))


def test_streaming_default_corpus_evaluates_on_the_same_sequences(data_cfg, tokenizer):
    first = next(iter(load_split(data_cfg(streaming=True), "eval")))
    assert first["domain"] in ("prose", "code") and first["text"]
    # Eval reads stored order in both modes, so the sequences are the same.
    batches = [
        _flat(PackedBatches(data_cfg(streaming=s, seq_len=64), tokenizer, "eval", 8, 4), 2)
        for s in (False, True)
    ]
    assert torch.equal(*batches)


def test_shuffle_buffer_is_a_seeded_permutation_per_epoch(data_cfg, tokenizer, jsonl_file, docs):
    ds = load_split(data_cfg(dataset=str(jsonl_file), eval_split="train", streaming=True), "train")
    decode = lambda arr: tokenizer.decode(arr[:-1].tolist())  # noqa: E731 - drop the EOS
    orders = {}
    for seed, epoch in [(0, 0), (0, 1), (1, 0)]:
        source = StreamingDocs(ds, tokenizer, "text", seed, buffer_size=16)
        orders[seed, epoch] = [decode(d) for d in source.docs(epoch, 0)]
        assert sorted(orders[seed, epoch]) == sorted(docs)  # every document once per epoch
        assert [decode(d) for d in source.docs(epoch, 7)] == orders[seed, epoch][7:]
    assert orders[0, 0] != orders[0, 1] and orders[0, 0] != orders[1, 0]
    assert orders[0, 0] != docs


def test_streaming_batches_determinism_layout_and_resume(data_cfg, tokenizer, jsonl_file):
    cfg = data_cfg(dataset=str(jsonl_file), streaming=True, seq_len=32, seed=4)
    full = _flat(PackedBatches(cfg, tokenizer, "train", 4, 2), 12)
    assert torch.equal(_flat(PackedBatches(cfg, tokenizer, "train", 4, 2), 12), full)
    other = data_cfg(dataset=str(jsonl_file), streaming=True, seq_len=32, seed=5)
    assert not torch.equal(_flat(PackedBatches(other, tokenizer, "train", 4, 2), 12), full)
    ranks = [PackedBatches(cfg, tokenizer, "train", 4, 1, r, 2) for r in range(2)]
    per_rank = [_flat(r, 12).view(12, 2, -1) for r in ranks]
    assert torch.equal(torch.cat(per_rank, 1).flatten(0, 1), full)
    # 12 steps x 4 x 33 tokens cross the epoch boundary of this small split (~4k tokens).
    first = PackedBatches(cfg, tokenizer, "train", 4, 2)
    _flat(first, 7)
    fresh = PackedBatches(cfg, tokenizer, "train", 4, 2)
    fresh.load_state_dict(first.state_dict())
    assert torch.equal(_flat(fresh, 5), full[7 * 4 :])


def test_streaming_and_map_style_read_the_same_tokens(data_cfg, tokenizer, jsonl_file):
    counts = {}
    for streaming in (False, True):
        cfg = data_cfg(dataset=str(jsonl_file), streaming=streaming, seq_len=32)
        tokens = PackedBatches(cfg, tokenizer, "train", 4, 2).sample_tokens()
        counts[streaming] = np.bincount(tokens, minlength=tokenizer.vocab_size)
    np.testing.assert_array_equal(counts[False], counts[True])


def test_streaming_tokenizes_in_a_background_thread_without_changing_the_batches(
    data_cfg, tokenizer, jsonl_file
):
    import threading
    import time

    from moetrain.data.packing import SequentialStream

    ds = load_split(data_cfg(dataset=str(jsonl_file), streaming=True), "train")
    inline = StreamingDocs(ds, tokenizer, "text", seed=3, buffer_size=16, prefetch=0)
    ahead = StreamingDocs(ds, tokenizer, "text", seed=3, buffer_size=16, prefetch=8)
    docs = ahead.docs(0, 5)
    first = next(docs)
    assert any(t.name == "moetrain-tokenize" for t in threading.enumerate())
    want = list(inline.docs(0, 5))
    got = [first, *docs]
    assert len(got) == len(want)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    # Seeking drops the old reader: its thread stops instead of piling up.
    stream = SequentialStream(ahead)
    for epoch in range(20):
        stream.seek(epoch, 3, 0)
        stream.advance(50)
    stream.seek(0, 0, 0)
    deadline = time.monotonic() + 5
    alive = [1]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [t for t in threading.enumerate() if t.name == "moetrain-tokenize"]
    assert not alive


def test_a_hub_dataset_config_is_handed_to_load_dataset(monkeypatch, data_cfg) -> None:
    """``data.dataset_config`` names one of a hub dataset's configurations; only the hub
    resolves it (no network here), so what is checked is that datasets.load_dataset gets it
    unchanged, with the split and the streaming flag."""
    import datasets

    from moetrain.data import dataset as ds

    seen = {}

    def load_dataset(path, name=None, **kwargs):
        seen.update(path=path, name=name, **kwargs)
        return datasets.Dataset.from_dict({"text": ["one document"]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = data_cfg(dataset="someone/corpus", dataset_config="en")
    ds._load_hub("someone/corpus", "train", "data.dataset", cfg)
    assert seen == {"path": "someone/corpus", "name": "en", "split": "train", "streaming": False}
