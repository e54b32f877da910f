#!/usr/bin/env bash
# cmake --install, then a separate project finds it with find_package(elastic), builds, and
# runs under the installed elastic-run.   install_test.sh BUILD_DIR
set -euo pipefail
BUILD=$1
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cmake --install "$BUILD" --prefix "$WORK/prefix" >/dev/null
cmake -S "$HERE/consumer" -B "$WORK/build" -G Ninja -DCMAKE_PREFIX_PATH="$WORK/prefix" >"$WORK/configure.log" 2>&1 ||
  { cat "$WORK/configure.log"; exit 1; }
cmake --build "$WORK/build" >/dev/null
out=$("$WORK/prefix/bin/elastic-run" -np 2 "$WORK/build/consumer" 2>&1)
echo "$out"
grep -q "consumer rank 0 of 2: w\[0\] = 2.0" <<<"$out"
grep -q "consumer rank 1 of 2: w\[0\] = 2.0" <<<"$out"
echo "install + find_package(elastic): ok"
