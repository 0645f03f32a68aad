#!/usr/bin/env bash
# Make the Prometheus server and promtool available to kvcm's tests (Debian's `prometheus`
# package holds both). Idempotent: does nothing when both are already on PATH.
#
#   bash scripts/install-prometheus.sh
#
# Fails soft: when the binaries cannot be installed (no apt-get, no root and no sudo, no
# network), it says why and exits 0. The tests that need them then skip and name the reason,
# and every other test still runs.
set -uo pipefail

have_all() { command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; }

say() { echo "== install-prometheus: $*" >&2; }

if have_all; then
  say "prometheus and promtool already installed ($(promtool --version 2>&1 | head -n1))"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  say "apt-get not found; install Prometheus by hand (promtool + prometheus on PATH)."
  say "the Prometheus tests will be skipped"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  say "not root and no password-less sudo; run: sudo apt-get install -y prometheus"
  say "the Prometheus tests will be skipped"
  exit 0
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
say "installing Debian's prometheus package (promtool and the server)"
export DEBIAN_FRONTEND=noninteractive
# The package's service is not wanted here: the tests start their own server on a free port.
# Containers usually deny service starts already (policy-rc.d); elsewhere it may start one on
# :9090, which the tests do not use.
if ! "${as_root[@]}" apt-get install -y --no-install-recommends prometheus >"$log" 2>&1; then
  say "apt-get install failed; refreshing the package lists and trying once more"
  if ! { "${as_root[@]}" apt-get update >>"$log" 2>&1 &&
    "${as_root[@]}" apt-get install -y --no-install-recommends prometheus >>"$log" 2>&1; }; then
    say "could not install prometheus; the last lines apt-get printed:"
    tail -n 15 "$log" >&2
    say "the Prometheus tests will be skipped"
    exit 0
  fi
fi

if have_all; then
  say "installed $(promtool --version 2>&1 | head -n1)"
else
  say "the package installed but prometheus/promtool are not on PATH; the tests will skip"
fi
exit 0
