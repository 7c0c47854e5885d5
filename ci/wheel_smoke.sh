#!/usr/bin/env bash
# Installs the wheel(s) in $1 into a fresh virtual environment (CPU torch) and runs `python -m dsaquant info`.
set -euo pipefail
dist=${1:-dist}
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==2.13.0" || "$venv/bin/pip" install -q torch
"$venv/bin/pip" install -q "$dist"/*.whl
cd "$(mktemp -d)"   # not the source tree: import the installed package
"$venv/bin/python" -m dsaquant info
