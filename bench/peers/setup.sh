#!/usr/bin/env bash
# Creates one virtual environment per elastic-training peer, with the versions verified on the
# project's machine (Debian 12, glibc 2.36, Python 3.11, 2 cores; see README.md beside this file).
#
#   bench/peers/setup.sh                    # all peers: torchft dlrover nvrx horovod
#   bench/peers/setup.sh torchft dlrover    # only these
#
# Environment:
#   PEERS_VENV_DIR  where the venvs go            (default: $HOME/.cache/elastic-peers)
#   PYTHON          interpreter for the venvs      (default: python3; verified with 3.11.7)
#   PYTHON312       a Python 3.12 interpreter, for nvidia-resiliency-ext 0.7.0 (default: found
#                   on PATH or under pyenv; 0.7.0 ships cp312/cp314 wheels only)
#   NVRX_RETAG=1    install nvidia-resiliency-ext 0.7.0 on glibc < 2.39 by re-tagging its
#                   manylinux_2_39 wheel (see README.md); off by default
#   PEERS_FORCE=1   rebuild venvs that are already complete
#   MAKEFLAGS       passed to horovod's build      (default: -j2)
#
# Idempotent: a venv whose stamp file (.peer-ok) names the wanted versions is left as it is; a
# venv without one (an interrupted install) is removed and made again. Exits 1 if a peer that
# should install did not; a peer known not to install is skipped with the error it gives.
set -uo pipefail

PEERS_VENV_DIR=${PEERS_VENV_DIR:-$HOME/.cache/elastic-peers}
PYTHON=${PYTHON:-python3}
export MAKEFLAGS=${MAKEFLAGS:--j2}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# ---- pinned versions (verified 2026-12-06) ----
TORCHFT_SPEC="torchft==0.2.0 torch==2.15.0"
# dlrover 0.6.1: the k8s extra brings kubernetes and grpcio, which its local master (used by
# dlrover-run --standalone) imports; torch >= 2.9 breaks that master's launch (see README).
DLROVER_SPEC="dlrover[k8s,torch]==0.6.1 torch==2.8.0 grpcio==1.85.4 protobuf==7.36.2"
NVRX_SPEC="nvidia-resiliency-ext==0.7.0"
NVRX_FALLBACK_SPEC="nvidia-resiliency-ext==0.4.1 torch==2.15.0"
# horovod 0.28.1 compiles its PyTorch op with -std=c++14: torch >= 2.1 needs C++17 and
# torch 2.15 needs C++20, so 2.0.1 is the newest torch it builds against.
HOROVOD_TORCH_SPEC="torch==2.0.1 numpy==1.26.4 setuptools==65.5.0 wheel==0.48.0"
HOROVOD_SPEC="horovod==0.28.1"

say()  { printf '[peers] %s\n' "$*"; }
warn() { printf '[peers] %s\n' "$*" >&2; }

FAILED=()
mkdir -p "$PEERS_VENV_DIR" || { warn "cannot create $PEERS_VENV_DIR"; exit 1; }

# is_done NAME STAMP...: true if the venv NAME is complete with one of the given stamps
is_done() {
    local name=$1; shift
    local stamp_file="$PEERS_VENV_DIR/$name/.peer-ok"
    [[ -f $stamp_file && ${PEERS_FORCE:-0} != 1 ]] || return 1
    local have s
    have=$(cat "$stamp_file")
    for s in "$@"; do [[ $have == "$s" ]] && return 0; done
    return 1
}

# new_venv NAME PYTHON: (re)create an empty venv with an up-to-date pip
new_venv() {
    local name=$1 py=$2 dir="$PEERS_VENV_DIR/$1"
    rm -rf "$dir"
    "$py" -m venv "$dir" || return 1
    "$dir/bin/python" -m pip install -q --upgrade pip >>"$PEERS_VENV_DIR/$name.log" 2>&1
}

# pip_in NAME ARGS...: pip install into the venv NAME, output appended to NAME.log; on failure
# PIP_ERROR holds the first compiler error (if any) and pip's last ERROR lines of this call
pip_in() {
    local name=$1; shift
    local log="$PEERS_VENV_DIR/$name.log" start
    echo "== $(date -u +%FT%TZ) pip install $*" >>"$log"
    start=$(wc -l <"$log")
    if ! "$PEERS_VENV_DIR/$name/bin/python" -m pip install --progress-bar off "$@" >>"$log" 2>&1; then
        PIP_ERROR=$(tail -n +"$((start + 1))" "$log" \
            | { grep -m1 -E ': (fatal )?error: ' | sed 's/^ *//'; } ; \
            tail -n +"$((start + 1))" "$log" | grep -E '^ *ERROR:' | tail -n 2)
        return 1
    fi
}

