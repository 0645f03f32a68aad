#!/usr/bin/env bash
# Set up kvcm's runtime environment (once) and run it with its embedded defaults.
#   bash scripts/run.sh             # the demo: the allocation core on a shared-prefix workload
#   bash scripts/run.sh demo --help # any kvcm command and its flags
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup-env.sh
if [ "$#" -eq 0 ]; then set -- demo; fi
exec kvcm "$@"
