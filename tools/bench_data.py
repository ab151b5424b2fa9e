"""Data-path benchmark: tokenization throughput, first batch and memory per rank, batch rate.

    python tools/bench_data.py                 # 1x, 4x, 16x the embedded corpus (~4.2 MB each x)
    python tools/bench_data.py --quick         # 1x and 2x, fewer repetitions (a smoke run)

In one run, on corpora of 1x, 4x and 16x the embedded default corpus's training text (JSON
lines, its documents repeated):

1. tokenization throughput (tokens/s) of ``prepare-data`` with 0 (tokenize in this
   process, with the tokenizer's own threads), 1, 2, ... worker processes, and of
   ``datasets.map(num_proc=k)`` doing the same tokenization, on the 4x corpus;
2. for the prepared dataset of each size, in a fresh process per data-parallel rank (dp=2):
   time to the first batch (tokenizer, ``check_data``, ``PackedBatches``, first step, after
   the imports), the resident-set growth that loading and 50 steps cause, and the peak
   resident set (VmHWM, imports included);
3. the steady-state rate at which one rank produces batches (prepared 16x; the streamed 1x
   corpus with its background tokenizer thread and inline) against the rate at which the
   training step of configs/tiny.yaml consumes tokens on this machine.

Rows go to docs/data/bench_data.csv (hardware, commit, case, figure); docs/data.md quotes them.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CSV = REPO / "docs" / "data" / "bench_data.csv"
FIELDS = ["timestamp", "hardware", "commit", "benchmark", "case", "value", "unit"]

# Runs in a fresh process: the cost of loading a prepared dataset, as one rank sees it.
_RANK_PROBE = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import moetrain.data.check, moetrain.data.packing, moetrain.data.sources
    from moetrain.config import DataConfig
    from moetrain.data import PackedBatches, check_data, load_tokenizer

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

    path, cache, rank, dp, gbs, mbs, seq = sys.argv[1:8]
    imported = time.perf_counter()
    before = status("VmRSS")
    cfg = DataConfig(dataset=path, cache_dir=cache, seq_len=int(seq))
    tok = load_tokenizer(cfg.tokenizer, cfg.cache_dir)
    check_data(cfg)
    batches = PackedBatches(cfg, tok, "train", int(gbs), int(mbs), int(rank), int(dp))
    batches.next_step()
    first = time.perf_counter()
    for _ in range(49):
        batches.next_step()
    print(json.dumps({"import_s": imported - t0, "first_batch_s": first - imported,
                      "rss_growth": status("VmRSS") - before, "hwm": status("VmHWM")}))
    """
)


def hardware() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()}-core CPU ({model})"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Results:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.rows: list[dict[str, object]] = []
        self.stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        self.hw, self.commit = hardware(), git_commit()

    def add(self, benchmark: str, case: str, value: float, unit: str) -> None:
        row = {
            "timestamp": self.stamp,
            "hardware": self.hw,
            "commit": self.commit,
            "benchmark": benchmark,
            "case": case,
            "value": f"{value:.4g}",
            "unit": unit,
        }
        self.rows.append(row)
        print(f"  {benchmark:<14} {case:<44} {value:>12.4g} {unit}", flush=True)

    def write(self) -> None:
        if self.path is None:
            return
        new = not self.path.exists()
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(self.rows)
        print(f"appended {len(self.rows)} rows to {self.path}")


def write_corpora(workdir: Path, sizes: list[int], cache_dir: str) -> dict[int, Path]:
    """``<workdir>/corpus-<k>x.jsonl``: the default corpus's training documents, k times."""
    from moetrain.data import corpus_files

    base = corpus_files(cache_dir)["train"].read_text(encoding="utf-8")
    out = {}
    for k in sizes:
        path = workdir / f"corpus-{k}x.jsonl"
        if not path.exists():
            path.write_text(base * k, encoding="utf-8")
        out[k] = path
    return out


