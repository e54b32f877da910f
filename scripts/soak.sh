#!/usr/bin/env bash
# The chaos soak (tests/soak/soak.py): elastic jobs of the C++ example under random kills,
# additions, removals, discovery failures and graceful leaves, each checked for exactly-once
# data, the fault-free model, no silent restart, no orphans and no stall.
#
#   scripts/soak.sh --minutes 2              # a fresh seed, printed at the start
#   scripts/soak.sh --minutes 30 --seed 42   # replay a seed
#
# Needs a build (scripts/test.sh makes one in ./build; BUILD_DIR=... to use another).
set -euo pipefail
cd "$(dirname "$0")/.."
export ELASTIC_BUILD_DIR=${BUILD_DIR:-${ELASTIC_BUILD_DIR:-$PWD/build}}
exec /usr/bin/python3 tests/soak/soak.py "$@"
