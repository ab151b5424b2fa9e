"""Prepared datasets: prepare-data, batches identical to on-the-fly tokenization, exact resume,
per-rank blocks, memory flat in dataset size, and every bad input with its message."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from moetrain.cli import main as cli_main
from moetrain.config import DataConfig
from moetrain.data import (
    DataError,
    PackedBatches,
    build_doc_source,
    check_data,
    is_prepared,
    prepare_dataset,
    unigram_entropy,
)
from moetrain.data import prepare as prepare_module
from moetrain.data.prepared import ShardWriter, build_manifest, read_manifest, write_json_atomic
from moetrain.data.tokenizer import train_bpe
from moetrain.data.verify import record_verified, stamp_file

SEQ = 32
REPO = Path(__file__).resolve().parents[2]

_WORDS = (
    "expert router token capacity balance shard index manifest stream packing epoch "
    "gradient optimizer checkpoint resume layout rank block memory corpus prose code"
).split()


def texts(n: int, tag: str, empty_every: int = 0) -> list[str]:
    """``n`` distinct documents of varied length; every ``empty_every``-th one empty."""
    out = []
    for i in range(n):
        if empty_every and i % empty_every == empty_every - 1:
            out.append("")
            continue
        words = [_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(3 + (i * 37) % 30)]
        out.append(f"{tag} {i}: " + " ".join(words) + ".")
    return out


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return path


def rows(batches: PackedBatches, steps: int) -> torch.Tensor:
    """``steps`` steps of this rank's rows: [steps * rows per step, seq_len + 1]."""
    out = []
    for _ in range(steps):
        for b in batches.next_step():
            out.append(torch.cat([b["input_ids"], b["labels"][:, -1:]], 1))
    return torch.cat(out)


def prepare_cli(out: Path, *overrides: str, workers: int = 2, shard_mb: float = 0.004) -> None:
    args = ["prepare-data", *overrides, "--out", str(out), "--workers", str(workers)]
    assert cli_main([*args, "--shard-mb", str(shard_mb), "--no-progress"]) == 0


@pytest.fixture(scope="module")
def local(tmp_path_factory, cache_dir) -> dict[str, str]:
    """A JSON-lines corpus with empty rows and a held-out eval share, and its prepared twin
    written by the command line with 2 worker processes into many shards."""
    root = tmp_path_factory.mktemp("local")
    jsonl = write_jsonl(root / "corpus.jsonl", texts(150, "doc", empty_every=37))
    out = root / "prepared"
    prepare_cli(out, f"data.dataset={jsonl}", f"data.cache_dir={cache_dir}", shard_mb=0.002)
    return {"jsonl": str(jsonl), "prepared": str(out)}


@pytest.fixture(scope="module")
def default_prepared(tmp_path_factory, cache_dir) -> str:
    """The embedded default corpus (its own eval split), prepared in 1 M-character shards."""
    out = tmp_path_factory.mktemp("default") / "prepared"
    prepare_cli(out, f"data.cache_dir={cache_dir}", shard_mb=1.0)
    return str(out)


# ----------------------------------------------------------------------------- prepare-data


def test_prepare_writes_shards_index_and_manifest(local, tokenizer):
    m = read_manifest(local["prepared"])
    assert m.data["format_version"] == 2 and m.data["dtype"] == "uint16"
    assert m.literal_special_tokens == "text"
    assert m.tokenizer["fingerprint"] == tokenizer.fingerprint
    assert m.tokenizer["eos_id"] == tokenizer.eos_id
    train = m.split("train")
    assert len(train["shards"]) > 5  # the reader's shard arithmetic is exercised
    for shard in train["shards"]:
        idx = np.fromfile(m.root / shard["index"], dtype="<i8")
        tokens = np.fromfile(m.root / shard["tokens"], dtype="uint16")
        assert idx[0] == 0 and idx[-1] == len(tokens) == shard["n_tokens"]
        assert len(idx) == shard["n_docs"] + 1 and (np.diff(idx) > 1).all()
        assert (tokens[idx[1:] - 1] == tokenizer.eos_id).all()  # every document ends in EOS
        assert (tokens == tokenizer.eos_id).sum() == shard["n_docs"]
        assert shard["tokens_bytes"] == tokens.nbytes and shard["index_bytes"] == idx.nbytes
    assert train["n_docs"] == sum(s["n_docs"] for s in train["shards"])
    # Empty rows are dropped; the held-out share is its own split.
    n_text = sum(1 for t in texts(150, "doc", empty_every=37) if t)
    assert train["n_docs"] + m.split("eval")["n_docs"] == n_text
    assert (m.root / "tokenizer.json").is_file()
    leftovers = [p.name for p in m.root.iterdir() if p.name.startswith(".") or "plan" in p.name]
    assert not leftovers and not (m.root.parent / ".prepared.partial").exists()


