"""Preparation speed and memory: ``moetrain prepare-data`` against its peers, ids compared.

    python tools/bench_prepare.py --megatron ~/src/Megatron-LM   # 300 MB, Megatron-LM as a peer
    python tools/bench_prepare.py --mb 30 --scales 1 4            # smaller, memory at 1x and 4x
    python tools/bench_prepare.py --render                        # docs/data.md from the CSV only

Builds (once, cached under ``--work``) a JSON-lines corpus of ``--mb`` MB from the text every
Python installation carries (the standard library's sources cut into documents; a few
documents spell ``<|endoftext|>`` in their text, as real corpora do) and a ``--vocab``
byte-level BPE trained on a sample of it. Then, in one run, each peer tokenizes the corpus in
its own process, appending the end-of-document token to every document:

- ``moetrain prepare-data`` (``--workers`` processes; the engine it proves at start-up);
- Megatron-LM's ``tools/preprocess_data.py`` (``--workers`` processes, ``--append-eod``), run
  from the checkout ``--megatron`` names (with it on ``PYTHONPATH``, by ``--megatron-python``:
  Megatron-LM from core 0.17 needs Python 3.12 with torch, numpy and transformers). Its
  tokenizer is the same BPE as a Hugging Face tokenizer folder (``HuggingFaceTokenizer``:
  ``tokenizer.json`` and a ``tokenizer_config.json`` naming the end-of-text token and
  ``split_special_tokens``, so that special-token text in a document is encoded as text, as
  prepare-data does by default). Its ``.bin`` / ``.idx`` are read back with numpy. Without
  ``--megatron`` the peer is left out, and the rendered page says so;
- HF ``datasets.map`` with the bare tokenizer (``num_proc`` = ``--workers``; what most
  training stacks run);
- the bare tokenizer on one thread (``tokenizers``' ``encode_batch``, no parallelism): the
  speed of the tokenizer itself, and the reference ids.

Reported per peer: wall seconds and CPU seconds (user + system of the process and its
children) when its preparation is done (reading the ids back to compare them is not counted);
peak memory, sampled from /proc every quarter second until then: the largest peak resident set
among its processes (VmHWM; ``peak_rss_mb``) and the largest sum of their proportional set
sizes (shared pages counted once; ``peak_pss_mb``). Older rows have ``worker_rss_mb`` instead,
from ``getrusage``, which says little: a child started by fork and exec inherits its parent's
peak. Then tokens, tokens per CPU-second and ``prepare-data``'s ratio to each peer, and whether
the ids are identical to the bare tokenizer's (every non-empty document's ids without the
end-of-document token, compared as a multiset of per-document digests: the prepared dataset
holds out its eval documents in its own order). Literal special tokens: the count of documents
that spell one and the false boundaries the special-id encoding would make are reported.
``--scales`` repeats prepare-data on the corpus repeated k times (memory must stay flat; its
ids must be the reference's, k times each).

Rows are appended to ``docs/data/bench_prepare.csv``; the results block of ``docs/data.md`` is
written from the CSV's latest run (``--render`` rewrites it from the CSV alone, and
tests/tools/test_bench_prepare.py checks that the page says what the CSV holds).
"""

from __future__ import annotations

import argparse
import collections
import csv
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CSV = REPO / "docs" / "data" / "bench_prepare.csv"
PAGE = REPO / "docs" / "data.md"
FIELDS = ["run", "machine", "commit", "corpus_mb", "docs", "peer", "wall_s", "cpu_s", "tokens",
          "tokens_per_cpu_s", "peak_rss_mb", "worker_rss_mb", "peak_pss_mb", "ids_identical",
          "special_docs", "false_boundaries"]  # fmt: skip
EOT = "<|endoftext|>"
PREPARE = "prepare-data"
MEGATRON = "Megatron-LM preprocess_data.py"
DATASETS_MAP = "datasets.map"
BARE = "bare tokenizer, 1 thread"


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


