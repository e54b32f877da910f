#!/usr/bin/env bash
# The peers benchmark in one command: installs what is missing (bench/peers/setup.sh, each
# peer in its own venv), runs bench/peers/run.py with the
# arguments given (--repeat N, --systems, --scenarios; see run.py --help), and prints the
# tables of bench/peers/report.py for the results, with the chart beside the results file.
#
#   bench/peers/run.sh --repeat 3
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [[ ! -x $root/.venv/bin/python ]]; then
    echo "[peers] no $root/.venv: run scripts/setup-deps.sh first" >&2
    exit 2
fi
if [[ ! -x $root/build/driver/elastic-run || ! -d $root/build/python/elastic ]]; then
    echo "[peers] elastic-run is not built in $root/build: run scripts/test.sh (or its cmake steps) first" >&2
    exit 2
fi
"$here/setup.sh" || echo "[peers] some peers did not install; they are left out (see above)" >&2
out=$("$root/.venv/bin/python" "$here/run.py" "$@" | tee /dev/stderr | sed -n 's/^\[peers\] results: //p')
[[ -n $out ]] || { echo "[peers] no results file" >&2; exit 1; }
"$root/.venv/bin/python" "$here/report.py" "$out" --png "${out%.json}.png"
