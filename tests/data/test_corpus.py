"""The embedded default corpus: two domains of real text, cached once, with its own eval split."""

from __future__ import annotations

import ast
import json
import random
from collections import Counter
from pathlib import Path

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


def test_a_run_over_the_tokenized_corpus_loads_neither_datasets_nor_the_corpus(
    cache_dir, tokenizer
) -> None:
    """Once both splits are in the token cache, checking the data and reading its batches
    import no ``datasets`` (1-2 s of a process's start, and pyarrow's allocator thread): what
    every rank of a multi-process run and every restart does."""
    import subprocess
    import sys

    from moetrain.config import DataConfig
    from moetrain.data.sources import build_doc_source, default_token_cache

    cfg = DataConfig(cache_dir=cache_dir)
    for role in ("train", "eval"):
        build_doc_source(cfg, tokenizer, role)
        assert (default_token_cache(cfg, tokenizer, role) / "manifest.json").is_file()
    probe = (
        "import sys\n"
        "from moetrain.config import DataConfig\n"
        "from moetrain.data import check_data, load_tokenizer\n"
        "from moetrain.data.sources import build_doc_source\n"
        f"cfg = DataConfig(cache_dir={cache_dir!r})\n"
        "check_data(cfg)\n"
        "tok = load_tokenizer('default', cfg.cache_dir)\n"
        "docs = [build_doc_source(cfg, tok, role) for role in ('train', 'eval')]\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('datasets', 'pyarrow')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=300).stdout  # fmt: skip
    assert out.strip() == "[]", out
