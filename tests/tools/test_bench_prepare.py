"""tools/bench_prepare.py: docs/data.md says what docs/data/bench_prepare.csv holds, Megatron-LM's
indexed dataset is read as its format defines, and a run compares every peer's ids (a
stand-in for Megatron's preprocess_data.py in a fake checkout, which writes that format)."""

from __future__ import annotations

import csv
import textwrap

import numpy as np
import pytest
from conftest import load_tool

bench = load_tool("bench_prepare")

# Megatron-LM's indexed dataset (megatron/core/datasets/indexed_dataset.py, written
# independently of the reader under test): the header, version 1, the dtype's code, the
# sequence and document counts, int32 sequence lengths, int64 byte offsets, int64 document
# indices (a document's sequences end where the next index starts).
WRITER = textwrap.dedent(
    """
    import struct
    import numpy as np

    def write_megatron(prefix, docs, dtype=np.uint16):
        # docs: a list of documents, each a list of sequences (lists of ids)
        code = {np.uint16: 8, np.int32: 4}[dtype]
        seqs = [s for d in docs for s in d]
        lens = [len(s) for s in seqs]
        with open(prefix + ".bin", "wb") as f:
            for s in seqs:
                f.write(np.asarray(s, dtype).tobytes())
        offsets = np.concatenate([[0], np.cumsum(lens)[:-1]]) * np.dtype(dtype).itemsize
        indices = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
        with open(prefix + ".idx", "wb") as f:
            f.write(b"MMIDIDX\\x00\\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
            f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(indices)))
            f.write(np.asarray(lens, np.int32).tobytes())
            f.write(np.asarray(offsets, np.int64).tobytes())
            f.write(np.asarray(indices, np.int64).tobytes())
    """
)

# A stand-in for Megatron-LM's tools/preprocess_data.py: the arguments the benchmark passes,
# the Hugging Face tokenizer folder it writes, one sequence per document.
FAKE_PREPROCESS = WRITER + textwrap.dedent(
    """
    import argparse, json, os
    from tokenizers import Tokenizer

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert checkout in os.environ["PYTHONPATH"].split(os.pathsep)
    p = argparse.ArgumentParser()
    for name in ("--input", "--output-prefix", "--tokenizer-type", "--tokenizer-model"):
        p.add_argument(name, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--append-eod", action="store_true")
    a = p.parse_args()
    assert a.tokenizer_type == "HuggingFaceTokenizer" and a.append_eod
    config = json.load(open(os.path.join(a.tokenizer_model, "tokenizer_config.json")))
    tok = Tokenizer.from_file(os.path.join(a.tokenizer_model, "tokenizer.json"))
    tok.encode_special_tokens = config["split_special_tokens"]
    eod = tok.token_to_id(config["eos_token"])
    docs = []
    for line in open(a.input):
        ids = tok.encode(json.loads(line)["text"], add_special_tokens=False).ids
        docs.append([ids + [eod]] if ids else [])
    write_megatron(a.output_prefix + "_text_document", docs)
    """
)


def test_megatron_indexed_dataset_is_read_as_written(tmp_path):
    """Documents of several sequences (sentence splitting), an empty one, int32 ids."""
    space: dict = {}
    exec(WRITER, space)
    docs = [[[5, 6, 7], [8, 0]], [], [[1]], [[2, 3, 0]]]
    for dtype in (np.uint16, np.int32):
        prefix = str(tmp_path / f"m-{np.dtype(dtype).name}")
        space["write_megatron"](prefix, docs, dtype)
        ids, lens = bench.read_megatron(prefix)
        assert ids.dtype == dtype
        assert ids.tolist() == [5, 6, 7, 8, 0, 1, 2, 3, 0]
        assert lens.tolist() == [5, 0, 1, 3]
    (tmp_path / "bad.idx").write_bytes(b"NOTMEGATRON" + bytes(40))
    with pytest.raises(ValueError, match="not a Megatron indexed dataset"):
        bench.read_megatron(str(tmp_path / "bad"))


def test_rows_of_an_older_schema_are_kept_in_the_new_one(tmp_path):
    path = tmp_path / "bench.csv"
    path.write_text("machine,peer,cpu_s,worker_rss_mb\nold box,datasets.map,17.6,384\n")
    bench.append_rows(path, [{"run": "r1", "peer": "prepare-data", "cpu_s": 8.2}])
    bench.append_rows(path, [{"run": "r2", "peer": "prepare-data", "cpu_s": 7.9}])
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == bench.FIELDS
        rows = list(reader)
    assert [(r["run"], r["peer"], r["cpu_s"]) for r in rows] == [
        ("", "datasets.map", "17.6"),
        ("r1", "prepare-data", "8.2"),
        ("r2", "prepare-data", "7.9"),
    ]
    assert rows[0]["machine"] == "old box" and rows[0]["worker_rss_mb"] == "384"
    assert [r["peer"] for r in bench.latest_run(rows)] == ["prepare-data"]


def test_docs_page_says_what_the_csv_holds():
    """The results block of docs/data.md is the CSV's latest run, rendered."""
    rows = bench.latest_run(bench.read_rows())
    assert rows, "docs/data/bench_prepare.csv has no run with a run id"
    assert bench.page_block(bench.PAGE.read_text()) == bench.render(rows)
    # The check can fail: another figure in the CSV renders another block.
    changed = [dict(r) for r in rows]
    changed[0]["cpu_s"] = str(float(changed[0]["cpu_s"]) * 2)
    assert bench.render(changed) != bench.render(rows)


@pytest.mark.slow
def test_a_run_compares_every_peers_ids(tmp_path):
    """A small run (enough documents for one to spell the end-of-text token): prepare-data
    (1x and 2x), the fake Megatron, datasets.map and the bare tokenizer give the same ids, and
    the rows render (Megatron's ratio among them)."""
    checkout = tmp_path / "Megatron-LM"
    (checkout / "tools").mkdir(parents=True)
    (checkout / "tools" / "preprocess_data.py").write_text(FAKE_PREPROCESS)
    out_csv = tmp_path / "bench.csv"
    docs_before = bench.CSV.read_bytes(), bench.PAGE.read_bytes()
    argv = ["--mb", "2.5", "--vocab", "400", "--scales", "1", "2", "--work", str(tmp_path / "w"),
            "--megatron", str(checkout), "--csv", str(out_csv)]  # fmt: skip
    assert bench.main(argv) == 0
    assert (bench.CSV.read_bytes(), bench.PAGE.read_bytes()) == docs_before  # --csv elsewhere
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    peers = [r["peer"].split(" [")[0] for r in rows]
    assert peers == [bench.PREPARE, bench.MEGATRON, bench.DATASETS_MAP, bench.BARE,
                     f"{bench.PREPARE} (2x corpus)"]  # fmt: skip
    assert all(r["ids_identical"] == "True" for r in rows), rows
    tokens = {p: int(r["tokens"]) for p, r in zip(peers, rows, strict=True)}
    assert tokens[f"{bench.PREPARE} (2x corpus)"] == 2 * tokens[bench.BARE]
    assert len({tokens[p] for p in peers[:4]}) == 1
    assert int(rows[3]["special_docs"]) >= 1 and int(rows[3]["false_boundaries"]) >= 1
    text = bench.render(rows)
    assert f"x `{bench.MEGATRON}`" in text and "was not a peer" not in text
    # Without --megatron the page says the peer is absent.
    no_megatron = [r for r in rows if not r["peer"].startswith(bench.MEGATRON)]
    assert "Megatron-LM was not a peer in this run" in bench.render(no_megatron)
