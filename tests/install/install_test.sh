#!/usr/bin/env bash
# cmake --install, then a separate project finds it with find_package(elastic), builds, and
# runs under the installed elastic-run.   install_test.sh BUILD_DIR
set -euo pipefail
BUILD=$1
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cmake --install "$BUILD" --prefix "$WORK/prefix" >/dev/null
# Only the public API's headers are installed: elastic.h and what it includes, nothing of the
# agent's internals or the generated protocol.
headers=$(cd "$WORK/prefix/include" && find . -type f | sort | tr '\n' ' ')
want="./elastic/common/communicator.h ./elastic/common/mutex.h ./elastic/common/status.h \
./elastic/common/thread_annotations.h ./elastic/elastic.h ./elastic/state/checkpoint.h \
./elastic/state/state.h "
if [[ "$headers" != "$want" ]]; then
  echo "installed headers differ from the public API's list:"
  echo "  installed: $headers"
  echo "  expected:  $want"
  exit 1
fi
cmake -S "$HERE/consumer" -B "$WORK/build" -G Ninja -DCMAKE_PREFIX_PATH="$WORK/prefix" >"$WORK/configure.log" 2>&1 ||
  { cat "$WORK/configure.log"; exit 1; }
cmake --build "$WORK/build" >/dev/null
out=$("$WORK/prefix/bin/elastic-run" -np 2 "$WORK/build/consumer" 2>&1)
echo "$out"
grep -q "consumer rank 0 of 2: w\[0\] = 2.0 (round 0, slot localhost:[01], device comm none)" <<<"$out"
grep -q "consumer rank 1 of 2: w\[0\] = 2.0 (round 0, slot localhost:[01], device comm none)" <<<"$out"
echo "install + find_package(elastic): ok"