def tokenization(res: Results, corpus: Path, workdir: Path, cache_dir: str, reps: int) -> int:
    """Tokens/s of prepare-data per worker count, and of datasets.map(num_proc) doing the same
    tokenization; the modes run round-robin ``reps`` times and the best rate of each is kept
    (a shared machine's load drifts). Returns the fastest prepare-data worker count."""
    import datasets

    from moetrain.config import DataConfig
    from moetrain.data import load_split, load_tokenizer, prepare_dataset

    cfg = DataConfig(dataset=str(corpus), cache_dir=cache_dir)
    splits = {role: load_split(cfg, role) for role in ("train", "eval")}  # Arrow, once
    tok = load_tokenizer("default", cache_dir)
    kwargs = {"tok_json": tok.to_str(), "eos": tok.eos_id}
    cores = os.cpu_count() or 1
    rates: dict[tuple[str, int], float] = {}
    for rep in range(reps):
        for workers in range(0, cores + 1):
            out = workdir / f"tok-w{workers}-{rep}"
            shutil.rmtree(out, ignore_errors=True)  # a finished one would be a no-op
            start = time.perf_counter()
            m = prepare_dataset(cfg, out, workers=workers, progress=False)
            rate = sum(m.split(s)["n_tokens"] for s in splits) / (time.perf_counter() - start)
            rates["prepare", workers] = max(rates.get(("prepare", workers), 0.0), rate)
        for procs in range(1, cores + 1):
            start = time.perf_counter()
            tokens = 0
            for role, ds in splits.items():
                mapped = ds.map(
                    _map_tokenize,
                    batched=True,
                    batch_size=256,
                    num_proc=procs,
                    fn_kwargs=kwargs,
                    remove_columns=ds.column_names,
                    load_from_cache_file=False,
                    cache_file_name=str(workdir / f"map-{role}-{procs}-{rep}.arrow"),
                )
                tokens += sum(map(len, mapped.data.column("ids").to_pylist()))
            rate = tokens / (time.perf_counter() - start)
            rates["map", procs] = max(rates.get(("map", procs), 0.0), rate)
    datasets.disable_progress_bars()
    for (kind, n), rate in rates.items():
        if kind == "prepare":
            label = "in-process (tokenizer threads)" if n == 0 else f"{n} worker process(es)"
            res.add("tokenize", f"prepare-data, {label}", rate, "tokens/s")
        else:
            res.add("tokenize", f"datasets.map(num_proc={n}), Arrow out", rate, "tokens/s")
    return max((n for kind, n in rates if kind == "prepare"), key=lambda n: rates["prepare", n])


_MAP_TOKENIZER: dict[str, object] = {}


def _map_tokenize(batch: dict[str, list], tok_json: str, eos: int) -> dict[str, list]:
    from tokenizers import Tokenizer

    tok = _MAP_TOKENIZER.get(tok_json)
    if tok is None:
        tok = _MAP_TOKENIZER[tok_json] = Tokenizer.from_str(tok_json)
    texts = [t for t in batch["text"] if t]
    encs = tok.encode_batch(texts, add_special_tokens=False)  # type: ignore[attr-defined]
    return {"ids": [e.ids + [eos] for e in encs]}


