#!/usr/bin/env bash
# Set up kvcm's runtime environment (once) and run it with its embedded defaults.
#   bash scripts/run.sh               # the demo (examples/demo.py): start a server with its
#                                     # embedded defaults and drive it over gRPC
#   bash scripts/run.sh demo --help   # the demo's flags (--remote, --in-process, ...)
#   bash scripts/run.sh serve         # any other arguments: a kvcm command (`kvcm serve`)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup-env.sh
if [ "$#" -eq 0 ] || [ "$1" = demo ]; then
  [ "$#" -gt 0 ] && shift
  exec python examples/demo.py "$@"
fi
exec kvcm "$@"
