#!/usr/bin/env bash
# Set up everything kvcm's tests need and run the whole suite: lint, format check, type check,
# generated-code check, then pytest (unit, property, integration, and the differential tests
# against vLLM 0.33.0, which this script builds in its own environment beside kvcm's).
#
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -k hashing # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source scripts/setup-env.sh dev

# The behaviour reference. It lives in its own virtual environment (its pins differ from ours);
# the differential tests append its site-packages to the end of sys.path.
if [ -z "${KVCM_VLLM_SITE:-}" ]; then
  ref=""
  for candidate in ../shared/tools/vllm-reference/setup.sh shared/tools/vllm-reference/setup.sh; do
    if [ -f "$candidate" ]; then ref="$candidate"; break; fi
  done
  if [ -n "$ref" ]; then
    echo "== building the vLLM 0.33.0 reference (first run ~2 min)" >&2
    if site="$(bash "$ref")"; then
      export KVCM_VLLM_SITE="$site"
    else
      echo "!! the vLLM reference did not build; the compat tests will skip and say why" >&2
    fi
  else
    echo "!! no vllm-reference tool beside this checkout; the compat tests will skip" >&2
  fi
fi

# Prometheus (server + promtool) for the end-to-end metrics test and the deploy/ checks.
# Installs Debian's package where missing; fails soft (those tests then skip and say why).
bash scripts/install-prometheus.sh

# etcd (Debian's etcd-server) for the cluster tests: three `kvcm serve` replicas on one etcd.
# Installs it where missing; fails soft (those tests then skip and say why).
bash scripts/install-etcd.sh

# Chromium (Debian's package) for the inspector page's browser tests, driven by Playwright.
# Installs it where missing; fails soft (those tests then skip and say why).
bash scripts/install-chromium.sh

echo "== ruff" >&2
ruff check .
ruff format --check .
echo "== mypy (strict)" >&2
mypy core server client examples
if [ -x scripts/gen-proto.sh ]; then
  echo "== generated protobuf code is up to date" >&2
  bash scripts/gen-proto.sh --check
fi
echo "== the sync scheduler client is generated from the async one" >&2
python scripts/gen_sync_client.py --check
echo "== pytest" >&2
# A test skipped for a missing component (vLLM reference, etcd, Prometheus, Chromium) fails the
# run here (tests/conftest.py); KVCM_STRICT_SKIPS=0 lets it skip, as a plain `pytest` does.
export KVCM_STRICT_SKIPS="${KVCM_STRICT_SKIPS:-1}"
# Two workers (pytest-xdist; a file's tests stay together on one, so its module fixtures are
# built once): many tests wait on subprocesses, etcd leases and sleeps. KVCM_TEST_WORKERS=0 runs
# the suite in one process. The 20 slowest tests are listed at the end: the suite must stay well
# under CI's budget, and a clean run's log says where its time went.
python -m pytest -n "${KVCM_TEST_WORKERS:-2}" --dist loadfile --durations=20 "$@"
