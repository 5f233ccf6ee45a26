#!/usr/bin/env bash
# Create benchmarks/.venv-deepspeed: an isolated venv with torch 2.13.0 (CPU) and DeepSpeed 0.19.8 from PyPI.
#
# DeepSpeed is kept out of the project's .venv on purpose: zlightning must not depend on it, and DeepSpeed pins and
# patches things (pydantic, ninja, its own op builders) that we do not want next to the code under test.
#
# Order matters: torch is installed FIRST and pinned. This machine has a CPU torch 2.13.0 wheel on disk that pip
# picks up; installing DeepSpeed first would make pip resolve an unpinned torch and download a multi-GB CUDA build.
# DS_BUILD_OPS=0 skips every native op build (no CPU Adam, no AIO): the benchmark uses torch's AdamW.
#
# Usage: benchmarks/setup_deepspeed_venv.sh [PYTHON]   (idempotent; re-running only re-checks the install)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${here}/.venv-deepspeed"
python="${1:-python3}"
torch_pin="torch==2.13.0"
ds_pin="deepspeed==0.19.8"

if [[ ! -x "${venv}/bin/python" ]]; then
    echo ">> creating ${venv}"
    "${python}" -m venv "${venv}"
fi
pip=("${venv}/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip
echo ">> installing ${torch_pin} first (CPU build on this machine's disk)"
"${pip[@]}" install --quiet "${torch_pin}"
echo ">> installing ${ds_pin} with DS_BUILD_OPS=0 (no native ops)"
DS_BUILD_OPS=0 "${pip[@]}" install --quiet "${ds_pin}" "${torch_pin}"
"${venv}/bin/python" - <<'PY'
import deepspeed, torch
print(f">> ok: deepspeed {deepspeed.__version__}, torch {torch.__version__}")
PY
