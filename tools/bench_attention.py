"""Masked attention: SDPA with an explicit mask against FlexAttention, per document.

    python tools/bench_attention.py                      # CPU or the GPU there is
    python tools/bench_attention.py --seq 512 1024 --docs 8

For each sequence length, packed sequences of ``--docs`` documents of random lengths run
forward and backward through ``moetrain.model.masks.attend`` under the document mask with each
backend -- ``sdpa`` (an explicit boolean mask) and ``flex`` (a compiled FlexAttention block
mask) -- and plain causal SDPA (``is_causal``, what attention costs without the mask) as the
peer, all in one run. Reported: milliseconds per forward and per forward + backward (the
median of ``--repeats``, after a warm-up that includes the compile), the ratios to causal
SDPA, and the largest difference of the outputs from SDPA's. FlexAttention has no backward on
CPU: its forward + backward is left empty there. Rows are appended to
``docs/data/attention_bench.csv`` (machine, commit, shapes, figures); ``docs/attention.md``
quotes them. With ``--csv PATH`` the
same figures go to PATH in the benchmarks' common schema instead (the GPU suite's part
``attention``), each backend's ``ratio_peer`` against causal SDPA.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import torch

from moetrain.model.masks import AttentionMask, attend, document_ids

CSV = Path(__file__).resolve().parent.parent / "docs" / "data" / "attention_bench.csv"
FIELDS = ["machine", "commit", "batch", "heads", "head_dim", "seq", "docs", "backend",
          "ms_fwd", "fwd_vs_causal_sdpa", "ms_fwd_bwd", "fwd_bwd_vs_causal_sdpa",
          "max_abs_diff"]  # fmt: skip


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def _documents(B: int, S: int, n_docs: int, gen: torch.Generator) -> torch.Tensor:
    ends = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        cuts = torch.randperm(S - 1, generator=gen)[: n_docs - 1]
        ends[b, cuts] = True
    return document_ids(ends)


def _time(fn, repeats: int) -> float:
    fn()  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def run(args: argparse.Namespace, device: torch.device) -> list[dict[str, object]]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    rows = []
    for S in args.seq:
        B, H, D = args.batch, args.heads, args.head_dim
        q, k, v = (torch.randn(B, S, H, D, generator=gen).to(device, dtype) for _ in range(3))
        docs = _documents(B, S, args.docs, gen).to(device)
        masks = {
            "causal sdpa (no document mask)": AttentionMask.causal(),
            "sdpa": AttentionMask.causal(backend="sdpa").with_documents(docs),
            "flex": AttentionMask.causal(backend="flex").with_documents(docs),
        }
        reference = attend(q, k, v, None, masks["sdpa"]).float()
        results = {}
        for name, mask in masks.items():

            def step(mask=mask, backward=True, qkv=(q, k, v)):
                qq, kk, vv = (t.detach().requires_grad_(backward) for t in qkv)
                # A fresh mask object per call: the dense or block mask is built every step,
                # as the model builds one per forward.
                fresh = AttentionMask(mask.q_pos, mask.kv_len, mask.docs_BS, mask.window,
                                      mask.backend)  # fmt: skip
                out = attend(qq, kk, vv, None, fresh)
                if backward:
                    out.float().sum().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                return out

            fwd = _time(lambda step=step: step(backward=False), args.repeats)
            no_backward = mask.backend == "flex" and device.type == "cpu"
            both = None if no_backward else _time(step, args.repeats)
            diff = float((attend(q, k, v, None, mask).float() - reference).abs().max())
            results[name] = (fwd, both, diff)
        base_fwd, base_both, _ = results["causal sdpa (no document mask)"]
        for name, (fwd, both, diff) in results.items():
            row = {"machine": _machine(device), "commit": bc.git_commit(), "batch": B, "heads": H,
                   "head_dim": D, "seq": S, "docs": args.docs, "backend": name,
                   "ms_fwd": round(fwd, 2), "fwd_vs_causal_sdpa": round(fwd / base_fwd, 3),
                   "ms_fwd_bwd": "" if both is None else round(both, 2),
                   "fwd_bwd_vs_causal_sdpa": "" if both is None else round(both / base_both, 3),
                   "max_abs_diff": "" if name.startswith("causal") else f"{diff:.1e}"}  # fmt: skip
            rows.append(row)
            both_ms, both_x = row["ms_fwd_bwd"] or "-", row["fwd_bwd_vs_causal_sdpa"] or "-"
            print(
                f"S={S:5d} {name:32s} fwd {fwd:9.2f} ms (x{fwd / base_fwd:5.2f})  "
                f"fwd+bwd {both_ms:>9} ms (x{both_x})  max diff {row['max_abs_diff']}"
            )
    return rows


def suite_rows(rows: list[dict[str, object]], device: torch.device) -> bc.Results:
    """The same figures in the benchmarks' common schema (``bench_common.CSV_FIELDS``), for
    the GPU suite's results file: one row per backend and pass, ``ratio_peer`` against
    causal SDPA measured in the same run."""
    results = bc.Results("attention", device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for r in rows:
        case = f"S{r['seq']} docs{r['docs']} B{r['batch']} H{r['heads']} D{r['head_dim']}"
        impl = "causal_sdpa" if str(r["backend"]).startswith("causal") else str(r["backend"])
        for op, ms in (("fwd", r["ms_fwd"]), ("fwd_bwd", r["ms_fwd_bwd"])):
            if ms == "":
                continue
            diff = r["max_abs_diff"]
            results.add(case=case, routing="documents", dtype=dtype, op=op, impl=impl,
                        ms=float(ms), value=None if diff == "" else float(diff),
                        unit="" if diff == "" else "max_abs_diff vs sdpa")  # fmt: skip
    for r in results.rows:
        if r["impl"] != "causal_sdpa":
            results.ratio(r["case"], r["routing"], r["op"], r["impl"], "causal_sdpa", record=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="small shapes, 1 repeat (smoke)")
    parser.add_argument(
        "--csv",
        default=None,
        help="write the rows in the benchmarks' common schema to this file (the GPU suite's "
        "results) instead of docs/data/attention_bench.csv",
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--docs", type=int, default=8, help="documents per sequence")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.repeats, args.batch, args.heads = [64], 1, 1, 2
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available")
    device = torch.device(args.device)
    rows = run(args, device)
    if args.csv:
        suite_rows(rows, device).write(args.csv, append=True)
    elif not args.no_write:
        bc.append_rows(str(CSV), rows, FIELDS)
        print(f"appended {len(rows)} rows to {CSV}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
