#!/usr/bin/env bash
# The xla leg: the tpu platform (backends/xla) proven on torch-xla's PJRT CPU device.
#
# Its own virtual environment, because torch-xla needs its own torch: torch==2.9.1 with
# torch-xla==2.9.0 and numpy<2.4. torch-xla declares no torch pin, so a constraints file pins
# torch for every install here (the project's `torch>=2.8,<2.15` would otherwise upgrade it and
# torch_xla would fail at import). First run: ~4 GB download, ~5 minutes; later runs reuse the
# venv when its pins match.
#
#   ci/legs/xla.sh                 # create/reuse $XLA_VENV (default /work/venv-xla), run the tests
#   XLA_VENV=/tmp/v ci/legs/xla.sh -k parity    # extra arguments go to pytest
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${XLA_VENV:-/work/venv-xla}"
PY="$VENV/bin/python"
TORCH_PIN="2.9.1"
XLA_PIN="2.9.0"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
cat > "$CONSTRAINTS" <<EOF
torch==$TORCH_PIN
torch-xla==$XLA_PIN
numpy<2.4
EOF

pins_match() {
    [ -x "$PY" ] && "$PY" - "$TORCH_PIN" "$XLA_PIN" <<'EOF'
import importlib.metadata as md, sys
want_torch, want_xla = sys.argv[1], sys.argv[2]
try:
    ok = (md.version("torch").split("+")[0] == want_torch and md.version("torch-xla") == want_xla
          and tuple(int(x) for x in md.version("numpy").split(".")[:2]) < (2, 4)
          and md.version("transformers") and md.version("pytest") and md.version("portside"))
except md.PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
EOF
}

start=$(date +%s)
if pins_match; then
    echo "xla leg: reusing $VENV (torch $TORCH_PIN, torch-xla $XLA_PIN)"
    # portside must be this checkout's (editable): reinstall it alone when it points elsewhere
    if ! (cd /tmp && "$PY" -c "import sys, portside; sys.exit(not portside.__file__.startswith('$ROOT/'))" 2>/dev/null); then
        "$VENV/bin/pip" install -q --no-deps -e "$ROOT" >/dev/null
    fi
else
    echo "xla leg: creating $VENV (torch $TORCH_PIN, torch-xla $XLA_PIN; ~4 GB download)"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -c "$CONSTRAINTS" "torch==$TORCH_PIN" "torch-xla==$XLA_PIN" "numpy<2.4"
    # transformers 5.x needs torch>=2.6: fine with 2.9; the constraints keep torch where it is
    "$VENV/bin/pip" install -q -c "$CONSTRAINTS" -e "$ROOT[test]"
fi
"$PY" -c "import torch, torch_xla; print('xla leg: torch', torch.__version__, 'torch-xla', torch_xla.__version__)" 2>&1 | grep -v '^WARNING'
echo "xla leg: setup $(( $(date +%s) - start )) s"

cd "$ROOT"
export PJRT_DEVICE=CPU   # torch-xla's CPU device stands in for a TPU
echo "--- portside devices (PJRT_DEVICE=CPU) ---"
"$PY" -m portside.cli devices
echo "--- pytest tests/backends/test_xla.py ---"
"$PY" -m pytest tests/backends/test_xla.py -q -p no:cacheprovider "$@"
