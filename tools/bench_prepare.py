"""Preparation speed and memory: ``moetrain prepare-data`` against its peers, ids compared.

    python tools/bench_prepare.py                         # a 300 MB corpus, 2 workers
    python tools/bench_prepare.py --mb 30 --scales 1 4    # smaller, memory at 1x and 4x

Builds (once, cached under ``--work``) a JSON-lines corpus of ``--mb`` MB from the text every
Python installation carries (the standard library's sources and ``pydoc_data``'s language
reference, cut into documents; a few documents spell ``<|endoftext|>`` in their text, as
real corpora do) and a ``--vocab`` byte-level BPE trained on a sample of it. Then, in one run,
each peer tokenizes the corpus in its own process:

- ``moetrain prepare-data`` (``--workers`` processes; the engine it proves at start-up);
- HF ``datasets.map`` with the bare tokenizer (``num_proc`` = ``--workers``; what most
  training stacks run), the peer standing in for Megatron-LM's ``preprocess_data.py``, which
  needs Megatron's own packages;
- the bare tokenizer on one thread (``tokenizers``' ``encode_batch``, no parallelism): the
  speed of the tokenizer itself.

Reported per peer: wall seconds, CPU seconds (user + system of the process and its children),
tokens, tokens per CPU-second and the ratio to each peer, peak resident memory (the parent and,
for prepare-data, its largest worker), and whether the ids are identical to the bare
tokenizer's (every non-empty document's ids, compared as a multiset of per-document
digests: the prepared dataset holds out its eval documents in its own order). Literal
special tokens: the bare tokenizer encodes them as text, as prepare-data does by default; the
count of documents that spell one and the false boundaries the special-id encoding would make
are reported.
``--scales`` repeats prepare-data on the corpus repeated k times (memory must stay flat).
Rows are appended to ``docs/bench_prepare.csv``; ``docs/data.md`` quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CSV = REPO / "docs" / "bench_prepare.csv"
FIELDS = ["machine", "commit", "corpus_mb", "docs", "peer", "wall_s", "cpu_s", "tokens",
          "tokens_per_cpu_s", "peak_rss_mb", "worker_rss_mb", "ids_identical"]  # fmt: skip
EOT = "<|endoftext|>"


# ----------------------------------------------------------------------------- the corpus


def build_corpus(path: Path, mb: float) -> int:
    """JSON lines of the Python installation's text, ``mb`` MB; returns the documents."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    for f in sorted(stdlib.rglob("*.py")):
        if "site-packages" in f.parts or "test" in f.parts:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        # Documents of a few thousand characters: a file cut at blank lines.
        chunk: list[str] = []
        for para in text.split("\n\n"):
            chunk.append(para)
            if sum(len(c) for c in chunk) > 4000:
                texts.append("\n\n".join(chunk))
                chunk = []
        if chunk:
            texts.append("\n\n".join(chunk))
    want, written, n = int(mb * 1e6), 0, 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as out:
        epoch = 0
        while written < want:
            for text in texts:
                if n % 500 == 499:  # a literal special token in some documents' text
                    text = f"{text}\n# the model ends a document with {EOT} here\n"
                line = json.dumps({"text": f"# copy {epoch}\n{text}" if epoch else text}) + "\n"
                out.write(line)
                written += len(line.encode())
                n += 1
                if written >= want:
                    break
            epoch += 1
    os.replace(tmp, path)
    return n


def build_tokenizer(corpus: Path, path: Path, vocab: int) -> None:
    from moetrain.data.tokenizer import train_bpe

    def sample():
        with open(corpus) as f:
            for i, line in enumerate(f):
                if i >= 20_000:
                    return
                yield json.loads(line)["text"]

    path.write_text(train_bpe(sample(), vocab).to_str())


# ----------------------------------------------------------------------------- the peers