def rank_probe(path: Path, cache_dir: str, rank: int, dp: int, gbs: int, mbs: int, seq: int):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _RANK_PROBE,
            str(path),
            cache_dir,
            str(rank),
            str(dp),
            str(gbs),
            str(mbs),
            str(seq),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(f"rank probe failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def train_tokens_per_s(steps: int) -> tuple[float, int, int]:
    """Tokens/s that one training step of configs/tiny.yaml consumes (forward, backward,
    AdamW; one process, this machine), with its global batch and sequence length."""
    import torch
    import torch.nn.functional as F

    from moetrain.config import load_config
    from moetrain.model import build_model

    cfg = load_config(REPO / "configs" / "tiny.yaml", ["model.vocab_size=4096"])
    model = build_model(cfg.model, cfg.moe, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g, mbs, seq = cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.data.seq_len
    x = torch.randint(0, 4096, (mbs, seq + 1))

    def step() -> None:
        for _ in range(g // mbs):
            logits = model(x[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return g * seq * steps / (time.perf_counter() - start), g, seq


def batch_rate(batches, steps: int) -> float:
    batches.next_step()
    start = time.perf_counter()
    for _ in range(steps):
        batches.next_step()
    return steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1x and 2x only, fewer steps")
    parser.add_argument(
        "--workdir",
        help="where corpora and prepared datasets go (default: "
        "a temporary directory, deleted afterwards)",
    )
    parser.add_argument("--cache-dir", default=None, help="moetrain cache (data.cache_dir)")
    parser.add_argument("--no-append", action="store_true", help="do not write the CSV")
    parser.add_argument("--csv", default=str(DEFAULT_CSV), help="results file to append to")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import logging

    import datasets

    datasets.disable_progress_bars()
    logging.basicConfig(level=logging.WARNING)
    res = Results(None if args.no_append else Path(args.csv))
    print(f"hardware: {res.hw}, commit {res.commit}, load average {os.getloadavg()[0]:.1f}")
    sizes = [1, 2] if args.quick else [1, 4, 16]
    with tempfile.TemporaryDirectory(prefix="bench_data-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        cache_dir = args.cache_dir or str(workdir / "cache")
        from moetrain.config import DataConfig
        from moetrain.data import check_data

        check_data(DataConfig(cache_dir=cache_dir))  # builds the corpus and tokenizer once
        corpora = write_corpora(workdir, sizes, cache_dir)
        print("1. tokenization throughput")
        mid = sizes[1] if len(sizes) > 1 else sizes[0]
        best = tokenization(res, corpora[mid], workdir, cache_dir, 1 if args.quick else 2)
        print(f"2. prepared datasets per size ({best} workers), first batch and memory per rank")
        from moetrain.data import prepare_dataset

        prepared = {}
        for k in sizes:
            cfg = DataConfig(dataset=str(corpora[k]), cache_dir=cache_dir)
            shutil.rmtree(workdir / f"prepared-{k}x", ignore_errors=True)
            start = time.perf_counter()
            m = prepare_dataset(cfg, workdir / f"prepared-{k}x", workers=best, progress=False)
            seconds = time.perf_counter() - start
            tokens = m.split("train")["n_tokens"]
            res.add(
                "prepare", f"{k}x: {tokens / 1e6:.1f}M train tokens, {best} workers", seconds, "s"
            )
            prepared[k] = m.root
            for rank in range(2):
                r = rank_probe(m.root, cache_dir, rank, 2, 16, 8, 128)
                res.add(
                    "first_batch",
                    f"{k}x rank {rank}/2 (after {r['import_s']:.1f} s imports)",
                    r["first_batch_s"],
                    "s",
                )
                res.add(
                    "rss_growth",
                    f"{k}x rank {rank}/2: load + 50 steps",
                    r["rss_growth"] / 2**20,
                    "MiB",
                )
                res.add(
                    "peak_rss", f"{k}x rank {rank}/2 (imports included)", r["hwm"] / 2**20, "MiB"
                )
        print("3. steady-state batch production vs the training step's consumption")
        from moetrain.data import PackedBatches, load_tokenizer

        tok = load_tokenizer("default", cache_dir)
        train_rate, g, seq = train_tokens_per_s(3 if args.quick else 10)
        res.add(
            "train_step",
            f"tiny.yaml: {g} x {seq} tokens/step, fwd+bwd+AdamW",
            train_rate,
            "tokens/s",
        )
        steps = 100 if args.quick else 500
        big = prepared[sizes[-1]]
        cfg = DataConfig(dataset=str(big), cache_dir=cache_dir, seq_len=seq)
        rate = batch_rate(PackedBatches(cfg, tok, "train", g, 8, 0, 2), steps)
        res.add("batch_rate", f"prepared {sizes[-1]}x, rank 0/2", rate * g * seq, "tokens/s")
        res.add(
            "batch_rate",
            f"prepared {sizes[-1]}x vs training step",
            rate * g * seq / train_rate,
            "x",
        )
        from moetrain.data.packing import SequentialStream

        for prefetch, label in ((0, "inline"), (4096, "background thread")):
            cfg = DataConfig(
                dataset=str(corpora[1]), cache_dir=cache_dir, seq_len=seq, streaming=True
            )
            batches = PackedBatches(cfg, tok, "train", g, 8, 0, 2)
            stream = batches.stream
            assert isinstance(stream, SequentialStream)
            stream.source.prefetch = prefetch
            stream.seek(0, 0, 0)
            r = batch_rate(batches, 200 if args.quick else 1000)  # 0.4M / 2M tokens
            res.add("batch_rate", f"streamed 1x, {label}, rank 0/2", r * g * seq, "tokens/s")
        print("4. training steps fed by the streamed 1x corpus: inline vs background tokenizer")
        waits = _streamed_steps(corpora[1], cache_dir, 20 if args.quick else 120)
        for label, (wait_ms, step_ms) in waits.items():
            res.add("train_streamed", f"tokenizing {label}: mean wait for data", wait_ms, "ms")
            res.add("train_streamed", f"tokenizing {label}: median step", step_ms, "ms")
    load = os.getloadavg()[0]
    res.add("load_average", "1-minute load average at the end (other processes)", load, "")
    res.write()
    return 0


def _streamed_steps(corpus: Path, cache_dir: str, steps: int) -> dict[str, tuple[float, float]]:
    """Training steps of tiny.yaml whose batches come from a streamed corpus, tokenized inline
    or by the background thread, the two runs interleaved step by step (a shared machine's
    load drifts): mean time the step waited for its batch, and median step time."""
    import statistics

    import torch
    import torch.nn.functional as F

    from moetrain.config import DataConfig, load_config
    from moetrain.data import PackedBatches, load_tokenizer
    from moetrain.model import build_model

    cfg = load_config(REPO / "configs" / "tiny.yaml", ["model.vocab_size=4096"])
    model = build_model(cfg.model, cfg.moe, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dcfg = DataConfig(
        dataset=str(corpus), cache_dir=cache_dir, seq_len=cfg.data.seq_len, streaming=True
    )
    tok = load_tokenizer("default", cache_dir)
    runs = {}
    for prefetch, label in ((0, "inline"), (4096, "in a background thread")):
        batches = PackedBatches(dcfg, tok, "train", cfg.train.global_batch_size, 8)
        batches.stream.source.prefetch = prefetch
        batches.stream.seek(0, 0, 0)
        runs[label] = (batches, [], [])
    for step in range(steps + 1):
        for batches, waits, times in runs.values():
            start = time.perf_counter()
            micro_batches = batches.next_step()
            waited = time.perf_counter() - start
            for mb in micro_batches:
                logits = model(mb["input_ids"])
                F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten()).backward()
            opt.step()
            opt.zero_grad()
            if step:  # the first step fills the shuffle buffer in both modes
                waits.append(waited)
                times.append(time.perf_counter() - start)
    return {
        label: (statistics.fmean(w) * 1e3, statistics.median(t) * 1e3)
        for label, (_, w, t) in runs.items()
    }


if __name__ == "__main__":
    sys.exit(main())
