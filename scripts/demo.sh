#!/usr/bin/env bash
# The elastic-run demo: trains a PyTorch MLP on scikit-learn's digits
# (examples/train_digits.py, with the `elastic` package) on this machine while a discovery
# script grows the job from 2 slots to 4, one worker is killed with SIGKILL, and the job
# shrinks to 3. The final accuracy and model are compared with a run without faults.
#
#   scripts/demo.sh          (installs what is missing, builds, runs; about a minute)
#   scripts/demo.sh --cpp    (the same with the C++ example: a bit-for-bit equal model)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${BUILD_DIR:-$ROOT/build}
MODE=python
if [ "${1:-}" = "--cpp" ]; then MODE=cpp; fi

bash scripts/setup-deps.sh
# The Python environment setup-deps.sh made (torch 2.x from PyPI): the package is built for it
# and installed into it.
VENV=${ELASTIC_VENV:-$ROOT/.venv}
PY="$VENV/bin/python"
export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
echo "== building (in $BUILD)"
mkdir -p "$BUILD"
cmake -S . -B "$BUILD" -G Ninja -DPython_EXECUTABLE="$PY" \
  -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" >"$BUILD/configure.log" 2>&1 ||
  { cat "$BUILD/configure.log"; exit 1; }
RUN="$BUILD/driver/elastic-run"
WORK=$(mktemp -d)
if [ "$MODE" = cpp ]; then
  cmake --build "$BUILD" --target elastic-run logistic_regression
  EXAMPLE=("$BUILD/examples/logistic_regression")
  ARGS=(--epochs 10 --step-ms 15)
  SAVE_REF=() SAVE_RUN=()
else
  cmake --build "$BUILD"
  echo "== installing the Python package into $VENV (cmake --install --component python)"
  cmake --install "$BUILD" --component python --prefix "$VENV" >"$BUILD/install.log"
  EXAMPLE=("$PY" "$ROOT/examples/train_digits.py")
  ARGS=(--epochs 30 --step-ms 10)
  SAVE_REF=(--save "$WORK/reference.pt") SAVE_RUN=(--save "$WORK/elastic.pt")
fi
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT

step() { printf '\n\033[1m[demo] %s\033[0m\n' "$*"; }
# wait_for FILE PATTERN SECONDS: waits until a line of FILE matches PATTERN.
wait_for() {
  local deadline=$((SECONDS + $3))
  until grep -q -- "$2" "$1" 2>/dev/null; do
    if [ $SECONDS -ge $deadline ]; then echo "[demo] timed out waiting for: $2" >&2; exit 1; fi
    sleep 0.1
  done
}
formed_with() {  # a round_formed event with N members, after the first K round_formed events
  python3 - "$WORK/events.jsonl" "$1" "$2" <<'PY'
import json, sys
n, k = int(sys.argv[2]), int(sys.argv[3])
formed = [e for e in map(json.loads, open(sys.argv[1])) if e["event"] == "round_formed"]
sys.exit(0 if any(len(e["members"]) == n for e in formed[k:]) else 1)
PY
}
rounds_formed() { grep -c round_formed "$WORK/events.jsonl" 2>/dev/null || true; }
wait_round() {  # wait_round N K: a round of N workers forms after the first K rounds
  local deadline=$((SECONDS + 60))
  until formed_with "$1" "$2"; do
    if [ $SECONDS -ge $deadline ]; then echo "[demo] timed out waiting for a round of $1" >&2; exit 1; fi
    sleep 0.1
  done
}
# wait_line PATTERN: a line of the job's output that matches, written from now on.
wait_line() {
  local seen deadline=$((SECONDS + 60))
  seen=$(wc -l <"$WORK/job.out")
  until tail -n +"$((seen + 1))" "$WORK/job.out" | grep -q -- "$1"; do
    if [ $SECONDS -ge $deadline ]; then echo "[demo] timed out waiting for: $1" >&2; exit 1; fi
    sleep 0.1
  done
}

step "reference: the same training with 2 workers and no faults"
"$RUN" -np 2 "${EXAMPLE[@]}" "${ARGS[@]}" "${SAVE_REF[@]}" 2>/dev/null | tee "$WORK/reference.out" | grep --line-buffered final || true
REFERENCE=$(grep -o 'final:.*' "$WORK/reference.out")