def _same_batches(a: DataConfig, b: DataConfig, tokenizer, steps: int, dp: int = 1) -> None:
    for split, g, mb in (("train", 8, 2), ("eval", 4, 2)):
        for r in range(dp):
            x = PackedBatches(a, tokenizer, split, g, mb, r, dp)
            y = PackedBatches(b, tokenizer, split, g, mb, r, dp)
            assert torch.equal(rows(x, steps), rows(y, steps)), (split, r)
            assert x.state_dict() == y.state_dict()


def test_prepared_and_on_the_fly_batches_are_identical(local, data_cfg, tokenizer):
    fly = data_cfg(dataset=local["jsonl"], seq_len=SEQ, seed=3)
    prep = data_cfg(dataset=local["prepared"], seq_len=SEQ, seed=3)
    # 30 steps of 8 x 33 tokens wrap this small split (~3k tokens) into later epochs.
    _same_batches(fly, prep, tokenizer, steps=30)
    _same_batches(fly, prep, tokenizer, steps=3, dp=2)
    assert unigram_entropy(tokenizer, fly) == unigram_entropy(tokenizer, prep)
    other_seed = data_cfg(dataset=local["prepared"], seq_len=SEQ, seed=4)
    assert not torch.equal(
        rows(PackedBatches(prep, tokenizer, "train", 8, 2), 2),
        rows(PackedBatches(other_seed, tokenizer, "train", 8, 2), 2),
    )


def test_prepared_default_corpus_matches_on_the_fly(default_prepared, data_cfg, tokenizer):
    fly = data_cfg(seq_len=128, seed=1)
    prep = data_cfg(dataset=default_prepared, seq_len=128, seed=1)
    _same_batches(fly, prep, tokenizer, steps=5)
    a, b = build_doc_source(fly, tokenizer, "train"), build_doc_source(prep, tokenizer, "train")
    assert (a.n_docs, a.n_tokens) == (b.n_docs, b.n_tokens)
    ids = np.arange(a.n_docs)
    np.testing.assert_array_equal(a.lengths(ids), b.lengths(ids))


