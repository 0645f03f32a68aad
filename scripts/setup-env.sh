# Sourced by scripts/test.sh and scripts/run.sh: create (once) the project's virtual environment
# in .venv with the pinned dependencies, install kvcm into it, and activate it.
#   source scripts/setup-env.sh dev   # with the worker (torch) and development extras
#   source scripts/setup-env.sh       # runtime only
# Only "dev" selects extras: a script that sources this file without arguments passes its own
# (`run.sh serve` would otherwise read "serve" here and reinstall on every run).
_kvcm_extras=""
[ "${1:-}" = dev ] && _kvcm_extras=dev
_kvcm_python="${PYTHON:-python3}"
_kvcm_venv="${KVCM_VENV:-.venv}"
# The compiled lookup index is built by the install: a changed C source reinstalls too.
_kvcm_want="$(cat pyproject.toml requirements/constraints.txt core/kvcm/core/*.c | sha256sum | cut -d' ' -f1)-${_kvcm_extras}"
if [ ! -x "$_kvcm_venv/bin/python" ]; then
  echo "== creating $_kvcm_venv" >&2
  "$_kvcm_python" -m venv "$_kvcm_venv"
fi
if [ "$(cat "$_kvcm_venv/.kvcm-stamp" 2>/dev/null)" != "$_kvcm_want" ]; then
  echo "== installing kvcm and its pinned dependencies into $_kvcm_venv" >&2
  _kvcm_spec=".[server]"
  [ "$_kvcm_extras" = dev ] && _kvcm_spec=".[server,worker,dev,tracing]"
  "$_kvcm_venv/bin/python" -m pip install -q -c requirements/constraints.txt -e "$_kvcm_spec" >&2
  echo "$_kvcm_want" > "$_kvcm_venv/.kvcm-stamp"
fi
# shellcheck disable=SC1091
source "$_kvcm_venv/bin/activate"
unset _kvcm_extras _kvcm_python _kvcm_venv _kvcm_want _kvcm_spec
