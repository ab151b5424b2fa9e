"""Document boundaries in every batch, from every data path, and literal special tokens.

- ``doc_ends`` marks exactly the last token of every document (its separator), taken from the
  source's documents: map-style (the token cache), streaming, a prepared dataset and a
  mixture give the same boundaries for the same documents, and a document whose text spells
  the end-of-text token is one document, not two.
- Text that spells a special token is ordinary text by default (``data.literal_special_tokens:
  text``); "special" keeps the earlier encoding (the special id).
- The prepared format records the encoding (format 2); a format-1 dataset still trains, and
  ``model.document_mask`` is refused on it with the reason.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moetrain.data import DataError, PackedBatches, check_data, prepare_dataset
from moetrain.data.prepared import read_manifest, write_json_atomic

SEQ = 24
EOT = "<|endoftext|>"


def _docs(n: int) -> list[str]:
    words = "expert router token capacity balance shard stream packing epoch rank".split()
    out = []
    for i in range(n):
        text = " ".join(words[(i * 3 + j) % len(words)] for j in range(2 + (i * 7) % 11))
        if i % 9 == 4:  # some documents spell the end-of-text token in their text
            text = f"{text} {EOT} {words[i % len(words)]}"
        out.append(f"doc {i}: {text}.")
    return out


def _boundaries(data: PackedBatches, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, ends = [], []
    for _ in range(steps):
        for b in data.next_step():
            ids.append(b["input_ids"])
            ends.append(b["doc_ends"])
    return torch.cat(ids), torch.cat(ends)


def _expected_ends(tokenizer, docs: list[str], n_tokens: int) -> np.ndarray:
    """The stream in stored order, document by document, epoch after epoch: where each
    document ends."""
    one_epoch: list[bool] = []
    for ids in tokenizer.encode_batch(docs):
        one_epoch += [False] * len(ids) + [True]
    return np.resize(np.array(one_epoch), n_tokens)


def test_every_path_marks_the_same_document_ends(tmp_path, data_cfg, tokenizer) -> None:
    docs = _docs(200)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    base = {"dataset": str(path), "seq_len": SEQ, "eval_split": None, "eval_fraction": 0.02}
    runs = {}
    # Stored order (eval split: no shuffle) so that the stream is known up front.
    for name, kw in {"map-style": {}, "streaming": {"streaming": True}}.items():
        data = PackedBatches(data_cfg(**base, **kw), tokenizer, "eval", 4, 2)
        runs[name] = _boundaries(data, 3)
    prepared = tmp_path / "prepared"
    prepare_dataset(data_cfg(**base), prepared, workers=0, progress=False)
    runs["prepared"] = _boundaries(
        PackedBatches(data_cfg(dataset=str(prepared), seq_len=SEQ), tokenizer, "eval", 4, 2), 3
    )
    mix = data_cfg(mix=f"{prepared}:1.0", seq_len=SEQ)
    runs["mixture"] = _boundaries(PackedBatches(mix, tokenizer, "eval", 4, 2), 3)

    ids, ends = runs["map-style"]
    for name, (other_ids, other_ends) in runs.items():
        assert torch.equal(other_ids, ids) and torch.equal(other_ends, ends), name
    # Against the documents themselves: rows of SEQ + 1 tokens, inputs their first SEQ.
    held_out = [t for i, t in enumerate(docs) if (i * 0.6180339887498949) % 1.0 < 0.02]
    want = _expected_ends(tokenizer, held_out, len(ids) * (SEQ + 1)).reshape(-1, SEQ + 1)
    assert np.array_equal(ends.numpy(), want[:, :SEQ])
    assert int(ends.sum()) >= 4
    # A separator is the end-of-text id, and the literal text never became one.
    assert bool((ids[ends] == tokenizer.eos_id).all())
    assert int((ids == tokenizer.eos_id).sum()) == int(ends.sum())


def test_literal_special_tokens_are_text_unless_asked(tokenizer) -> None:
    text = f"before {EOT} after"
    as_text = tokenizer.encode_batch([text])[0]
    assert tokenizer.eos_id not in as_text
    assert tokenizer.decode(as_text) == text
    special = tokenizer.encode_batch([text], "special")[0]
    assert special.count(tokenizer.eos_id) == 1
    assert tokenizer.decode(special) == text


def test_prepared_format_records_the_encoding_and_format_1_refuses_the_mask(
    tmp_path, data_cfg, tokenizer
) -> None:
    path = tmp_path / "docs.jsonl"
    docs = _docs(60)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    new = tmp_path / "new"
    prepare_dataset(data_cfg(dataset=str(path), seq_len=SEQ), new, workers=0, progress=False)
    manifest = read_manifest(new)
    assert manifest.data["format_version"] == 2 and manifest.literal_special_tokens == "text"
    check_data(data_cfg(dataset=str(new), seq_len=SEQ), document_mask=True)

    # The same dataset as an earlier moetrain wrote it: format 1, no encoding recorded.
    old = tmp_path / "old"
    prepare_dataset(data_cfg(dataset=str(path), seq_len=SEQ, literal_special_tokens="special"),
                    old, workers=0, progress=False)  # fmt: skip
    data = json.loads((old / "manifest.json").read_text())
    data["format_version"] = 1
    del data["literal_special_tokens"]
    write_json_atomic(old / "manifest.json", data)
    cfg = data_cfg(dataset=str(old), seq_len=SEQ)
    check_data(cfg)  # still trains without the mask
    ids, ends = _boundaries(PackedBatches(cfg, tokenizer, "train", 4, 2), 2)
    assert int((ids == tokenizer.eos_id).sum()) > int(ends.sum())  # separators inside text
    with pytest.raises(DataError, match="format 1.*model.document_mask"):
        check_data(cfg, document_mask=True)