cat >"$WORK/discover.sh" <<EOS
#!/bin/sh
cat "$WORK/hosts"
EOS
chmod +x "$WORK/discover.sh"
echo "localhost:2" >"$WORK/hosts"

step "elastic run: elastic-run --min-np 2 --max-np 4 --host-discovery-script discover.sh (discovery lists localhost:2)"
"$RUN" --min-np 2 --max-np 4 --host-discovery-script "$WORK/discover.sh" \
  --host-failure-limit 0 --progress-interval 2 --event-log "$WORK/events.jsonl" \
  "${EXAMPLE[@]}" "${ARGS[@]}" "${SAVE_RUN[@]}" \
  >"$WORK/job.out" 2>&1 &
JOB=$!
tail -n +1 -f "$WORK/job.out" --pid=$JOB | grep --line-buffered -v '<stderr>:.*\[worker\] \[info\]' &

wait_for "$WORK/job.out" "epoch 1 done" 60
step "discovery now lists localhost:4: two new workers start while the others train on; the job grows at a commit as each is ready"
echo "localhost:4" >"$WORK/hosts"
wait_round 4 1

wait_line "done: .* 4 workers"
VICTIM=$(python3 -c "
import json
starts = [json.loads(l) for l in open('$WORK/events.jsonl') if '\"worker_started\"' in l]
print([e['pid'] for e in starts if e['slot'] == 'localhost:1'][-1])")
BEFORE=$(rounds_formed)
step "kill -9 the worker of slot localhost:1 (pid $VICTIM): the survivors roll back and re-form at once; a new process for the slot joins them once it is ready"
kill -9 "$VICTIM"
wait_round 4 "$BEFORE"

wait_line "done: .* 4 workers"
step "discovery now lists localhost:3: slot localhost:3 is removed and exits 0"
echo "localhost:3" >"$WORK/hosts"

STATUS=0
wait $JOB || STATUS=$?
sleep 0.2
RESULT=$(grep -o 'final:.*' "$WORK/job.out" || true)
step "recovery phases from the event log"
python3 - "$WORK/events.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    e = json.loads(line)
    if e["event"] in ("round_formed",):
        print(f"  round {e['round']} formed: {len(e['members'])} workers")
    if e["event"] == "recovery_phase" and e["phase"] in ("rebuild", "sync"):
        print(f"  recovery {e['phase']:<10} took {e['seconds']*1000:.1f} ms (in the workers)")
    elif e["event"] == "recovery_phase":
        print(f"  recovery {e['phase']:<10} +{e['seconds']*1000:.1f} ms after the kill was detected")
PY
if "$PY" -c "import matplotlib" 2>/dev/null; then
  step "timeline picture (scripts/elastic-timeline)"
  "$PY" "$ROOT/scripts/elastic-timeline" "$WORK/events.jsonl" -o "$BUILD/demo-timeline.png" |
    sed 's/^/  /'
  echo "  the picture: $BUILD/demo-timeline.png"
fi
step "result"
echo "  without faults: $REFERENCE"
echo "  elastic run:    $RESULT"
if [ "$STATUS" -ne 0 ]; then echo "  elastic-run exited $STATUS"; exit 1; fi
if [ "$MODE" = cpp ]; then
  if [ "$RESULT" = "$REFERENCE" ]; then
    echo "  the elastic run (2 -> 4 -> kill -> 3 workers) trained exactly the same model."
  else
    echo "  MISMATCH"; exit 1
  fi
else
  # float32 gradients summed by a different number of workers come out in another order:
  # equal within 1e-4 (a lost or repeated batch would move the weights by ~1e-2).
  "$PY" - "$WORK/reference.pt" "$WORK/elastic.pt" <<'PY'
import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
d = max((a[k] - b[k]).abs().max().item() for k in a)
print(f"  largest weight difference from the fault-free model: {d:.2e}")
if d >= 1e-4:
    print("  MISMATCH"); sys.exit(1)
print("  the elastic run (2 -> 4 -> kill -> 3 workers) reached the fault-free model and accuracy.")
PY
fi
