#!/usr/bin/env bash
# The chaos soak (tests/soak/soak.py): elastic jobs under random kills, stops, additions,
# removals, discovery failures and graceful leaves (and with --hosts netns, host kills, link
# flaps, packet loss, bandwidth caps and partitions), each checked for exactly-once data, the
# fault-free model, recovery in place, no orphans (a /proc scan), nothing left in /dev/shm and
# no stall.
#
#   scripts/soak.sh --minutes 2                        # the C++ example; a fresh seed, printed
#   scripts/soak.sh --minutes 30 --seed 42             # replay a seed
#   scripts/soak.sh --workload python --minutes 10     # PyTorch, DataLoader(num_workers=2)
#   scripts/soak.sh --hosts netns --minutes 10         # three namespace hosts (root)
#   scripts/soak.sh --overlap --minutes 10             # faults that do not wait for recovery
#   scripts/soak.sh --standby --minutes 10             # a standby driver takes over (etcd)
#
# Needs a build (scripts/test.sh makes one in ./build; BUILD_DIR=... to use another).
set -euo pipefail
cd "$(dirname "$0")/.."
export ELASTIC_BUILD_DIR=${BUILD_DIR:-${ELASTIC_BUILD_DIR:-$PWD/build}}
# The Python of scripts/setup-deps.sh's environment (torch for --workload python).
PY=${ELASTIC_VENV:-$PWD/.venv}/bin/python
[ -x "$PY" ] || { echo "soak: no Python environment at ${PY%/bin/python}: run scripts/setup-deps.sh first" >&2; exit 1; }
exec "$PY" tests/soak/soak.py "$@"
