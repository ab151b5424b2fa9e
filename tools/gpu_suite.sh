#!/usr/bin/env bash
# The GPU suite in one command, on any CUDA machine: every correctness check and benchmark of
# the kernels and of training, as timed parts, their CSV rows and logs under $OUT (see
# docs/gpu.md and docs/benchmarks.md, "Running the GPU suite").
#
#   bash tools/gpu_suite.sh                          # every part, within BUDGET seconds
#   PARTS=tests,tiny,gemm bash tools/gpu_suite.sh    # some parts (tools/gpu_suite.py --help)
#   DRY=1 bash tools/gpu_suite.sh                    # CPU dry run: tiny shapes, interpreter
#
# Environment: OUT (results folder; default a new temporary one, named at the end), PARTS
# (comma-separated, default all but peer), BUDGET (seconds for all parts, default: the
# parts' own budgets added up, under ten minutes), DRY=1 (CPU),
# MOETRAIN_COMMIT (the commit the tree is at, for a copy without .git), PYTHON.
#
# Set-up, installing nothing that is already there:
# - moetrain: the package maps kernels/ to moetrain.kernels (pyproject package-dir), so the
#   tree cannot simply go on PYTHONPATH. A shim folder gets a `moetrain` directory of
#   symlinks to every entry of moetrain/ plus `kernels` -> kernels/, and goes first on
#   PYTHONPATH: the working tree's code runs, nothing is built, no pip, no network. (An
#   installed moetrain elsewhere is shadowed, since path entries precede site-packages.)
#   PYTHONSAFEPATH=1 keeps `python -m pytest` from putting the repo root first on sys.path,
#   where moetrain/ would be found without its kernels.
# - datasets, dill, multiprocess, for a machine without network access: if `import datasets`
#   fails and .whl/ holds wheels (tools/gpu_wheels.sh fetches them on a machine with network;
#   copy .whl/ along), they are installed with --no-index --no-deps into /tmp/moetrain_site,
#   which joins PYTHONPATH.
# - MegaBlocks' grouped_gemm: no wheel exists; if .whl/ holds its sdist, tools/gpu_suite.py
#   builds it in the background (part "peer", when PARTS names it) into /tmp/moetrain_peer.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PY=${PYTHON:-python3}
# Outside the tree by default: results are not part of the checkout.
OUT=${OUT:-$(mktemp -d /tmp/moetrain_gpu_out.XXXXXX)}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/moetrain_suite.XXXXXX)
mkdir -p "$WORK/logs"
LOG="$OUT/suite.log"
: >"$LOG"

export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1

setup() {
    echo "== gpu_suite set-up $(date -u +%FT%TZ) in $REPO"
    local shim="$WORK/shim/moetrain" f
    mkdir -p "$shim"
    for f in "$REPO"/moetrain/*; do ln -s "$f" "$shim/"; done
    ln -sfn "$REPO/kernels" "$shim/kernels"
    export PYTHONPATH="$WORK/shim${PYTHONPATH:+:$PYTHONPATH}"

    local site=/tmp/moetrain_site
    [ -d "$site" ] && export PYTHONPATH="$PYTHONPATH:$site"
    if "$PY" -c "import datasets" 2>/dev/null; then
        echo "datasets: already importable, nothing installed"
    elif compgen -G ".whl/*.whl" >/dev/null; then
        echo "datasets: missing; installing the wheels in .whl/: $(cd .whl && echo *.whl)"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" .whl/*.whl || echo "WARNING: wheel install failed"
        case ":$PYTHONPATH:" in *":$site:"*) ;; *) export PYTHONPATH="$PYTHONPATH:$site" ;; esac
        "$PY" -c "import datasets; print('datasets', datasets.__version__, 'from', datasets.__file__)" \
            || echo "WARNING: datasets still does not import: training parts will fail"
    else
        echo "WARNING: datasets missing and no .whl/ (pip install datasets, or tools/gpu_wheels.sh elsewhere and copy .whl/)"
    fi

    "$PY" - <<'EOF'
import importlib, os, platform, sys
import torch
print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.1f} GiB",
          p.multi_processor_count, "SMs")
for name in ("triton", "datasets", "pyarrow", "fsspec", "huggingface_hub", "tokenizers",
             "numpy", "setuptools", "grouped_gemm"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as exc:
        print(name, "MISSING", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
import moetrain, moetrain.kernels
kernels = os.path.realpath(os.path.dirname(moetrain.kernels.__file__))
print("moetrain from", os.path.dirname(moetrain.__file__), "kernels from", kernels)
if kernels != os.path.realpath("kernels"):
    sys.exit(f"moetrain.kernels comes from {kernels}, not this tree's kernels/")
EOF
    [ $? -eq 0 ] || { echo "FATAL: moetrain does not import from this tree"; return 1; }
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,temperature.gpu --format=csv
    return 0
}

setup 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || { rm -rf "$WORK"; exit 2; }
# The exports made inside the piped function do not reach this shell: set them again.
export PYTHONPATH="$WORK/shim${PYTHONPATH:+:$PYTHONPATH}"
[ -d /tmp/moetrain_site ] && export PYTHONPATH="$PYTHONPATH:/tmp/moetrain_site"

ARGS=(--out "$OUT" --work "$WORK")
[ -n "${BUDGET:-}" ] && ARGS+=(--budget "$BUDGET")
[ -n "${PARTS:-}" ] && ARGS+=(--parts "$PARTS")
[ "${DRY:-0}" != "0" ] && ARGS+=(--dry)
"$PY" tools/gpu_suite.py "${ARGS[@]}"
rc=$?
rm -rf "$WORK"
echo "outputs in $OUT"
exit $rc
