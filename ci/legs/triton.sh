#!/usr/bin/env bash
# The triton leg: the shared Triton kernels (KV write, paged attention, split-KV) and the cuda/rocm
# platform logic, on CPU tensors through the Triton interpreter. Runs in the main environment.
#
#   bash ci/legs/triton.sh                 # ~1-2 min on 2 cores
#   PYTHON=/work/venv/bin/python bash ci/legs/triton.sh -k split
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-/work/venv/bin/python}"
[ -x "$PY" ] || PY=python3
# Must be set before any @triton.jit decorator runs, i.e. before the kernels are imported.
export TRITON_INTERPRET=1
"$PY" -c "import triton, numpy; print('triton leg: triton', triton.__version__, '(interpreter)')"
exec "$PY" -m pytest -q -p no:cacheprovider \
    tests/backends/test_triton_attention.py \
    tests/backends/test_cuda_rocm_platform.py \
    tests/backends/test_triton_e2e.py "$@"
