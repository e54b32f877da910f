#!/usr/bin/env bash
# Every GPU test, for a machine with a GPU (a few minutes). Builds what it needs unless
# BUILD_DIR already has it, then runs:
#   1. nccl_gpu_test: size-1 communicators through init, every collective and dtype against a
#      CPU reference, abort of a blocked collective from another thread, 100 rebuilds (device
#      memory checked), Gloo beside NCCL; with 2+ GPUs every collective across ranks and a rank
#      lost mid-allreduce with the survivors recovering by shrink and by re-init (timed);
#   2. a job under `elastic-run --backend nccl` (one worker per GPU): the agent builds its NCCL
#      communicator beside Gloo;
#   3. the Python/torch CUDA path (tests/gpu/torch_gpu_worker.py) when `elastic` imports in
#      this machine's python3 with a CUDA torch.
# Without a GPU each part says so in one line and the script exits 0.
#
#   tests/gpu/run.sh                 # build in ./build
#   BUILD_DIR=/path/to/build tests/gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD_DIR:-build}
fail=0

echo "== $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname)"
nvidia-smi -L 2>/dev/null || echo "(nvidia-smi not available)"
if [ ! -x "$BUILD/tests/gpu/nccl_gpu_test" ] || [ ! -x "$BUILD/driver/elastic-run" ]; then
  echo "== build ($BUILD)"
  cmake -S . -B "$BUILD" -G Ninja -DELASTIC_WITH_NCCL=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPython_EXECUTABLE="$(command -v python3)" >/dev/null || exit 1
  cmake --build "$BUILD" --target nccl_gpu_test elastic-run test_worker || exit 1
fi

echo "== 1. nccl_gpu_test"
timeout 600 "$BUILD/tests/gpu/nccl_gpu_test" --durations yes || fail=1

ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${ngpu:-0}" -lt 1 ]; then
  echo "== 2, 3: skipped: no GPU visible"
  exit $fail
fi

echo "== 2. elastic-run --backend nccl -np $ngpu (C++ worker)"
out=$(timeout 300 "$BUILD/driver/elastic-run" -np "$ngpu" --backend nccl \
      "$BUILD/tests/driver/test_worker" collectives 2>&1)
rc=$?
echo "$out" | grep -E "NCCL communicator|backend:|error|failed" | head -20
if [ $rc -ne 0 ] || ! echo "$out" | grep -q "NCCL communicator of round 0"; then
  echo "FAILED (exit $rc)"; echo "$out" | tail -30; fail=1
fi

echo "== 3. Python/torch CUDA path"
export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "skipped: python3 has no CUDA torch"
elif ! python3 -c "import elastic" 2>/dev/null; then
  echo "skipped: the elastic package was built for another Python ($(python3 -V)); rebuild with -DPython_EXECUTABLE=$(command -v python3)"
else
  timeout 300 "$BUILD/driver/elastic-run" -np "$ngpu" --backend nccl python3 \
    tests/gpu/torch_gpu_worker.py 2>&1 | grep -E "torch gpu|Error|error" | head -20
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAILED"; fail=1; }
fi
exit $fail
