"""The embedded default corpus: two domains of real text, cached once, with its own eval split."""

from __future__ import annotations

import ast
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from moetrain.data import corpus_files, load_split
from moetrain.data._cache import publish
from moetrain.data.corpus import EVAL_FRACTION, corpus_dir, split_records, stdlib_dir


def _records(cache_dir: str, split: str) -> list[dict]:
    path = corpus_files(cache_dir)[split]
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_corpus_is_two_balanced_domains_of_at_least_4mb(cache_dir):
    records = _records(cache_dir, "train") + _records(cache_dir, "eval")
    by_domain = {"prose": 0, "code": 0}
    for r in records:
        assert set(r) == {"text", "domain", "source"}
        by_domain[r["domain"]] += len(r["text"].encode("utf-8"))
    total = sum(by_domain.values())
    assert total >= 4_000_000, by_domain
    for domain, nbytes in by_domain.items():
        assert 0.4 <= nbytes / total <= 0.6, (domain, by_domain)


def test_corpus_is_real_text_from_the_stdlib(cache_dir):
    records = _records(cache_dir, "train")
    std = stdlib_dir()
    for r in records:
        assert (std / r["source"]).is_file(), r["source"]  # a relative path into the stdlib
        assert "/test/" not in f"/{r['source']}" and "idle_test" not in r["source"]
    prose = " ".join(r["text"] for r in records if r["domain"] == "prose").lower().split()
    # English: the commonest words of the language reference are the commonest words of English.
    top = {w for w, _ in Counter(prose).most_common(10)}
    assert {"the", "a", "of", "is"} <= top, top
    assert any("assert" in r["text"] for r in records if r["source"] == "pydoc_data/topics.py")
    code = [r for r in records if r["domain"] == "code"]
    assert len({r["source"] for r in code}) == len(code) >= 100  # whole distinct files
    for r in random.Random(0).sample(code, 20):
        ast.parse(r["text"])  # real Python source
    prose_docs = [r for r in records if r["domain"] == "prose"]
    assert max(len(r["text"]) for r in prose_docs) < 10_000  # long prose is chunked


def test_eval_split_is_held_out_two_percent_of_each_domain(cache_dir):
    train, held = _records(cache_dir, "train"), _records(cache_dir, "eval")
    assert not {r["text"] for r in train} & {r["text"] for r in held}
    for domain in ("prose", "code"):
        n_train = sum(r["domain"] == domain for r in train)
        n_eval = sum(r["domain"] == domain for r in held)
        assert n_eval >= 1
        assert abs(n_eval / (n_train + n_eval) - EVAL_FRACTION) < 0.01


def test_split_is_deterministic_whatever_the_input_order(cache_dir):
    records = _records(cache_dir, "train") + _records(cache_dir, "eval")
    shuffled = records[:]
    random.Random(1).shuffle(shuffled)
    assert split_records(shuffled) == split_records(records)
    assert split_records(records)["eval"] == _records(cache_dir, "eval")


def test_corpus_is_written_once_and_read_through_load_dataset(cache_dir, data_cfg):
    files = corpus_files(cache_dir)
    assert files["train"].parent == corpus_dir(cache_dir)
    assert corpus_dir(cache_dir).name.startswith("corpus-")
    mtimes = {s: p.stat().st_mtime_ns for s, p in files.items()}
    assert {s: p.stat().st_mtime_ns for s, p in corpus_files(cache_dir).items()} == mtimes
    assert not list(corpus_dir(cache_dir).glob(".*tmp"))  # no temp files left behind
    ds = load_split(data_cfg(), "train")
    assert sorted(ds.column_names) == ["domain", "source", "text"]
    assert ds.num_rows == len(_records(cache_dir, "train"))
    assert ds[0]["text"] == _records(cache_dir, "train")[0]["text"]


def test_publish_is_atomic_and_first_writer_wins(tmp_path: Path):
    target = tmp_path / "f.bin"
    publish(target, lambda f: f.write(b"first"))
    publish(target, lambda f: f.write(b"second"))
    assert target.read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def _local_docs(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


@pytest.mark.parametrize("data", ["default", "local"])
def test_a_run_over_tokenized_data_loads_neither_datasets_nor_the_text(
    data, cache_dir, tokenizer, tmp_path
) -> None:
    """Once both splits are in the token cache, checking the data and reading its batches
    import no ``datasets`` (1-2 s of a process's start, and pyarrow's allocator thread): what
    every rank of a multi-process run and every restart does. For the default corpus and
    for local files (here one file, its eval split held out by ``data.eval_fraction``)."""
    import subprocess
    import sys

    from moetrain.config import DataConfig
    from moetrain.data.sources import build_doc_source, token_cache

    dataset = "default"
    if data == "local":
        dataset = _local_docs(tmp_path / "docs.jsonl", [f"doc {i} " * 20 for i in range(40)])
    cfg = DataConfig(dataset=dataset, cache_dir=cache_dir)
    caches = set()
    for role in ("train", "eval"):
        build_doc_source(cfg, tokenizer, role)
        caches.add(token_cache(cfg, tokenizer, role))
        assert (token_cache(cfg, tokenizer, role) / "manifest.json").is_file()
    assert len(caches) == 2  # the held-out documents are not the training ones
    probe = (
        "import sys\n"
        "from moetrain.config import DataConfig\n"
        "from moetrain.data import check_data, load_tokenizer\n"
        "from moetrain.data.sources import build_doc_source\n"
        f"cfg = DataConfig(dataset={dataset!r}, cache_dir={cache_dir!r})\n"
        "check_data(cfg)\n"
        "tok = load_tokenizer('default', cfg.cache_dir)\n"
        "docs = [build_doc_source(cfg, tok, role) for role in ('train', 'eval')]\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('datasets', 'pyarrow')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=300).stdout  # fmt: skip
    assert out.strip() == "[]", out


def test_a_local_file_written_again_is_tokenized_again(cache_dir, tokenizer, tmp_path) -> None:
    """The token cache of local files is keyed by their size and modification time (as
    ``datasets``' own cache of them is), and by the hold-out: new text, or another eval
    fraction, is never read from an old cache."""
    import os

    from moetrain.config import DataConfig
    from moetrain.data.sources import build_doc_source, token_cache

    path = tmp_path / "docs.jsonl"

    def first_doc(texts, when):
        _local_docs(path, texts)
        os.utime(path, ns=(when, when))
        cfg = DataConfig(dataset=str(path), cache_dir=cache_dir, eval_split="train")
        doc = build_doc_source(cfg, tokenizer, "train").read(0, 0, 4).tolist()
        return tokenizer.decode(doc), token_cache(cfg, tokenizer, "train")

    first, key = first_doc(["alpha beta gamma delta"] * 3, 10**18)
    assert first.startswith("alpha")
    second, new_key = first_doc(["omega psi chi phi"] * 3, 2 * 10**18)
    assert second.startswith("omega") and new_key != key
    assert first_doc(["omega psi chi phi phi"] * 3, 2 * 10**18)[1] != new_key  # size alone
    cfg = DataConfig(dataset=str(path), cache_dir=cache_dir)
    held_out = DataConfig(dataset=str(path), cache_dir=cache_dir, eval_fraction=0.2)
    assert token_cache(cfg, tokenizer, "eval") != token_cache(held_out, tokenizer, "eval")
    assert token_cache(cfg, tokenizer, "eval") != token_cache(cfg, tokenizer, "train")
