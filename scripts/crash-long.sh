#!/usr/bin/env bash
# The extended crash run: kill -9 the server N times (default 50) under Step load from three
# schedulers, restarting it on the same data directory each time, then check that every
# acknowledged Step is there (tests/integration/test_crash_recovery.py).
#   bash scripts/crash-long.sh [KILLS]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup-env.sh dev
KVCM_CRASH_KILLS="${1:-50}" python -m pytest -q -s -p no:cacheprovider \
  tests/integration/test_crash_recovery.py
