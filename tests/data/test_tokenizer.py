"""The tokenizer wrapper: default BPE cached once, tokenizer.json files, local HF folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken

from moetrain.data import DataError, Tokenizer, load_tokenizer
from moetrain.data.corpus import corpus_dir
from moetrain.data.tokenizer import DEFAULT_VOCAB_SIZE, EOS_TOKEN, train_bpe

TEXTS = [
    'The "assert" statement is a convenient way to insert debugging assertions.',
    "def f(x: int) -> int:\n\treturn x ** 2  # squared\n\n\n",
    "naïve café — 日本語のテキスト 🙂 \x00 \u200b",
    "",
    "   leading and trailing spaces   ",
]


def test_default_tokenizer_shape(tokenizer: Tokenizer):
    assert tokenizer.vocab_size == DEFAULT_VOCAB_SIZE
    assert tokenizer.decode([tokenizer.eos_id]) == EOS_TOKEN
    assert tokenizer.encode(EOS_TOKEN) == [tokenizer.eos_id]


@pytest.mark.parametrize("text", TEXTS)
def test_default_tokenizer_round_trips(tokenizer: Tokenizer, text: str):
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_encode_batch_matches_encode_and_compresses(tokenizer: Tokenizer):
    assert tokenizer.encode_batch(TEXTS) == [tokenizer.encode(t) for t in TEXTS]
    english = TEXTS[0] * 20
    # A BPE trained on the corpus merges common English into far fewer tokens than bytes.
    assert len(tokenizer.encode(english)) < len(english.encode()) / 3


def test_default_tokenizer_is_cached_next_to_the_corpus(cache_dir: str, tokenizer: Tokenizer):
    path = corpus_dir(cache_dir) / "tokenizer.json"
    mtime = path.stat().st_mtime_ns
    again = load_tokenizer("default", cache_dir)
    assert again.fingerprint == tokenizer.fingerprint
    assert path.stat().st_mtime_ns == mtime


def test_bpe_training_is_deterministic():
    texts = [f"line {i} of some text, repeated words words words" for i in range(200)]
    a, b = train_bpe(texts, 300), train_bpe(list(reversed(texts)), 300)
    assert train_bpe(texts, 300).to_str() == a.to_str()
    assert a.token_to_id(EOS_TOKEN) == b.token_to_id(EOS_TOKEN) == 0


def test_tokenizer_json_file(tmp_path: Path, cache_dir: str, tokenizer: Tokenizer):
    path = tmp_path / "my.json"
    path.write_bytes((corpus_dir(cache_dir) / "tokenizer.json").read_bytes())
    tok = load_tokenizer(str(path))
    assert tok.fingerprint == tokenizer.fingerprint
    assert tok.encode_batch(TEXTS) == tokenizer.encode_batch(TEXTS)


def test_hf_folder_uses_its_declared_eos(tmp_path: Path):
    hf = train_bpe(["hello world, hello tokens"] * 50, 300)
    hf.add_special_tokens([AddedToken("</s>", special=True), AddedToken("<pad>", special=True)])
    folder = tmp_path / "tok"
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(str(folder))
    assert tok.eos_token == "</s>" and tok.eos_id == hf.token_to_id("</s>")
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    # The AddedToken form of tokenizer_config.json names the same token.
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<pad>", "special": True}})
    )
    assert load_tokenizer(str(folder)).eos_token == "<pad>"


def test_tokenizer_errors_name_the_key(tmp_path: Path):
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    empty_folder = tmp_path / "empty"
    empty_folder.mkdir()
    no_eos = tmp_path / "no_eos.json"
    no_eos.write_text(train_bpe(["abc"] * 10, 280).to_str().replace(EOS_TOKEN, "<|other|>"))
    for spec in (str(tmp_path / "missing.json"), str(corrupt), str(empty_folder), str(no_eos)):
        with pytest.raises(DataError, match=r"^data\.tokenizer: "):
            load_tokenizer(spec)
