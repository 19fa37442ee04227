#!/usr/bin/env bash
# The ipex leg, as defined in ci/legs.toml (pins, environment, test selection): a thin wrapper
# over ci/run-leg that reuses the leg's venv when its pins have not changed.
#   bash ci/legs/ipex.sh [-- PYTEST_ARGS...]
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 ci/run-leg ipex --reuse "$@"