# The peer runs as __main__ behind a guard: worker processes started with spawn import the
# main module again, and must not run the peer themselves.
_MEASURE = textwrap.dedent(
    """
    import json, resource, sys, time
    if __name__ == "__main__":
        start = time.perf_counter()
        exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"))
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        print("MEASURE " + json.dumps({
            "wall_s": time.perf_counter() - start,
            "cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
            "peak_rss_mb": me.ru_maxrss / 1024, "worker_rss_mb": kids.ru_maxrss / 1024,
            **RESULT}))
    """
)

PREPARE = """
from moetrain.config import load_config
from moetrain.data.prepare import prepare_dataset
import numpy as np, hashlib, logging
logging.basicConfig(level=logging.INFO)
cfg = load_config(None, [f"data.dataset={CORPUS}", f"data.tokenizer={TOKENIZER}",
                         f"data.cache_dir={CACHE}"]).data
m = prepare_dataset(cfg, OUT, workers=WORKERS, progress=False)
digests, tokens = [], 0
for split in ("train", "eval"):
    for s in m.split(split)["shards"]:
        ids = np.fromfile(m.root / s["tokens"], m.data["dtype"])
        idx = np.fromfile(m.root / s["index"], "<i8")
        for a, b in zip(idx[:-1], idx[1:]):
            digests.append(hashlib.sha1(ids[a:b - 1].astype("<u4").tobytes()).hexdigest())
        tokens += len(ids)
RESULT = {"tokens": tokens, "digest": hashlib.sha1("".join(sorted(digests)).encode()).hexdigest()}
"""

DATASETS_MAP = """
import datasets, hashlib
from tokenizers import Tokenizer
datasets.disable_progress_bars()
tok = Tokenizer.from_file(TOKENIZER)
tok.encode_special_tokens = True
eos = tok.token_to_id("<|endoftext|>")
ds = datasets.load_dataset("json", data_files=CORPUS, split="train", cache_dir=CACHE + "/hf")
ds = ds.filter(lambda batch: [bool(t) for t in batch["text"]], batched=True)  # as prepare-data
def encode(batch):
    encoded = tok.encode_batch(batch["text"], add_special_tokens=False)
    return {"ids": [e.ids + [eos] for e in encoded]}
out = ds.map(encode, batched=True, num_proc=WORKERS, remove_columns=["text"])
digests, tokens = [], 0
for batch in out.iter(batch_size=10_000):
    for ids in batch["ids"]:
        import numpy as np
        digests.append(hashlib.sha1(np.asarray(ids[:-1], "<u4").tobytes()).hexdigest())
        tokens += len(ids)
RESULT = {"tokens": tokens, "digest": hashlib.sha1("".join(sorted(digests)).encode()).hexdigest()}
"""

BARE = """
import json, hashlib, os
import numpy as np
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer
tok = Tokenizer.from_file(TOKENIZER)
eos = tok.token_to_id("<|endoftext|>")
digests, tokens, spelled, false_ends, batch = [], 0, 0, 0, []
def flush(batch):
    global tokens
    tok.encode_special_tokens = True
    for e in tok.encode_batch(batch, add_special_tokens=False):
        digests.append(hashlib.sha1(np.asarray(e.ids, "<u4").tobytes()).hexdigest())
        tokens += len(e.ids) + 1
with open(CORPUS) as f:
    for line in f:
        text = json.loads(line)["text"]
        if not text:  # prepare-data leaves empty documents out
            continue
        if "<|endoftext|>" in text:
            spelled += 1
            tok.encode_special_tokens = False
            false_ends += tok.encode(text, add_special_tokens=False).ids.count(eos)
        batch.append(text)
        if len(batch) == 256:
            flush(batch); batch = []
flush(batch)
RESULT = {"tokens": tokens, "digest": hashlib.sha1("".join(sorted(digests)).encode()).hexdigest(),
          "spelled": spelled, "false_ends": false_ends}
"""