def test_resume_at_any_step_is_identical(local, data_cfg, tokenizer):
    cfg = data_cfg(dataset=local["prepared"], seq_len=SEQ, seed=9)
    steps = 30  # several epochs of this split
    run = PackedBatches(cfg, tokenizer, "train", 8, 4)
    states, full = [], []
    for _ in range(steps):
        states.append(json.loads(json.dumps(run.state_dict())))
        full.append(rows(run, 1))
    assert states[-1]["epoch"] >= 1  # across an epoch boundary
    for k in range(steps):
        fresh = PackedBatches(cfg, tokenizer, "train", 8, 4)
        fresh.load_state_dict(states[k])
        assert torch.equal(rows(fresh, steps - k), torch.cat(full[k:])), k
    # ... and under another layout (dp=2, micro-batches of 1), from the middle.
    ranks = [PackedBatches(cfg, tokenizer, "train", 8, 1, r, 2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(states[11])
    for k in range(11, steps):
        assert torch.equal(torch.cat([rows(r, 1) for r in ranks]), full[k])


def test_two_ranks_read_disjoint_blocks_whose_union_is_the_global_batch(local, data_cfg, tokenizer):
    cfg = data_cfg(dataset=local["prepared"], seq_len=SEQ, seed=2)
    one = PackedBatches(cfg, tokenizer, "train", 8, 4)
    ranks = [PackedBatches(cfg, tokenizer, "train", 8, 2, r, 2) for r in range(2)]
    reads: dict[int, list[tuple[int, int, int]]] = {0: [], 1: []}
    for r, batches in enumerate(ranks):
        source = batches.source
        original = source.read

        def recording(doc, start, stop, _log=reads[r], _read=original):
            _log.append((doc, start, stop))
            return _read(doc, start, stop)

        source.read = recording
    steps = 12
    for _ in range(steps):
        whole = torch.from_numpy(one.next_global_batch().astype(np.int64))
        blocks = [rows(r, 1) for r in ranks]
        assert torch.equal(blocks[0], whole[:4]) and torch.equal(blocks[1], whole[4:])
        assert not torch.equal(blocks[0], blocks[1])
    for r in range(2):
        # A rank reads the tokens of its own block and nothing else: 4 rows of 33 a step.
        assert sum(stop - start for _, start, stop in reads[r]) == steps * 4 * (SEQ + 1)
    assert ranks[0].state_dict() == ranks[1].state_dict() == one.state_dict()


_RSS_PROBE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import moetrain.data.check, moetrain.data.packing, moetrain.data.sources  # imports first
    from moetrain.config import DataConfig
    from moetrain.data import PackedBatches, check_data, load_tokenizer
    from moetrain.data.prepared import read_manifest

    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

    cfg = DataConfig(dataset=sys.argv[1], cache_dir=sys.argv[2], seq_len=255)
    tok = load_tokenizer("default", cfg.cache_dir)
    before = rss()
    check_data(cfg)
    train = PackedBatches(cfg, tok, "train", 16, 4, dp_rank=1, dp_size=2)
    for _ in range(20):
        train.next_step()
    PackedBatches(cfg, tok, "eval", 8, 4, dp_rank=1, dp_size=2).next_step()
    loaded = rss()
    m = read_manifest(cfg.dataset)
    whole = [np.fromfile(m.root / s["tokens"], "uint16") for s in m.split("train")["shards"]]
    print(json.dumps({"load": loaded - before, "whole": rss() - loaded,
                      "bytes": sum(w.nbytes for w in whole)}))
    """
)


def _write_copies(root: Path, source, tokenizer, copies: int, cache_dir: str) -> None:
    """A prepared dataset holding ``copies`` copies of ``source``'s documents (train) and
    its first 20 (eval), 1000 documents a shard; recorded as verified, as prepare-data does."""
    root.mkdir(parents=True)
    docs = [source.read(d, 0, n) for d, n in enumerate(source.lengths(np.arange(source.n_docs)))]
    splits = {"train": docs * copies, "eval": docs[:20]}
    shards = {}
    for split, ds in splits.items():
        shards[split] = []
        for i in range(0, len(ds), 1000):
            writer = ShardWriter(root, split, i // 1000, "uint16")
            for d in ds[i : i + 1000]:
                writer.add(d)
            shards[split].append(writer.close())
    info = {"fingerprint": tokenizer.fingerprint, "eos_id": tokenizer.eos_id, "source": "t"}
    write_json_atomic(root / "manifest.json", build_manifest(info, "uint16", shards, {}))
    record_verified(read_manifest(root), stamp_file(cache_dir, read_manifest(root)))


def test_memory_per_rank_does_not_grow_with_dataset_size(tmp_path, data_cfg, tokenizer, cache_dir):
    source = build_doc_source(data_cfg(), tokenizer, "train")  # the default corpus, ~1.2M tokens
    grown = {}
    for copies in (1, 16):
        root = tmp_path / f"x{copies}"
        _write_copies(root, source, tokenizer, copies, cache_dir)
        probe = subprocess.run(
            [sys.executable, "-c", _RSS_PROBE, str(root), cache_dir],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        assert probe.returncode == 0, probe.stderr[-3000:]
        grown[copies] = json.loads(probe.stdout.strip().splitlines()[-1])
    big = grown[16]
    mib = 1 << 20
    # The probe sees a dataset loaded whole: the control grows by its size (~38 MB) ...
    assert big["bytes"] > 30 * mib and big["whole"] > 0.8 * big["bytes"], grown
    # ... while check_data, the reader and 20 steps of one rank grow by a few MB at most,
    # and by the same few MB at 16x the data.
    assert big["load"] < big["bytes"] / 4, grown
    assert big["load"] < grown[1]["load"] + 8 * mib, grown


# ----------------------------------------------------------------------------- resume, atomicity


def test_interrupted_prepare_resumes_without_redoing_finished_shards(
    tmp_path, data_cfg, tokenizer, monkeypatch
):
    jsonl = write_jsonl(tmp_path / "c.jsonl", texts(300, "r"))
    cfg = data_cfg(dataset=str(jsonl))
    out = tmp_path / "out"
    real_record = prepare_module._Staging.record
    recorded = []

    def record_then_die(self, split, index, entry, rows_read):
        real_record(self, split, index, entry, rows_read)
        recorded.append((split, index))
        if len(recorded) == 3:
            raise KeyboardInterrupt  # as a Ctrl-C or a kill between two shards would

    monkeypatch.setattr(prepare_module._Staging, "record", record_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(cfg, out, workers=0, shard_mb=0.002, progress=False)
    monkeypatch.undo()
    staging = tmp_path / ".out.partial"
    assert not out.exists() and not is_prepared(out) and staging.is_dir()
    with pytest.raises(DataError, match="does not exist"):  # a half-written dataset is not read
        check_data(data_cfg(dataset=str(out)))
    kept = {p.name: p.stat().st_ino for p in staging.glob("train-0000[0-2].*")}
    assert len(kept) == 6
    # Other settings do not silently mix with the interrupted work.
    with pytest.raises(DataError, match=r"^--out: .*interrupted preparation.*shard_chars"):
        prepare_dataset(cfg, out, workers=0, shard_mb=0.003, progress=False)
    manifest = prepare_dataset(cfg, out, workers=0, shard_mb=0.002, progress=False)
    assert {n: (out / n).stat().st_ino for n in kept} == kept  # finished shards kept, not redone
    fresh = prepare_dataset(cfg, tmp_path / "fresh", workers=0, shard_mb=0.002, progress=False)
    assert manifest.data["splits"] == fresh.data["splits"]
    assert not staging.exists()
    # Preparing a finished dataset again is a no-op.
    again = prepare_dataset(cfg, out, workers=0, shard_mb=0.002, progress=False)
    assert again.data == manifest.data


def test_verify_command(local, tmp_path, capsys, cache_dir):
    assert cli_main(["prepare-data", "--verify", local["prepared"]]) == 0
    assert "every shard matches its checksum" in capsys.readouterr().out
    copy = tmp_path / "copy"
    shutil.copytree(local["prepared"], copy)
    shard = sorted(copy.glob("train-*.bin"))[1]
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cli_main(["prepare-data", "--verify", str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"--verify: shard '{shard}' does not match its checksum" in err, err


# ----------------------------------------------------------------------------- bad input


def _copy(local: dict[str, str], tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(local["prepared"], copy)
    return copy


def _other_tokenizer(tmp_path: Path) -> str:
    tok = train_bpe(texts(50, "other"), 300)
    path = tmp_path / "other.json"
    path.write_text(tok.to_str())
    return str(path)


def _truncate(root: Path) -> str:
    shard = sorted(root.glob("train-*.bin"))[2]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 2)
    return f"shard '{shard}' holds"


def _remove(root: Path) -> str:
    shard = sorted(root.glob("train-*.idx"))[3]
    shard.unlink()
    return f"shard '{shard}' listed in '{root / 'manifest.json'}' is missing"


def _corrupt(root: Path) -> str:
    shard = sorted(root.glob("eval-*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    return f"shard '{shard}' does not match its checksum in '{root / 'manifest.json'}'"


def _newer(root: Path) -> str:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["format_version"] = 99
    (root / "manifest.json").write_text(json.dumps(manifest))
    return f"'{root / 'manifest.json'}' is format version 99; this moetrain reads versions up to 2"


def _garbled(root: Path) -> str:
    (root / "manifest.json").write_text('{"format": "moetrain-prepared", ')
    return f"cannot read '{root / 'manifest.json'}'"


BAD = [
    ("truncated-shard", _truncate, "data.dataset"),
    ("missing-shard", _remove, "data.dataset"),
    ("checksum-mismatch", _corrupt, "data.dataset"),
    ("newer-format", _newer, "data.dataset"),
    ("garbled-manifest", _garbled, "data.dataset"),
]


@pytest.mark.parametrize("damage,key", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_prepared_dataset_is_a_data_error_naming_the_file(
    local, tmp_path, data_cfg, damage, key
):
    root = _copy(local, tmp_path)
    check_data(data_cfg(dataset=str(root)))  # whole and verified before the damage
    phrase = damage(root)
    with pytest.raises(DataError) as info:
        check_data(data_cfg(dataset=str(root)))
    message = str(info.value)
    assert message.startswith(f"{key}: ") and phrase in message, message


def test_prepared_with_another_tokenizer_is_refused(local, tmp_path, data_cfg):
    other = _other_tokenizer(tmp_path)
    with pytest.raises(DataError) as info:
        check_data(data_cfg(dataset=local["prepared"], tokenizer=other))
    message = str(info.value)
    manifest = Path(local["prepared"]) / "manifest.json"
    assert message.startswith(f"data.tokenizer: '{manifest}' was prepared with tokenizer"), message
    assert f"data.tokenizer='{Path(local['prepared']) / 'tokenizer.json'}'" in message


def test_bad_prepared_dataset_stops_training_before_any_process_group(
    local, tmp_path, capsys, cache_dir, monkeypatch
):
    import torch.distributed as dist

    root = _copy(local, tmp_path)
    phrase = _corrupt(root)
    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: started.append(1))
    code = cli_main(
        [
            "--config",
            str(REPO / "configs" / "tiny.yaml"),
            f"data.dataset={root}",
            f"data.cache_dir={cache_dir}",
            f"train.output_dir={tmp_path / 'run'}",
            "log.progress_bar=false",
            "log.tensorboard=false",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"moetrain: data error: data.dataset: {phrase}" in err, err
    assert not started and not (tmp_path / "run" / "checkpoints").exists()


def test_prepare_data_refuses_what_it_cannot_do(local, tmp_path, capsys, cache_dir):
    cache = f"data.cache_dir={cache_dir}"
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "x").write_text("x")
    cases = [
        (
            [f"data.dataset={local['prepared']}", cache, "--out", str(tmp_path / "o")],
            "data.dataset: ",
            "is already a prepared dataset",
        ),
        (
            [f"data.dataset={local['jsonl']}", cache, "--out", str(existing)],
            "--out: ",
            "exists and is not a prepared dataset",
        ),
        (
            ["data.dataset=/no/such.jsonl", cache, "--out", str(tmp_path / "o")],
            "data.dataset: ",
            "does not exist",
        ),
        (
            [
                f"data.dataset={write_jsonl(tmp_path / 'o.jsonl', texts(5, 'o'))}",
                cache,
                "--out",
                local["prepared"],
            ],
            "--out: ",
            "already holds a dataset prepared from other data",
        ),
    ]
    for args, key, phrase in cases:
        assert cli_main(["prepare-data", *args]) == 2
        err = capsys.readouterr().err
        assert f"moetrain: data error: {key}" in err and phrase in err, err
    with pytest.raises(SystemExit):
        cli_main(["prepare-data", f"data.dataset={local['jsonl']}"])  # neither --out nor --verify
    capsys.readouterr()


def test_a_copied_dataset_is_verified_once_then_trusted(local, tmp_path, data_cfg, cache_dir):
    root = _copy(local, tmp_path)
    cfg = data_cfg(dataset=str(root))
    manifest = read_manifest(root)
    stamps = stamp_file(cache_dir, manifest)
    assert not stamps.exists()  # a copy is unknown to this machine ...
    check_data(cfg)
    recorded = json.loads(stamps.read_text())  # ... verified on its first check, and recorded
    assert len(recorded) == 2 * sum(len(s["shards"]) for s in manifest.data["splits"].values())
    before = stamps.stat().st_mtime_ns
    check_data(cfg)  # nothing to verify again: the record is not rewritten
    assert stamps.stat().st_mtime_ns == before
    os.utime(sorted(root.glob("train-*.bin"))[0])  # a file written since is read again
    check_data(cfg)
    assert stamps.stat().st_mtime_ns != before


def test_automatic_shard_size_keeps_the_workers_busy(local, data_cfg, monkeypatch):
    from moetrain.data import load_split
    from moetrain.data.prepare import auto_shard_chars

    small = {r: load_split(data_cfg(dataset=local["jsonl"]), r) for r in ("train", "eval")}
    assert auto_shard_chars(small, "text") == 1_000_000  # at least 1 M characters a shard
    corpus = {r: load_split(data_cfg(), r) for r in ("train", "eval")}
    chars = sum(len(t) for ds in corpus.values() for t in ds["text"])
    assert auto_shard_chars(corpus, "text") == 1_000_000  # 4 M characters: the floor again
    monkeypatch.setattr(prepare_module, "MIN_SHARD_MB", 0.0)
    assert auto_shard_chars(corpus, "text") == int(chars / 64)  # 64 shards of the text
    monkeypatch.setattr(prepare_module, "MAX_SHARD_MB", 0.01)
    assert auto_shard_chars(corpus, "text") == 10_000
    streamed = {r: load_split(data_cfg(streaming=True), r) for r in ("train", "eval")}
    assert auto_shard_chars(streamed, "text") == 16_000_000


def test_a_streamed_source_prepares_the_same_dataset(local, tmp_path, data_cfg, tokenizer):
    streamed = data_cfg(dataset=local["jsonl"], streaming=True)
    m = prepare_dataset(streamed, tmp_path / "s", workers=0, shard_mb=0.002, progress=False)
    plain = read_manifest(local["prepared"])
    for split in ("train", "eval"):
        assert [s["tokens_sha256"] for s in m.split(split)["shards"]] == [
            s["tokens_sha256"] for s in plain.split(split)["shards"]
        ]
    a = PackedBatches(data_cfg(dataset=str(tmp_path / "s"), seq_len=SEQ), tokenizer, "train", 8, 4)
    b = PackedBatches(data_cfg(dataset=local["prepared"], seq_len=SEQ), tokenizer, "train", 8, 4)
    assert torch.equal(rows(a, 5), rows(b, 5))


def test_prepare_data_reads_without_loading_torch(local, tmp_path, cache_dir):
    """datasets' streaming reader would import torch (about a CPU-second and 200 MB of the
    parent's memory) to share an epoch counter with DataLoader workers that preparation does
    not have: prepare-data keeps it out, and leaves datasets' switch as it found it."""
    code = textwrap.dedent(
        f"""
        import sys
        import datasets.config
        from moetrain.config import load_config
        from moetrain.data.prepare import prepare_dataset
        cfg = load_config(None, ["data.dataset={local["jsonl"]}", "data.cache_dir={cache_dir}"])
        out = {str(tmp_path / "out")!r}
        prepare_dataset(cfg.data, out, workers=0, shard_mb=0.002, progress=False)
        print("torch" in sys.modules, datasets.config.TORCH_AVAILABLE)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["False", "True"]
    assert is_prepared(tmp_path / "out")
