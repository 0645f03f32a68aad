#!/usr/bin/env bash
# Make a headless browser available to the inspector page's tests: Debian's `chromium`
# package (/usr/bin/chromium), driven by Playwright (pinned in the dev dependencies) without
# a browser download of its own. Idempotent: does nothing when chromium is already installed.
#
#   bash scripts/install-chromium.sh
#
# Fails soft: when chromium cannot be installed (no apt-get, no root and no sudo, no network),
# it says why and exits 0. The browser tests then skip and name the reason; every other test
# still runs.
set -uo pipefail

say() { echo "== install-chromium: $*" >&2; }

if [ -x /usr/bin/chromium ]; then
  say "chromium already installed ($(/usr/bin/chromium --version 2>/dev/null | head -n1))"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  say "apt-get not found; install chromium by hand (/usr/bin/chromium)."
  say "the browser tests will be skipped"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  say "not root and no password-less sudo; run: sudo apt-get install -y chromium"
  say "the browser tests will be skipped"
  exit 0
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
say "installing Debian's chromium package"
export DEBIAN_FRONTEND=noninteractive
if ! "${as_root[@]}" apt-get install -y --no-install-recommends chromium >"$log" 2>&1; then
  say "apt-get install failed; refreshing the package lists and trying once more"
  if ! { "${as_root[@]}" apt-get update >>"$log" 2>&1 &&
    "${as_root[@]}" apt-get install -y --no-install-recommends chromium >>"$log" 2>&1; }; then
    say "could not install chromium; the last lines apt-get printed:"
    tail -n 15 "$log" >&2
    say "the browser tests will be skipped"
    exit 0
  fi
fi

if [ -x /usr/bin/chromium ]; then
  say "installed $(/usr/bin/chromium --version 2>/dev/null | head -n1)"
else
  say "the package installed but /usr/bin/chromium is missing; the browser tests will skip"
fi
exit 0
