#!/usr/bin/env bash
# Installs every Debian package that building, testing, the examples and the benchmarks need.
# Idempotent: when everything is present it only checks and returns (no apt-get update).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libgloo-dev libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev catch2
  pybind11-dev python3-dev python3-pybind11 python3-pytest python3-numpy
  python3-torch python3-torchvision python3-sklearn
  iproute2 procps openssh-server openssh-client gdb elfutils
  libcpp-httplib-dev python3-matplotlib slurm-wlm munge nftables clang libfuzzer-14-dev
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "setup-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