# pip_spec NAME "SPEC": pip_in with the words of SPEC (split without globbing: "dlrover[k8s,torch]")
pip_spec() { local -a words; read -ra words <<<"$2"; pip_in "$1" "${words[@]}"; }

mark_done() { echo "$2" >"$PEERS_VENV_DIR/$1/.peer-ok"; say "$1: ready ($2) in $PEERS_VENV_DIR/$1"; }

py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }

find_python312() {
    local c
    for c in ${PYTHON312:-} python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        [[ -n $c ]] || continue
        if [[ $(py_version "$c") == 3.12 ]]; then echo "$c"; return 0; fi
    done
    return 1
}

glibc_version() { "$PYTHON" -c 'import platform; print(platform.libc_ver()[1])'; }

# ---- torchft ----
setup_torchft() {
    local name=torchft
    is_done $name "$TORCHFT_SPEC" && { say "$name: already installed ($TORCHFT_SPEC)"; return; }
    say "$name: installing $TORCHFT_SPEC"
    if new_venv $name "$PYTHON" && pip_spec $name "$TORCHFT_SPEC" \
        && "$PEERS_VENV_DIR/$name/bin/python" -c 'import torchft; from torchft import Manager' 2>/dev/null \
        && "$PEERS_VENV_DIR/$name/bin/torchft_lighthouse" --help >/dev/null 2>&1; then
        mark_done $name "$TORCHFT_SPEC"
    else
        warn "$name: FAILED (${PIP_ERROR:-import or torchft_lighthouse --help failed}); see $PEERS_VENV_DIR/$name.log"
        FAILED+=($name)
    fi
}

# ---- dlrover ----
setup_dlrover() {
    local name=dlrover
    is_done $name "$DLROVER_SPEC" && { say "$name: already installed ($DLROVER_SPEC)"; return; }
    say "$name: installing $DLROVER_SPEC"
    if new_venv $name "$PYTHON" && pip_spec $name "$DLROVER_SPEC" \
        && "$PEERS_VENV_DIR/$name/bin/dlrover-run" --help >/dev/null 2>&1; then
        mark_done $name "$DLROVER_SPEC"
    else
        warn "$name: FAILED (${PIP_ERROR:-dlrover-run --help failed}); see $PEERS_VENV_DIR/$name.log"
        FAILED+=($name)
    fi
}

# ---- nvidia-resiliency-ext ----
nvrx_check() { "$PEERS_VENV_DIR/nvrx/bin/ft_launcher" --help >/dev/null 2>&1; }