def hf_tokenizer_dir(tokenizer: Path, out: Path) -> Path:
    """The BPE as the folder a Hugging Face ``AutoTokenizer`` (Megatron's
    ``HuggingFaceTokenizer``) loads: special-token text in a document encoded as text."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer, out / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT,
              "split_special_tokens": True, "model_max_length": 10**30}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# Megatron's indexed dataset (megatron/core/datasets/indexed_dataset.py): the .idx holds a
# header, a version, the token dtype's code, the sequence and document counts, then the
# sequence lengths (int32), the sequences' byte offsets (int64) and the document indices.
MEGATRON_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}


def read_megatron(prefix: str):
    """(token ids, per-document lengths) of Megatron's ``prefix.bin`` / ``prefix.idx``."""
    import numpy as np

    with open(prefix + ".idx", "rb") as f:
        head = f.read(34)
        if head[:9] != b"MMIDIDX\x00\x00" or int.from_bytes(head[9:17], "little") != 1:
            raise ValueError(f"{prefix}.idx: not a Megatron indexed dataset")
        dtype = MEGATRON_DTYPES[head[17]]
        n_seq = int.from_bytes(head[18:26], "little")
        n_doc = int.from_bytes(head[26:34], "little")
        seq_lens = np.fromfile(f, "<i4", n_seq)
        np.fromfile(f, "<i8", n_seq)  # byte offsets: the lengths say the same
        doc_index = np.fromfile(f, "<i8", n_doc)
    seq_ends = np.concatenate([[0], np.cumsum(seq_lens, dtype=np.int64)])
    doc_lens = np.diff(seq_ends[doc_index])  # one sequence per document unless split
    return np.fromfile(prefix + ".bin", dtype), doc_lens


# ----------------------------------------------------------------------------- the peers

# The peer runs as __main__ behind a guard: worker processes started with spawn import the
# main module again, and must not run the peer themselves. The peer calls prepared() when its
# preparation is done: what it does after (reading its ids back) is not measured.
_MEASURE = textwrap.dedent(
    """
    import json, resource, sys, time
    _measured = {}

    def prepared():
        open(PREPARED, "w").close()  # the parent stops sampling memory
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        _measured.update({
            "wall_s": time.perf_counter() - _start,
            "cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime})

    def write_digests(docs):
        # One sha1 per document (its ids without the end-of-document token, as <u4), sorted.
        import hashlib
        import numpy as np
        lines = sorted(hashlib.sha1(np.asarray(d, "<u4").tobytes()).hexdigest() for d in docs)
        with open(DIGESTS, "w") as f:
            f.write("\\n".join(lines))

    if __name__ == "__main__":
        _start = time.perf_counter()
        exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"))
        print("MEASURE " + json.dumps({**_measured, **RESULT}))
    """
)

PREPARE_BODY = """
from moetrain.config import load_config
from moetrain.data.prepare import prepare_dataset
import logging
logging.basicConfig(level=logging.INFO)
cfg = load_config(None, [f"data.dataset={CORPUS}", f"data.tokenizer={TOKENIZER}",
                         f"data.cache_dir={CACHE}"]).data
m = prepare_dataset(cfg, OUT, workers=WORKERS, progress=False)
prepared()
import numpy as np
def docs():
    for split in ("train", "eval"):
        for s in m.split(split)["shards"]:
            ids = np.fromfile(m.root / s["tokens"], m.data["dtype"])
            idx = np.fromfile(m.root / s["index"], "<i8")
            assert (ids[idx[1:] - 1] == m.tokenizer["eos_id"]).all()
            for a, b in zip(idx[:-1], idx[1:]):
                yield ids[a:b - 1]
write_digests(docs())
RESULT = {"tokens": sum(m.split(s)["n_tokens"] for s in ("train", "eval"))}
"""

