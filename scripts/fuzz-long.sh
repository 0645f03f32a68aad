#!/usr/bin/env bash
# The long run of the wire fuzzer (tests/integration/test_wire_fuzz.py): many more Hypothesis
# examples than CI runs, counting every distinct failure instead of stopping at the first, then
# a summary: calls made, rejections, state changes after a rejection, INTERNAL/UNKNOWN answers,
# mismatches with the in-process core, and the shortest repro of each distinct failure.
# The report is also rewritten every 50 examples, so a run cut short (Ctrl-C) still has one.
#
#   bash scripts/fuzz-long.sh              # 100000 examples per fuzz test
#   bash scripts/fuzz-long.sh 5000         # fewer
#   KVCM_FUZZ_CALLS=30 bash scripts/fuzz-long.sh   # longer call sequences per example
#   KVCM_FUZZ_SEED=2 KVCM_FUZZ_REPORT=/tmp/shard2.json bash scripts/fuzz-long.sh  # a shard
#
# Then the HTTP fuzzer (tests/integration/test_http_fuzz.py: raw bytes, mangled JSON and raw
# headers at every route with tokens on) runs KVCM_HTTP_FUZZ_EXAMPLES examples (default: a
# tenth of the wire fuzzer's; about 45 ms each); its failures fail the script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source .venv/bin/activate

examples="${1:-100000}"
report="${KVCM_FUZZ_REPORT:-$(mktemp -t kvcm-fuzz-XXXXXX.json)}"
status=0
KVCM_FUZZ_EXAMPLES="$examples" KVCM_FUZZ_COLLECT=1 KVCM_FUZZ_REPORT="$report" \
  python -m pytest -q -p no:cacheprovider ${KVCM_FUZZ_SEED:+--hypothesis-seed="$KVCM_FUZZ_SEED"} \
  tests/integration/test_wire_fuzz.py \
  >"$report.log" 2>&1 || status=$?

python - "$report" <<'PY'
import json
import sys

with open(sys.argv[1], encoding="utf-8") as source:
    report = json.load(source)
print(f"wall time (s):                  {report['wall_s']}")
print(f"examples:                       {report['examples']}")
print(f"calls:                          {report['calls']}")
print(f"rejections:                     {report['rejections']}")
print(f"state changes after rejection:  {report['state_changes_after_rejection']}")
print(f"INTERNAL/UNKNOWN answers:       {report['internal_or_unknown']}")
print(f"mismatches with the core:       {report['reference_mismatches']}")
failures = report["distinct_failures"]
print(f"distinct failures:              {len(failures)}")
for failure in failures:
    print()
    print(failure)
PY
echo
echo "report: $report (pytest log: $report.log, exit status $status)"

http_examples="${KVCM_HTTP_FUZZ_EXAMPLES:-$((examples / 10 > 0 ? examples / 10 : 1))}"
echo
echo "== HTTP fuzzer: $http_examples examples"
http_status=0
KVCM_FUZZ_EXAMPLES="$http_examples" python -m pytest -q -p no:cacheprovider \
  tests/integration/test_http_fuzz.py || http_status=$?
echo "HTTP fuzzer exit status $http_status"
if [ "$status" -eq 0 ]; then status=$http_status; fi
exit "$status"
