#!/usr/bin/env bash
# The ipex leg: the cpu backend's IPEX paged-attention path, in its own virtual environment.
#
# IPEX (intel-extension-for-pytorch) is no longer developed upstream after 2.8, so it pins its
# own torch: torch==2.8.0, intel-extension-for-pytorch==2.8.0, transformers<5 (IPEX's import fails
# with transformers>=5), numpy<2.4. About 4 GB to download the first time; reused afterwards.
#
#   bash ci/legs/ipex.sh            # build/reuse the venv, then run the IPEX tests
#   IPEX_VENV=/path bash ci/legs/ipex.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${IPEX_VENV:-$HOME/.cache/portside/venv-ipex}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import intel_extension_for_pytorch" 2>/dev/null; then
    echo "ipex leg: building $VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "torch==2.8.0" "intel-extension-for-pytorch==2.8.0" \
        "transformers>=4.57,<5" "numpy<2.4" "stevedore>=5.10" gguf pytest hypothesis psutil
fi
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . 2>/dev/null || "$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import torch, intel_extension_for_pytorch as ipex; print('ipex leg: torch', torch.__version__, 'ipex', ipex.__version__)"
PORTSIDE_REQUIRE_IPEX=1 exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/backends/test_ipex.py tests/backends/test_cpu_attention.py "$@"
