"""What machine and torch build a run or a test session used, in a few lines.

    python tools/machine_info.py

Numerics differ between CPUs: an AVX2 CPU's BLAS and inductor kernels sum in other blocks
than an AVX-512 one's (docs/parallel.md, "Past those tolerances, step by step";
docs/attention.md, FlexAttention on a CPU). CI prints this before the tests, so that a
failure can be matched to the machine it ran on; attach it to a bug report.
"""

from __future__ import annotations

import argparse
import os
import platform
import re


def cpu_lines() -> list[str]:
    """The CPU model, core count and its vector instruction sets (from /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), []
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("", platform.machine()):
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value.split()
    simd = sorted(f for f in flags if re.match(r"(avx|amx|fma|sse4|neon|sve)", f))
    return [
        f"machine: {model}; {os.cpu_count()} CPUs; {platform.platform()}; "
        f"Python {platform.python_version()}",
        f"CPU vector flags: {' '.join(simd) or 'not reported'}",
    ]


def torch_lines() -> list[str]:
    """torch's version, CPU capability, threads, BLAS/oneDNN and inductor's vector ISA."""
    import torch

    lines = [
        f"torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads, MKL {torch.backends.mkl.is_available()}, "
        f"oneDNN {torch.backends.mkldnn.is_available()}, CUDA {torch.cuda.is_available()}"
    ]
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        lines.append(f"inductor CPU vector ISA: {pick_vec_isa() or 'none'}")
    except Exception as exc:  # an inductor without it: say so, do not fail the report
        lines.append(f"inductor CPU vector ISA: unknown ({type(exc).__name__})")
    try:
        import triton

        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton: not installed")
    lines += torch.__config__.show().strip().splitlines()
    return lines


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    for line in cpu_lines() + torch_lines():
        print(f"== {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
