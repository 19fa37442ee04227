#!/usr/bin/env bash
# GPU checks for the cuda backend, for a lent NVIDIA machine (never CI). Under 10 minutes:
#   1. environment: torch with CUDA, triton, the project (installed without touching torch);
#   2. compiled Triton kernel tests (attention with its features, fused MoE) and cuda platform
#      tests (no TRITON_INTERPRET); then the quantized-linear kernels (int4/int8 dequant-GEMM,
#      FP8 and W8A8 on sm90's FP8 and int8 MMAs, CUDA-graph replay), in their own time budget;
#   3. CUDA-graph replay == eager == transformers, end to end (ci/bench/graph_replay_check.py);
#   4. decode-attention bandwidth, GB/s and % of peak (ci/bench/decode_attention_bw.py);
#   5. end-to-end throughput vs transformers (ci/bench/e2e_throughput.py).
#
#   bash ci/gpu_check.sh                 # OUT=dir keeps logs there (default: ./gpu-check-out)
# Offline machines: put wheels of missing packages (stevedore, gguf, ...) in .whl/; they are
# installed with --no-index into a private target. With network, a missing torch is installed
# as the pinned CUDA wheel (torch==2.14.1) and triton~=3.8.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-gpu-check-out}"
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
status=0
step() { echo; echo "=== $* ==="; }

step "1. environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no nvidia-smi"; exit 2; }
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/portside-site .whl/*.whl
    export PYTHONPATH="/tmp/portside-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)"; then
    "$PY" -m pip install -q "torch==2.14.1" "triton~=3.8" || { echo "no CUDA torch and none installable"; exit 2; }
fi
missing=$("$PY" - <<'PYEOF'
import importlib.util
need = ["triton", "transformers", "stevedore", "gguf", "safetensors", "tokenizers", "jinja2", "numpy", "pytest", "hypothesis"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PYEOF
)
if [ -n "$missing" ]; then
    echo "installing missing: $missing"
    "$PY" -m pip install -q $missing || echo "WARNING: could not install $missing (offline? carry wheels in .whl/)"
fi
# The project without its dependencies (so torch is never replaced); fall back to a path entry.
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
    echo "editable install failed (see $OUT/install.log); building into a private target"
    "$PY" -m pip install -q --no-deps --no-build-isolation --target /tmp/portside-site . || exit 2
    export PYTHONPATH="/tmp/portside-site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - <<'PYEOF' || exit 2
import torch, triton
from portside.backends.cuda.platform import CudaPlatform
a = CudaPlatform.is_available()
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "| cuda platform:", a.available, a.reason)
assert a, a.reason
print(CudaPlatform.device_info())
PYEOF

step "2. compiled kernel tests"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/backends/test_triton_attention.py \
    tests/backends/test_triton_moe.py tests/backends/test_cuda_rocm_platform.py 2>&1 | tee "$OUT/kernel_tests.log" || status=1
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/backends/test_triton_quant.py 2>&1 | tee "$OUT/quant_tests.log" || status=1

step "3. CUDA graph replay == eager"
timeout 120 "$PY" ci/bench/graph_replay_check.py 2>&1 | tee "$OUT/graph_check.log" || status=1

step "4. decode attention bandwidth"
timeout 90 "$PY" ci/bench/decode_attention_bw.py 2>&1 | tee "$OUT/decode_bw.jsonl" || status=1

step "5. end-to-end throughput vs transformers"
timeout 150 "$PY" ci/bench/e2e_throughput.py 2>&1 | tee "$OUT/e2e_throughput.json" || status=1

echo; echo "gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