MEGATRON_BODY = """
import os, subprocess
env = dict(os.environ)
env["PYTHONPATH"] = os.pathsep.join([MEGATRON, *filter(None, [env.get("PYTHONPATH")])])
os.makedirs(OUT)
proc = subprocess.run(
    [MEGATRON_PYTHON, os.path.join(MEGATRON, "tools", "preprocess_data.py"), "--input", CORPUS,
     "--output-prefix", os.path.join(OUT, "megatron"), "--tokenizer-type",
     "HuggingFaceTokenizer", "--tokenizer-model", HF_TOKENIZER, "--append-eod",
     "--workers", str(WORKERS)], env=env, capture_output=True, text=True)
prepared()
if proc.returncode:
    raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
import numpy as np
sys.path.insert(0, TOOLS)
from bench_prepare import read_megatron
ids, lens = read_megatron(os.path.join(OUT, "megatron_text_document"))
ends = np.cumsum(lens)[lens > 0]
from tokenizers import Tokenizer
assert (ids[ends - 1] == Tokenizer.from_file(TOKENIZER).token_to_id(EOT)).all()
write_digests(ids[e - n:e - 1] for e, n in zip(ends, lens[lens > 0]))
RESULT = {"tokens": int(lens.sum())}
"""

DATASETS_MAP_BODY = """
import datasets
from tokenizers import Tokenizer
datasets.disable_progress_bars()
tok = Tokenizer.from_file(TOKENIZER)
tok.encode_special_tokens = True
eos = tok.token_to_id(EOT)
ds = datasets.load_dataset("json", data_files=CORPUS, split="train", cache_dir=CACHE + "/hf")
ds = ds.filter(lambda batch: [bool(t) for t in batch["text"]], batched=True)  # as prepare-data
def encode(batch):
    encoded = tok.encode_batch(batch["text"], add_special_tokens=False)
    return {"ids": [e.ids + [eos] for e in encoded]}
out = ds.map(encode, batched=True, num_proc=WORKERS, remove_columns=["text"])
prepared()
tokens = 0
def docs():
    global tokens
    for batch in out.iter(batch_size=10_000):
        for ids in batch["ids"]:
            tokens += len(ids)
            yield ids[:-1]
write_digests(docs())
RESULT = {"tokens": tokens}
"""

# The reference: every document's ids kept as a digest while it runs (a few per cent of its
# time), and the literal special tokens counted.
BARE_BODY = """
import json, hashlib, os
import numpy as np
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer
tok = Tokenizer.from_file(TOKENIZER)
eos = tok.token_to_id(EOT)
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
        if EOT in text:
            spelled += 1
            tok.encode_special_tokens = False
            false_ends += tok.encode(text, add_special_tokens=False).ids.count(eos)
        batch.append(text)
        if len(batch) == 256:
            flush(batch); batch = []
flush(batch)
prepared()
with open(DIGESTS, "w") as f:
    f.write("\\n".join(sorted(digests)))
RESULT = {"tokens": tokens, "special_docs": spelled, "false_boundaries": false_ends}
"""


def tree_memory(pid: int) -> tuple[int, int]:
    """Memory of process ``pid`` and its descendants now, in bytes: the sum of their
    proportional set sizes (pages they share counted once) and the largest peak resident set
    (VmHWM) among them; zeros where /proc cannot say."""
    pss = hwm = 0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                pss += next(int(x.split()[1]) for x in f if x.startswith("Pss:")) * 1024
            with open(f"/proc/{p}/status") as f:
                hwm = max(hwm, next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) * 1024)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (OSError, StopIteration, ValueError):
            continue  # the process ended meanwhile
    return pss, hwm