def run_peer(name: str, body: str, values: dict[str, object], work: Path) -> dict[str, object]:
    script = work / f"{name}.py"
    header = "".join(f"{k} = {v!r}\n" for k, v in values.items())
    script.write_text(header + body)
    measure = work / "measure.py"
    measure.write_text(_MEASURE)
    proc = subprocess.run([sys.executable, str(measure), str(script)], capture_output=True,
                          text=True, cwd=REPO)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MEASURE "))
    out = json.loads(line[len("MEASURE ") :])
    engine = next((x for x in proc.stderr.splitlines() if "tokenizing with" in x), "")
    if engine:
        out["engine"] = engine.split("tokenizing with ")[1].split(":")[0].split(" (")[0]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=300.0, help="corpus size (MB of JSON lines)")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--scales",
        type=int,
        nargs="+",
        default=[1],
        help="also prepare the corpus repeated k times (memory at k x)",
    )
    parser.add_argument(
        "--work", default=str(Path(tempfile.gettempdir()) / "moetrain-bench-prepare")
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"corpus-{args.mb:g}MB.jsonl"
    if not corpus.is_file():
        build_corpus(corpus, args.mb)
    tokenizer = work / f"bpe-{args.vocab}.json"
    if not tokenizer.is_file():
        build_tokenizer(corpus, tokenizer, args.vocab)
    n_docs = sum(1 for _ in open(corpus))
    machine = f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    rows = []
    results = {}
    for scale in sorted(set([1, *args.scales])):
        data = corpus
        if scale > 1:
            data = work / f"corpus-{args.mb:g}MB-x{scale}.jsonl"
            if not data.is_file():
                with open(data, "w") as out:
                    for _ in range(scale):
                        out.write(corpus.read_text())
        for name, body in (("prepare-data", PREPARE), ("datasets.map", DATASETS_MAP),
                           ("bare tokenizer, 1 thread", BARE)):  # fmt: skip
            if scale > 1 and name != "prepare-data":
                continue
            out_dir = work / f"prepared-{scale}-{time.time_ns()}"
            values = {"CORPUS": str(data), "TOKENIZER": str(tokenizer), "OUT": str(out_dir),
                      "CACHE": str(work / "cache"), "WORKERS": args.workers}  # fmt: skip
            r = run_peer(name.split(",")[0].replace(" ", "_").replace(".", "_"), body, values, work)
            subprocess.run(["rm", "-rf", str(out_dir), str(work / "cache" / "hf")], check=False)
            label = name if scale == 1 else f"{name} ({scale}x corpus)"
            results[label] = r
            print(f"{label:32s} {r['wall_s']:8.1f} s wall {r['cpu_s']:8.1f} CPU-s "
                  f"{r['tokens'] / 1e6:8.2f} M tokens {r['tokens'] / r['cpu_s'] / 1e6:6.2f} "
                  f"M tok/CPU-s  peak {r['peak_rss_mb']:7.0f} MB (workers {r['worker_rss_mb']:.0f})"
                  f" {r.get('engine', '')}")  # fmt: skip
    bare = results["bare tokenizer, 1 thread"]
    print(
        f"{bare['spelled']} documents spell {EOT}: {bare['false_ends']} false boundaries "
        "with the special-id encoding"
    )
    for label, r in results.items():
        rate = r["tokens"] / r["cpu_s"]
        for peer in ("datasets.map", "bare tokenizer, 1 thread"):
            if label.startswith("prepare-data"):
                other = results[peer]
                print(f"  {label} / {peer}: {rate / (other['tokens'] / other['cpu_s']):.2f}x "
                      "tokens per CPU-second")  # fmt: skip
        rows.append({
            "machine": machine, "commit": bc.git_commit(), "corpus_mb": args.mb, "docs": n_docs,
            "peer": label + (f" [{r['engine']}]" if "engine" in r else ""),
            "wall_s": round(r["wall_s"], 1), "cpu_s": round(r["cpu_s"], 1), "tokens": r["tokens"],
            "tokens_per_cpu_s": round(rate), "peak_rss_mb": round(r["peak_rss_mb"]),
            "worker_rss_mb": round(r["worker_rss_mb"]),
            "ids_identical": r["digest"] == bare["digest"] if "x corpus" not in label else "",
        })  # fmt: skip
    if not args.no_write:
        bc.append_rows(str(CSV), rows, FIELDS)
        print(f"appended {len(rows)} rows to {CSV}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