setup_nvrx() {
    local name=nvrx py312 glibc retag_spec
    glibc=$(glibc_version)
    retag_spec="$NVRX_SPEC (wheel re-tagged manylinux_2_39 -> manylinux_${glibc//./_})"
    if [[ ${NVRX_RETAG:-0} == 1 ]]; then
        is_done $name "$NVRX_SPEC" "$retag_spec" && { say "$name: already installed ($(cat "$PEERS_VENV_DIR/$name/.peer-ok"))"; return; }
    else
        is_done $name "$NVRX_SPEC" "$NVRX_FALLBACK_SPEC" && { say "$name: already installed ($(cat "$PEERS_VENV_DIR/$name/.peer-ok"))"; return; }
    fi

    # 1. the pinned 0.7.0, as published (needs CPython 3.12 or 3.14 and glibc >= 2.39)
    PIP_ERROR=""
    if py312=$(find_python312); then
        say "$name: installing $NVRX_SPEC with $py312"
        if new_venv $name "$py312" && pip_in $name "$NVRX_SPEC" && nvrx_check; then
            mark_done $name "$NVRX_SPEC"; return
        fi
    else
        PIP_ERROR="no Python 3.12 interpreter found (set PYTHON312); 0.7.0 has cp312/cp314 wheels only"
    fi
    say "$name: SKIPPING $NVRX_SPEC: ${PIP_ERROR//$'\n'/ | }"
    say "$name:   (0.7.0 is published only as cp312/cp314 manylinux_2_39 wheels, no sdist; this machine has glibc $glibc)"

    # 2. optional: 0.7.0 re-tagged for this glibc. Its one native module (nvrx_cupti_module, CUPTI
    #    profiling) needs GLIBCXX_3.4.32 and will not load on Debian 12; ft_launcher does not need it.
    if [[ ${NVRX_RETAG:-0} == 1 && -n ${py312:-} ]]; then
        say "$name: NVRX_RETAG=1: installing $retag_spec"
        local tmp; tmp=$(mktemp -d)
        if new_venv $name "$py312" && pip_in $name wheel \
            && "$PEERS_VENV_DIR/$name/bin/python" -m pip download -q --no-deps --only-binary=:all: \
                 --platform manylinux_2_39_x86_64 --python-version 3.12 -d "$tmp" "$NVRX_SPEC" >>"$PEERS_VENV_DIR/$name.log" 2>&1 \
            && "$PEERS_VENV_DIR/$name/bin/wheel" tags --remove --platform-tag "manylinux_${glibc//./_}_x86_64" \
                 "$tmp"/nvidia_resiliency_ext-0.7.0-cp312-cp312-manylinux_2_39_x86_64.whl >>"$PEERS_VENV_DIR/$name.log" 2>&1 \
            && pip_in $name "$tmp"/nvidia_resiliency_ext-0.7.0-cp312-cp312-manylinux_"${glibc//./_}"_x86_64.whl \
            && nvrx_check; then
            rm -rf "$tmp"; mark_done $name "$retag_spec"; return
        fi
        rm -rf "$tmp"
        warn "$name: FAILED re-tagged 0.7.0 (${PIP_ERROR:-ft_launcher --help failed}); see $PEERS_VENV_DIR/$name.log"
        FAILED+=($name); return
    fi

    # 3. the newest release that installs here: 0.4.1 (cp311 wheel, manylinux_2_31)
    say "$name: installing the newest release that installs here instead: $NVRX_FALLBACK_SPEC"
    if new_venv $name "$PYTHON" && pip_spec $name "$NVRX_FALLBACK_SPEC" && nvrx_check; then
        mark_done $name "$NVRX_FALLBACK_SPEC"
    else
        warn "$name: FAILED ($NVRX_FALLBACK_SPEC: ${PIP_ERROR:-ft_launcher --help failed}); see $PEERS_VENV_DIR/$name.log"
        FAILED+=($name)
    fi
}

# ---- horovod ----
setup_horovod() {
    local name=horovod stamp="$HOROVOD_SPEC $HOROVOD_TORCH_SPEC"
    is_done $name "$stamp" && { say "$name: already installed ($stamp)"; return; }
    for tool in cmake g++; do
        command -v $tool >/dev/null || { warn "$name: FAILED: $tool not found (apt-get install cmake g++)"; FAILED+=($name); return; }
    done
    say "$name: installing $HOROVOD_TORCH_SPEC, then building $HOROVOD_SPEC from source (~3-5 min on 2 cores)"
    # --no-build-isolation: horovod's setup.py imports torch to build its PyTorch op.
    if new_venv $name "$PYTHON" && pip_spec $name "$HOROVOD_TORCH_SPEC" \
        && HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
           HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
           pip_in $name --no-cache-dir --no-build-isolation "$HOROVOD_SPEC" \
        && "$PEERS_VENV_DIR/$name/bin/horovodrun" --check-build >>"$PEERS_VENV_DIR/$name.log" 2>&1; then
        mark_done $name "$stamp"
    else
        warn "$name: FAILED (${PIP_ERROR:-horovodrun --check-build failed}); see $PEERS_VENV_DIR/$name.log"
        FAILED+=($name)
    fi
}

if [[ $(py_version "$PYTHON") != 3.11 ]]; then
    warn "warning: $PYTHON is Python $(py_version "$PYTHON"); these pins were verified with 3.11"
fi

peers=("$@")
[[ ${#peers[@]} -gt 0 ]] || peers=(torchft dlrover nvrx horovod)
for p in "${peers[@]}"; do
    case $p in
        torchft|dlrover|nvrx|horovod) setup_"$p" ;;
        *) warn "unknown peer '$p' (known: torchft dlrover nvrx horovod)"; FAILED+=("$p") ;;
    esac
done

if [[ ${#FAILED[@]} -gt 0 ]]; then
    warn "failed: ${FAILED[*]}"
    exit 1
fi
say "done: ${peers[*]} in $PEERS_VENV_DIR"