def run_peer(name: str, body: str, values: dict[str, object], work: Path) -> dict[str, object]:
    """Run one peer in its own process; its measurements, and its digests under "digests"."""
    slug = re.sub(r"\W+", "_", name).strip("_")
    script = work / f"{slug}.py"
    flag = work / f"{slug}.prepared"
    flag.unlink(missing_ok=True)
    values = {**values, "EOT": EOT, "DIGESTS": str(work / f"{slug}.digests"),
              "PREPARED": str(flag), "TOOLS": str(Path(__file__).resolve().parent)}  # fmt: skip
    script.write_text("".join(f"{k} = {v!r}\n" for k, v in values.items()) + body)
    measure = work / "measure.py"
    measure.write_text(_MEASURE)
    with open(work / f"{slug}.out", "w+") as out_f, open(work / f"{slug}.err", "w+") as err_f:
        proc = subprocess.Popen([sys.executable, str(measure), str(script)], stdout=out_f,
                                stderr=err_f, text=True, cwd=REPO)  # fmt: skip
        peak_pss = peak_hwm = 0
        while proc.poll() is None:
            if not flag.exists():  # until the preparation is done
                pss, hwm = tree_memory(proc.pid)
                peak_pss, peak_hwm = max(peak_pss, pss), max(peak_hwm, hwm)
            time.sleep(0.25)
        out_f.seek(0), err_f.seek(0)
        stdout, stderr = out_f.read(), err_f.read()
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    line = next(x for x in stdout.splitlines() if x.startswith("MEASURE "))
    out = json.loads(line[len("MEASURE ") :])
    out["peak_pss_mb"], out["peak_rss_mb"] = peak_pss / 2**20, peak_hwm / 2**20
    engine = next((x for x in stderr.splitlines() if "tokenizing with" in x), "")
    if engine:
        out["engine"] = engine.split("tokenizing with ")[1].split(":")[0].split(" (")[0]
    out["digests"] = Path(values["DIGESTS"]).read_text().split("\n")
    return out


def _bench_common():
    """tools/bench_common.py, imported when called: it imports torch, which the measured
    children (they import this module for ``read_megatron``) must not load."""
    sys.path.insert(0, str(REPO / "tools"))
    import bench_common

    return bench_common


def megatron_commit(path: Path) -> str:
    return _bench_common().git_head(path, 8) or "a checkout without git"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def git_commit() -> str:
    return _bench_common().git_commit()


def append_rows(path: Path, rows: list[dict[str, object]]) -> None:
    """Append rows of FIELDS, rewriting a file of an older schema into this one first."""
    before: list[dict[str, object]] | None = None  # rows to rewrite in this schema
    if path.is_file() and path.stat().st_size:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != FIELDS:
                before = list(reader)
    fresh = before is not None or not path.is_file() or not path.stat().st_size
    with open(path, "w" if fresh else "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if fresh:
            writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in FIELDS} for r in [*(before or []), *rows])


# ----------------------------------------------------------------------------- the page


