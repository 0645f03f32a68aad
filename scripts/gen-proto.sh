#!/usr/bin/env bash
# Generate kvcm's protobuf and gRPC Python code from proto/kvcm/v1/*.proto, beside the .proto
# files (proto/kvcm/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py). The generator is the grpcio-tools
# pinned in requirements/constraints.txt, run from the project's virtual environment.
#
#   bash scripts/gen-proto.sh           # regenerate in place (commit the result)
#   bash scripts/gen-proto.sh --check   # regenerate into a temp dir; fail if the committed
#                                       # files differ (CI)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode="${1:-write}"
case "$mode" in
  write | --check) ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

# The pinned generator: the active virtual environment's, else the project's .venv.
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  python="$VIRTUAL_ENV/bin/python"
else
  python="$PWD/.venv/bin/python"
fi
if ! "$python" -c 'import grpc_tools' 2>/dev/null; then
  echo "!! grpcio-tools is missing from $python; run: source scripts/setup-env.sh dev" >&2
  exit 1
fi
want="$(sed -n 's/^grpcio-tools==//p' requirements/constraints.txt)"
have="$("$python" -c 'from importlib.metadata import version; print(version("grpcio-tools"))')"
if [ "$have" != "$want" ]; then
  echo "!! grpcio-tools $have is installed, constraints pin $want" >&2
  exit 1
fi

# Determinism: a fixed locale and file order, paths relative to the include root (so the
# descriptors name "kvcm/v1/<file>.proto" whatever the checkout's location).
export LC_ALL=C
pkg="kvcm/v1"
mapfile -t sources < <(cd proto && find "$pkg" -maxdepth 1 -name '*.proto' | sort)
if [ "${#sources[@]}" -eq 0 ]; then
  echo "!! no .proto files under proto/$pkg" >&2
  exit 1
fi

generate() { # $1: output root
  (cd proto && "$python" -m grpc_tools.protoc -I. \
    --python_out="$1" --pyi_out="$1" --grpc_python_out="$1" "${sources[@]}")
}

generated_files() { # $1: root; the generated files under it, relative, sorted
  (cd "$1" && find "$pkg" -maxdepth 1 -type f \
    \( -name '*_pb2.py' -o -name '*_pb2.pyi' -o -name '*_pb2_grpc.py' \) | sort)
}

if [ "$mode" = write ]; then
  # Remove what an earlier run generated, so a deleted .proto leaves no stale modules.
  generated_files proto | (cd proto && xargs -r rm -f)
  generate "$PWD/proto"
  generated_files proto | sed 's|^|generated proto/|' >&2
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/$pkg"
generate "$tmp"
if diff -u <(generated_files proto) <(generated_files "$tmp") >"$tmp/list.diff"; then
  stale=""
else
  stale=1
fi
changed=()
while IFS= read -r f; do
  if [ -f "proto/$f" ] && ! cmp -s "proto/$f" "$tmp/$f"; then changed+=("$f"); fi
done < <(generated_files "$tmp")
if [ -z "$stale" ] && [ "${#changed[@]}" -eq 0 ]; then
  echo "generated protobuf code is up to date (${#sources[@]} .proto files)" >&2
  exit 0
fi
echo "!! generated protobuf code is out of date; run: bash scripts/gen-proto.sh" >&2
if [ -n "$stale" ]; then
  echo "   files missing (+) or not generated any more (-):" >&2
  grep -E '^[+-][^+-]' "$tmp/list.diff" | sed 's|^|     |' >&2
fi
for f in "${changed[@]}"; do
  echo "   differs: proto/$f ($(diff "proto/$f" "$tmp/$f" | grep -c '^[<>]') lines)" >&2
done
exit 1
