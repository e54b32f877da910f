#!/usr/bin/env bash
# Installs what building, testing, the examples and the benchmarks need:
#  1. Debian's packages for the C++ side (gRPC, Protobuf, Gloo, spdlog, ...) and the test hosts
#     (sshd, Slurm, nftables, etcd for the standby driver's tests, tcpdump for the TLS test's
#     capture), through apt;
#  2. one Python virtual environment, .venv/ in the checkout (ELASTIC_VENV=DIR to put it
#     elsewhere), with the pinned versions of requirements.txt (torch 2.x from PyPI and its
#     NCCL and CUDA runtime wheels, numpy, scikit-learn, pytest, scikit-build-core, pybind11).
# Idempotent and fast when everything is present: apt is not called (no apt-get update) and the
# environment is left as it is while requirements.txt is unchanged (its hash is stamped in the
# environment). pip's cache (~/.cache/pip) is kept, so a new environment costs a copy, not a
# download. Prints the environment's path last; `source .venv/bin/activate` to use it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libgloo-dev libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev catch2
  python3 python3-venv
  iproute2 procps openssh-server openssh-client gdb elfutils
  libcpp-httplib-dev slurm-wlm munge nftables clang libfuzzer-14-dev libclang-rt-14-dev
  etcd-server libssl-dev openssl tcpdump
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup-deps: all ${#PACKAGES[@]} Debian packages present"
else
  echo "setup-deps: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The Python environment. Made from the first python3 on PATH (3.9 or newer), or ELASTIC_PYTHON.
VENV=${ELASTIC_VENV:-$ROOT/.venv}
REQ="$ROOT/requirements.txt"
want=$(sha256sum "$REQ" | cut -d' ' -f1)
stamp="$VENV/.elastic-requirements.sha256"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "setup-deps: Python environment $VENV up to date ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
  exit 0
fi
BASE=${ELASTIC_PYTHON:-python3}
if ! "$BASE" -c 'import sys, venv; sys.exit(sys.version_info < (3, 9))' 2>/dev/null; then
  echo "setup-deps: $BASE is not a Python 3.9 or newer with the venv module; set ELASTIC_PYTHON" >&2
  exit 1
fi
echo "setup-deps: making the Python environment $VENV from $("$BASE" -c 'import sys; print(sys.executable, sys.version.split()[0])') (requirements.txt; torch's CUDA wheels: about 4 GB, a minute or two from pip's cache)"
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$BASE" -m venv "$VENV"
fi
rm -f "$stamp"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r "$REQ"
echo "$want" >"$stamp"
echo "setup-deps: Python environment ready in $(( $(date +%s) - start )) s: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