def read_rows(path: Path = CSV) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def latest_run(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The rows of the CSV's latest run (runs before the ``run`` column count as none)."""
    last = max((r["run"] for r in rows if r.get("run")), default=None)
    return [r for r in rows if last and r.get("run") == last]


def _scale(peer: str) -> str:
    found = re.search(r"\((\d+x) corpus\)", peer)
    return found.group(1) if found else "1x"


def _m(x: float) -> str:
    return f"{x / 1e6:.2f} M"


def render(rows: list[dict[str, str]]) -> str:
    """The results block of docs/data.md, from the rows of one run."""
    if not rows:
        raise ValueError("no run with a 'run' id in the CSV")
    first = rows[0]
    by_peer = {re.sub(r" \[.*\]$", "", r["peer"]): r for r in rows}
    prep = by_peer[PREPARE]
    rate = {k: int(r["tokens"]) / float(r["cpu_s"]) for k, r in by_peer.items()}
    lines = [
        f"Run {first['run']}, moetrain {first['commit']}: a {float(first['corpus_mb']):g} MB "
        f"corpus of {int(first['docs']):,} documents; {first['machine']}.",
        "",
        "| peer | tokens | wall s | CPU-s | tokens per CPU-second | prepare-data / this | "
        "peak memory: largest process / all processes | ids |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for peer, r in by_peer.items():
        engine = re.search(r"\[(.*)\]$", r["peer"])
        label = f"`{peer}`" + (f" ({engine.group(1)})" if engine else "")
        ratio = "" if peer.startswith(PREPARE) else f"{rate[PREPARE] / rate[peer]:.2f}x"
        ids = {"True": "identical", "False": "**differ**"}.get(r["ids_identical"], "")
        if peer == BARE:
            ids = "(reference)"
        lines.append(
            f"| {label} | {_m(int(r['tokens']))} | {float(r['wall_s']):.0f} | "
            f"{float(r['cpu_s']):.1f} | {_m(rate[peer])} | {ratio} | "
            f"{float(r['peak_rss_mb']):.0f} / {float(r['peak_pss_mb']):.0f} MB | {ids} |"
        )
    lines.append("")
    if MEGATRON not in by_peer:
        lines.append(
            "- Megatron-LM was not a peer in this run (the tool runs it with `--megatron PATH`)."
        )
    facts = [
        f"{rate[PREPARE] / rate[peer]:.2f}x `{peer}`'s"
        for peer in (MEGATRON, DATASETS_MAP, BARE)
        if peer in by_peer
    ]
    lines.append(f"- prepare-data's tokens per CPU-second: {', '.join(facts)}.")
    if all(r["ids_identical"] == "True" for p, r in by_peer.items() if p != BARE):
        lines.append("- Every peer's ids are the bare tokenizer's, document for document.")
    scaled = [r for p, r in by_peer.items() if p.startswith(f"{PREPARE} (")]
    if scaled:
        peaks = "; ".join(
            f"{float(r['peak_rss_mb']):.0f} / {float(r['peak_pss_mb']):.0f} MB at "
            f"{_scale(r['peer'])}"
            for r in [prep, *scaled]
        )
        lines.append(f"- prepare-data's peak memory, largest process / all processes: {peaks}.")
    if by_peer.get(BARE, {}).get("special_docs"):
        lines.append(
            f"- {by_peer[BARE]['special_docs']} documents spell `{EOT}` in their text: "
            f"{by_peer[BARE]['false_boundaries']} false document boundaries with the "
            "special-id encoding; every peer here encodes them as text."
        )
    return "\n".join(lines)


BEGIN = "<!-- bench_prepare: written from docs/data/bench_prepare.csv by tools/bench_prepare.py -->"
END = "<!-- /bench_prepare -->"


def page_block(text: str) -> str:
    """The results block of a page's text (between BEGIN and END)."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n")


def write_page(page: Path = PAGE, csv_path: Path = CSV) -> None:
    text = page.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    block = render(latest_run(read_rows(csv_path)))
    page.write_text(text[:start] + "\n" + block + "\n" + text[end:])


# ----------------------------------------------------------------------------- the run


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
        "--megatron", metavar="PATH", help="a Megatron-LM checkout: run its preprocess_data.py"
    )
    parser.add_argument(
        "--megatron-python",
        default=sys.executable,
        help="the Python that runs Megatron-LM (default: this one)",
    )
    parser.add_argument(
        "--work", default=str(Path(tempfile.gettempdir()) / "moetrain-bench-prepare")
    )
    parser.add_argument(
        "--csv", default=str(CSV), help="results file (docs/data.md is rewritten from the default)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite docs/data.md's block from the CSV"
    )
    args = parser.parse_args(argv)
    if args.render:
        write_page()
        print(page_block(PAGE.read_text()))
        return 0
    megatron = Path(args.megatron).expanduser().resolve() if args.megatron else None
    if megatron and not (megatron / "tools" / "preprocess_data.py").is_file():
        parser.error(f"--megatron: {megatron} has no tools/preprocess_data.py")

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / f"corpus-{args.mb:g}MB.jsonl"
    if not corpus.is_file():
        build_corpus(corpus, args.mb)
    tokenizer = work / f"bpe-{args.vocab}.json"
    if not tokenizer.is_file():
        build_tokenizer(corpus, tokenizer, args.vocab)
    hf_dir = hf_tokenizer_dir(tokenizer, work / f"hf-bpe-{args.vocab}")
    n_docs = sum(1 for _ in open(corpus))
    run = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    commit = git_commit()  # the code that runs (the checkout may move on during the run)
    load_start = os.getloadavg()[0]
    peers = [(PREPARE, PREPARE_BODY)]
    if megatron:
        peers.append((MEGATRON, MEGATRON_BODY))
    peers += [(DATASETS_MAP, DATASETS_MAP_BODY), (BARE, BARE_BODY)]
    results: dict[str, dict[str, object]] = {}
    for scale in sorted(set([1, *args.scales])):
        data = corpus
        if scale > 1:
            data = work / f"corpus-{args.mb:g}MB-x{scale}.jsonl"
            if not data.is_file():
                with open(data, "w") as out:
                    for _ in range(scale):
                        out.write(corpus.read_text())
        for name, body in peers:
            if scale > 1 and name != PREPARE:
                continue
            out_dir = work / f"prepared-{scale}-{time.time_ns()}"
            values = {"CORPUS": str(data), "TOKENIZER": str(tokenizer), "OUT": str(out_dir),
                      "CACHE": str(work / "cache"), "WORKERS": args.workers,
                      "MEGATRON": str(megatron), "MEGATRON_PYTHON": args.megatron_python,
                      "HF_TOKENIZER": str(hf_dir)}  # fmt: skip
            r = run_peer(name, body, values, work)
            shutil.rmtree(out_dir, ignore_errors=True)
            shutil.rmtree(work / "cache" / "hf", ignore_errors=True)
            label = name if scale == 1 else f"{name} ({scale}x corpus)"
            if name == MEGATRON:
                r["engine"] = f"{megatron_commit(megatron)}, HuggingFaceTokenizer"
            r["scale"] = scale
            results[label] = r
            print(f"{label:32s} {r['wall_s']:8.1f} s wall {r['cpu_s']:8.1f} CPU-s "
                  f"{r['tokens'] / 1e6:8.2f} M tokens {r['tokens'] / r['cpu_s'] / 1e6:6.2f} "
                  f"M tok/CPU-s  peak {r['peak_rss_mb']:6.0f} MB (all {r['peak_pss_mb']:.0f})"
                  f" {r.get('engine', '')}", flush=True)  # fmt: skip
    reference = collections.Counter(results[BARE]["digests"])
    machine = (f"{cpu_model()}, {os.cpu_count()} cores, load {load_start:.1f} to "
               f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    rows = []
    for label, r in results.items():
        want = collections.Counter({d: n * r["scale"] for d, n in reference.items()})
        rows.append({
            "run": run, "machine": machine, "commit": commit, "corpus_mb": args.mb,
            "docs": n_docs, "peer": label + (f" [{r['engine']}]" if "engine" in r else ""),
            "wall_s": round(r["wall_s"], 1), "cpu_s": round(r["cpu_s"], 1), "tokens": r["tokens"],
            "tokens_per_cpu_s": round(r["tokens"] / r["cpu_s"]),
            "peak_rss_mb": round(r["peak_rss_mb"]), "peak_pss_mb": round(r["peak_pss_mb"]),
            "ids_identical": collections.Counter(r["digests"]) == want,
            "special_docs": r.get("special_docs", ""),
            "false_boundaries": r.get("false_boundaries", ""),
        })  # fmt: skip
    print(render([{k: str(v) for k, v in row.items()} for row in rows]))
    if not args.no_write:
        append_rows(Path(args.csv), rows)
        print(f"appended {len(rows)} rows to {args.csv}")
        if Path(args.csv).resolve() == CSV.resolve():
            write_page()
            print(f"rewrote the results in {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
