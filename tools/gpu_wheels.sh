#!/usr/bin/env bash
# For a GPU machine without network access: fetch, on a machine where pip reaches a registry,
# what the GPU suite needs beyond torch, triton and the usual scientific stack, into .whl/
# (git-ignored); copy .whl/ into the checkout on the GPU machine. tools/gpu_suite.sh installs
# the wheels there with --no-index --no-deps, and only when `import datasets` fails.
#
#   bash tools/gpu_wheels.sh          # datasets + dill + multiprocess, grouped_gemm sdist
#
# - datasets and two of its dependencies a bare CUDA image often lacks (dill, multiprocess),
#   as manylinux x86_64 wheels for CPython PYTHON_VERSION (default 3.12): the rest of its
#   requirements (pyarrow, fsspec, pandas, huggingface-hub, xxhash, ...) are expected there.
#   Versions: what this checkout is tested with; override with DATASETS=... DILL=...
#   MULTIPROCESS=....
# - grouped_gemm (MegaBlocks' grouped GEMM): PyPI has no wheel of it for any Python or
#   torch, only a source distribution (with CUTLASS headers inside), so the suite can build
#   it on the GPU machine (part "peer"). pip must run a package's setup.py even to download
#   it, and this one asks torch for a GPU: a three-line stub torch answers for it here.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PY=${PYTHON:-python3}
DATASETS=${DATASETS:-5.2.0}
DILL=${DILL:-0.4.1}
MULTIPROCESS=${MULTIPROCESS:-0.70.19}
GROUPED_GEMM=${GROUPED_GEMM:-0.3.0}

git check-ignore -q .whl/ || { echo "refusing: .whl/ is not git-ignored here"; exit 1; }
mkdir -p .whl
rm -f .whl/*.whl .whl/*.tar.gz  # one version of each: two would stop the whole install

"$PY" -m pip download --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl \
    "datasets==$DATASETS" "dill==$DILL" "multiprocess==$MULTIPROCESS"

if [ "${SKIP_GROUPED_GEMM:-0}" = "0" ]; then
    stub=$(mktemp -d)
    trap 'rm -rf "$stub"' EXIT
    mkdir -p "$stub/torch/utils"
    printf 'class cuda:\n    @staticmethod\n    def get_device_capability(*a):\n        return (9, 0)\n' \
        >"$stub/torch/__init__.py"
    : >"$stub/torch/utils/__init__.py"
    printf 'from setuptools import Extension\nfrom setuptools.command.build_ext import build_ext as BuildExtension\ndef CUDAExtension(name, sources, **kw):\n    return Extension(name, sources)\n' \
        >"$stub/torch/utils/cpp_extension.py"
    PYTHONPATH="$stub" "$PY" -m pip download --no-deps --no-binary=:all: --no-build-isolation \
        -d .whl "grouped_gemm==$GROUPED_GEMM" \
        || echo "WARNING: grouped_gemm sdist not fetched: the MegaBlocks peer will be absent"
fi

ls -la .whl
du -sh .whl
for w in .whl/*.whl; do
    echo "$w requires (extras skipped):"
    unzip -p "$w" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed 's/^/    /'
done
