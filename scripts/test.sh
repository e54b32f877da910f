#!/usr/bin/env bash
# Runs every test: installs dependencies, configures, builds with ninja, runs ctest (C++ unit,
# integration and end-to-end tests) and pytest (the Python package). Exits non-zero on any failure.
#
#   scripts/test.sh            # build in ./build and test
#   BUILD_DIR=/tmp/b scripts/test.sh
#   ELASTIC_ASAN=1 scripts/test.sh   # everything under AddressSanitizer (build-asan/)
#   ELASTIC_SKIP_ASAN=1 scripts/test.sh  # skip the AddressSanitizer pass of the rendezvous tests
#   ELASTIC_SKIP_SOAK=1 scripts/test.sh  # skip the chaos soaks (1.5 min per mode: ELASTIC_SOAK_MINUTES=N)
#   ELASTIC_SKIP_FUZZ=1 scripts/test.sh  # skip the fuzzers (20 s per target: ELASTIC_FUZZ_SECONDS=N)
#   CI=true scripts/test.sh              # a test that would skip (no root, netns, sshd, Slurm) fails
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

bash scripts/setup-deps.sh
# Everything Python runs in the environment setup-deps.sh made (torch 2.x from PyPI): the
# package is built for its interpreter and installed into it, and `python3` on PATH is its own.
VENV=${ELASTIC_VENV:-$ROOT/.venv}
PY="$VENV/bin/python"
export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"

BUILD_DIR=${BUILD_DIR:-$ROOT/build}
CMAKE_ARGS=(-G Ninja -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)"
            -DCMAKE_BUILD_TYPE=RelWithDebInfo)
if [ "${ELASTIC_ASAN:-0}" = "1" ]; then
  BUILD_DIR=${BUILD_DIR%/}-asan
  CMAKE_ARGS+=(-DELASTIC_ASAN=ON -DELASTIC_BUILD_BENCH=OFF)
fi
JOBS=${JOBS:-$(nproc)}

echo "== configure ($BUILD_DIR)"
mkdir -p "$BUILD_DIR"
cmake -S . -B "$BUILD_DIR" "${CMAKE_ARGS[@]}" >"$BUILD_DIR/configure.log" 2>&1 ||
  { cat "$BUILD_DIR/configure.log"; exit 1; }
echo "== build"
cmake --build "$BUILD_DIR" -j "$JOBS"

# clang's thread-safety analysis of every source: each ELASTIC_GUARDED_BY member touched only
# with its mutex held (common/mutex.h, scripts/thread-safety.sh); about a minute on 2 cores.
echo "== thread-safety (clang++ -Wthread-safety -Werror)"
BUILD_DIR="$BUILD_DIR" JOBS="$JOBS" bash scripts/thread-safety.sh

echo "== ctest"
ctest --test-dir "$BUILD_DIR" -j "$JOBS" --output-on-failure --timeout 300

if [ -d tests/python ] && ls tests/python/test_*.py >/dev/null 2>&1; then
  # The Python tests use the package as a user does: installed into the environment (no
  # PYTHONPATH), by `cmake --install` of the build's `python` component.
  echo "== install (the Python package into $VENV)"
  cmake --install "$BUILD_DIR" --component python --prefix "$VENV" >"$BUILD_DIR/install.log" ||
    { cat "$BUILD_DIR/install.log"; exit 1; }
  echo "== pytest"
  ELASTIC_BUILD_DIR="$BUILD_DIR" "$PY" -m pytest -q -rs tests/python
fi
# The chaos soak, a short run of each mode with a fresh seed (printed; a failure names it for
# replay): the C++ example under kills, stops, additions, removals, discovery failures and
# leaves; PyTorch workers with DataLoader processes; three network namespace hosts under host
# kills, link flaps, packet loss, bandwidth caps and partitions; overlapping faults; jobs with
# checkpoints, killed whole and restarted or losing every holder of the state; a standby driver
# beside each job's leader on a namespace host of its own (etcd on the bridge) taking over a
# killed, paused or powered-off leader. The modes combined (e.g. --workload python --overlap)
# run in longer soaks, not here.
if [ "${ELASTIC_SKIP_SOAK:-0}" != "1" ]; then
  SOAK_MINUTES=${ELASTIC_SOAK_MINUTES:-1.5}
  for mode in "" "--workload python" "--hosts netns" "--overlap" "--checkpoints" "--hosts netns --standby"; do
    echo "== chaos soak (${SOAK_MINUTES} min) ${mode:---workload cpp --hosts local}"
    # shellcheck disable=SC2086
    BUILD_DIR="$BUILD_DIR" bash scripts/soak.sh --minutes "$SOAK_MINUTES" $mode
  done
fi
# libFuzzer: every parser of outside input, ELASTIC_FUZZ_SECONDS (20) each (scripts/fuzz.sh).
if [ "${ELASTIC_SKIP_FUZZ:-0}" != "1" ] && [ "${ELASTIC_ASAN:-0}" != "1" ]; then
  echo "== fuzz"
  ELASTIC_FUZZ_SECONDS=${ELASTIC_FUZZ_SECONDS:-20} FUZZ_DIR=${BUILD_DIR%/}-fuzz JOBS="$JOBS" \
    bash scripts/fuzz.sh
fi
# The gRPC service, its core and client once more under AddressSanitizer (and LeakSanitizer):
# every waiting call ends, nothing leaks.
if [ "${ELASTIC_ASAN:-0}" != "1" ] && [ "${ELASTIC_SKIP_ASAN:-0}" != "1" ]; then
  echo "== AddressSanitizer: rendezvous tests"
  ASAN_DIR=${BUILD_DIR%/}-asan
  mkdir -p "$ASAN_DIR"
  cmake -S . -B "$ASAN_DIR" "${CMAKE_ARGS[@]}" -DELASTIC_ASAN=ON -DELASTIC_BUILD_BENCH=OFF \
    >"$ASAN_DIR/configure.log" 2>&1 || { cat "$ASAN_DIR/configure.log"; exit 1; }
  cmake --build "$ASAN_DIR" -j "$JOBS" --target rendezvous_test
  "$ASAN_DIR/tests/rendezvous_test"
fi
echo "== all tests passed"
