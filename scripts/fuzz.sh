#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/: discovery output and -H lists, the Gloo address
# blob, a state sync and the sampler's position, the RPC messages and their conversion, the job
# file, --launcher-template and --driver-address) with clang, AddressSanitizer and UBSan in
# ./build-fuzz, and runs each for ELASTIC_FUZZ_SECONDS (30) seconds over its seed corpus
# (tests/fuzz/corpus/<target>/; new inputs go to a temporary folder, not the repository).
# A crash stops with its input saved under build-fuzz/artifacts/ and its reproducer printed.
#
#   scripts/fuzz.sh                        # every target, 30 s each
#   ELASTIC_FUZZ_SECONDS=600 scripts/fuzz.sh fuzz_state_sync
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_DIR=${FUZZ_DIR:-$PWD/build-fuzz}
SECONDS_EACH=${ELASTIC_FUZZ_SECONDS:-30}
ALL=(fuzz_host_lines fuzz_addresses fuzz_state_sync fuzz_rpc fuzz_driver_input)
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=("${ALL[@]}")
if ! command -v clang++ >/dev/null; then
  echo "fuzz: clang++ is not installed (scripts/setup-deps.sh installs clang and libfuzzer-14-dev)" >&2
  exit 1
fi
mkdir -p "$FUZZ_DIR"
cmake -S . -B "$FUZZ_DIR" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DELASTIC_FUZZ=ON -DELASTIC_BUILD_TESTS=OFF \
  -DELASTIC_BUILD_BENCH=OFF -DELASTIC_WITH_NCCL=OFF -DPython_EXECUTABLE=/usr/bin/python3 \
  >"$FUZZ_DIR/configure.log" 2>&1 || { cat "$FUZZ_DIR/configure.log"; exit 1; }
cmake --build "$FUZZ_DIR" -j "${JOBS:-$(nproc)}" --target "${TARGETS[@]}"
mkdir -p "$FUZZ_DIR/artifacts"
failed=0
for t in "${TARGETS[@]}"; do
  work=$(mktemp -d)
  echo "== fuzz $t (${SECONDS_EACH} s)"
  if ! "$FUZZ_DIR/tests/fuzz/$t" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$FUZZ_DIR/artifacts/$t-" -print_final_stats=1 \
      "$work" "tests/fuzz/corpus/$t" >"$FUZZ_DIR/$t.log" 2>&1; then
    tail -40 "$FUZZ_DIR/$t.log"
    echo "fuzz: $t FAILED; reproduce with: $FUZZ_DIR/tests/fuzz/$t $FUZZ_DIR/artifacts/$t-*"
    failed=1
  else
    grep -E "stat::number_of_executed_units|stat::new_units_added" "$FUZZ_DIR/$t.log" |
      tr '\n' ' ' | sed "s/^/fuzz: $t: /"
    echo
  fi
  rm -rf "$work"
done
exit $failed
