#!/usr/bin/env bash
# Make etcd available to kvcm's cluster tests (Debian's `etcd-server` package holds the
# `etcd` binary). Idempotent: does nothing when `etcd` is already on PATH.
#
#   bash scripts/install-etcd.sh
#
# Fails soft: when etcd cannot be installed (no apt-get, no root and no sudo, no network), it
# says why and exits 0. The cluster tests then skip and name the reason, and every other test
# still runs.
set -uo pipefail

say() { echo "== install-etcd: $*" >&2; }

if command -v etcd >/dev/null 2>&1; then
  say "etcd already installed ($(etcd --version 2>&1 | head -n1))"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  say "apt-get not found; install etcd (3.4 or later) by hand, \`etcd\` on PATH."
  say "the cluster tests will be skipped"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  say "not root and no password-less sudo; run: sudo apt-get install -y etcd-server"
  say "the cluster tests will be skipped"
  exit 0
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
say "installing Debian's etcd-server package"
export DEBIAN_FRONTEND=noninteractive
# The package's own service is not wanted: the tests start etcd on free ports in a temporary
# data directory. Containers usually deny service starts (policy-rc.d); elsewhere the package
# may start one on :2379, which the tests do not use.
if ! "${as_root[@]}" apt-get install -y --no-install-recommends etcd-server >"$log" 2>&1; then
  say "apt-get install failed; refreshing the package lists and trying once more"
  if ! { "${as_root[@]}" apt-get update >>"$log" 2>&1 &&
    "${as_root[@]}" apt-get install -y --no-install-recommends etcd-server >>"$log" 2>&1; }; then
    say "could not install etcd-server; the last lines apt-get printed:"
    tail -n 15 "$log" >&2
    say "the cluster tests will be skipped"
    exit 0
  fi
fi

if command -v etcd >/dev/null 2>&1; then
  say "installed $(etcd --version 2>&1 | head -n1)"
else
  say "the package installed but etcd is not on PATH; the cluster tests will skip"
fi
exit 0
