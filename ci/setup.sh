#!/usr/bin/env bash
# Idempotent setup on a fresh Debian machine (run as root): OpenMPI, a .venv with the pinned
# stack, Horovod 0.28.1 built from the sdist with the C++17 fix (wheel cached outside the repo),
# then hvd_compress itself with its compiled kernels.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVDC_VENV:-$ROOT/.venv}"
PY="${HVDC_PYTHON:-python3.11}"
CACHE="${HVDC_CACHE:-$HOME/.cache/hvd_compress}"
HOROVOD_VERSION=0.28.1
TORCH_VERSION=$(grep -E '^torch==' "$ROOT/ci/requirements.txt" | cut -d= -f3)
TF_VERSION=$(grep -E '^tensorflow-cpu==' "$ROOT/ci/requirements.txt" | cut -d= -f3)
WHEEL_DIR="$CACHE/horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-tf$TF_VERSION"

log() { echo "[setup] $*"; }

apt_install() {
    local missing=()
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "$(id -u)" -ne 0 ]; then
            echo "setup: need root to apt-get install ${missing[*]}" >&2
            exit 1
        fi
        log "apt-get install ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

apt_install libopenmpi-dev openmpi-bin build-essential cmake iproute2

if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

req_stamp="$VENV/.requirements.sha"
req_sha=$(sha256sum "$ROOT/ci/requirements.txt" | cut -d' ' -f1)
if [ "$(cat "$req_stamp" 2>/dev/null)" != "$req_sha" ]; then
    log "installing pinned requirements"
    "$VPY" -m pip install -q "wheel==0.45.1"
    "$VPY" -m pip install -q -r "$ROOT/ci/requirements.txt"
    echo "$req_sha" > "$req_stamp"
fi

if ! "$VPY" -c "import horovod, horovod.torch, horovod.tensorflow" >/dev/null 2>&1; then
    if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
        log "building Horovod $HOROVOD_VERSION (about 10 minutes on 2 cores; cached in $WHEEL_DIR)"
        work=$(mktemp -d)
        trap 'rm -rf "$work"' EXIT
        "$VPY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
        tar -xzf "$work"/horovod-$HOROVOD_VERSION.tar.gz -C "$work"
        src="$work/horovod-$HOROVOD_VERSION"
        # torch >= 2.1 headers need C++17; Horovod 0.28.1 asks for C++14 in these two places.
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
            "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
        grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt"
        grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
        (cd "$src" && PATH="$VENV/bin:$PATH" \
            HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
            HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_CPU_OPERATIONS=GLOO \
            MAKEFLAGS="-j$(nproc)" \
            "$VPY" -m pip wheel -q --no-build-isolation --no-deps . -w "$work/dist")
        mkdir -p "$WHEEL_DIR"
        cp "$work"/dist/horovod-*.whl "$WHEEL_DIR/"
    fi
    log "installing cached Horovod wheel"
    "$VPY" -m pip install -q "$WHEEL_DIR"/horovod-*.whl
fi

log "building hvd_compress kernels"
# The editable install only puts the checkout on the path: how it builds extensions depends on
# the setuptools a dependency left behind, so the kernels are built in place explicitly (and
# incrementally), then loaded once so a build that produced nothing fails here, not in tests.
# The venv's bin is on PATH for its ninja, which lets the build compile side by side.
(cd "$ROOT" && export PATH="$VENV/bin:$PATH" \
    && "$VPY" -m pip install -q --no-build-isolation --no-deps -e . \
    && "$VPY" setup.py -q build_ext --inplace)
# A wheel install puts the HVD_COMPRESSION opt-in (hvd_compress/env.pth) into site-packages
# (setup.py's build_py); an editable install does not, so it is copied there.
site=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")
cp "$ROOT/hvd_compress/env.pth" "$site/hvd_compress_env.pth"
(cd / && "$VPY" -c "import hvd_compress.torch._C, hvd_compress.tensorflow.ops") \
    || { echo "setup: the hvd_compress kernels did not build" >&2; exit 1; }
log "ready: $VENV"
