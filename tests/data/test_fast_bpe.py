"""The fast engine (``moetrain.data.fast_bpe``): tiktoken gives the default tokenizer's ids in
both special-token modes, it is refused for a vocabulary whose ids do not follow its merges,
and a sample on which the two engines disagree makes prepare-data fall back to tokenizers."""

from __future__ import annotations

import json

import pytest

from moetrain.data import fast_bpe
from moetrain.data.fast_bpe import (
    PROOF_STRINGS,
    choose_engine,
    tiktoken_encoding,
    tiktoken_ids,
    tokenizers_ids,
)


def _texts(n: int) -> list[str]:
    words = "expert router token capacity 12 345 café 日本 <|endoftext|> def f(x):\n\t".split(" ")
    return [" ".join(words[(i * 5 + j) % len(words)] for j in range(3 + i % 17)) for i in range(n)]


@pytest.mark.parametrize("mode", ["text", "special"])
def test_tiktoken_gives_the_tokenizers_ids(tokenizer, mode) -> None:
    from tokenizers import Tokenizer

    js = tokenizer.to_str()
    encoding = tiktoken_encoding(js)
    assert encoding is not None
    texts = [*PROOF_STRINGS, *_texts(200)]
    want = tokenizers_ids(Tokenizer.from_str(js), texts, mode)
    assert tiktoken_ids(encoding, texts, mode) == want
    eos = tokenizer.eos_id
    assert any(eos in ids for ids in want) == (mode == "special")


def test_ids_that_do_not_follow_the_merges_are_refused(tokenizer) -> None:
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    first, second = (
        m.split(" ", 1) if isinstance(m, str) else m for m in spec["model"]["merges"][:2]
    )
    a, b = "".join(first), "".join(second)
    vocab[a], vocab[b] = vocab[b], vocab[a]  # the second merge now has the smaller id
    assert tiktoken_encoding(json.dumps(spec)) is None
    assert choose_engine(json.dumps(spec), _texts(5), "text") == "tokenizers"


def test_a_sample_the_engines_disagree_on_falls_back(tokenizer, monkeypatch) -> None:
    js = tokenizer.to_str()
    assert choose_engine(js, _texts(50), "text") == "tiktoken"
    real = fast_bpe.tiktoken_ids

    def one_id_off(encoding, texts, mode):
        ids = real(encoding, texts, mode)
        ids[-1] = ids[-1][:-1] + [ids[-1][-1] + 1]
        return ids

    monkeypatch.setattr(fast_bpe, "tiktoken_ids", one_id_off)
    assert choose_engine(js, _texts(50), "text") == "tokenizers"
