#!/usr/bin/env bash
# Creates .venv (or $DELTAD_VENV) and installs deltad with its pinned stack, CPU by default.
#   DELTAD_VARIANT=cpu  (default) torch 2.13.0 CPU + fbgemm-gpu-cpu 1.8.0
#   DELTAD_VARIANT=cuda           torch 2.13.0 from $DELTAD_TORCH_INDEX + fbgemm-gpu 1.8.0
# torchrec 1.8.0 is installed with --no-deps: its metadata requires the CUDA fbgemm-gpu
# (~500 MB); its small needs (tensordict, torchmetrics, tqdm, pyre-extensions) come from
# deltad's own dependencies. torch is always pinned so no resolver pulls a newer CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DELTAD_VENV:-.venv}"
variant="${DELTAD_VARIANT:-cpu}"
stamp="$venv/.deltad-installed-$variant"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/install.sh ]; then
  exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
case "$variant" in
  cpu)  "${pip[@]}" "torch==2.13.0" "fbgemm-gpu-cpu==1.8.0" ;;
  cuda) "${pip[@]}" "torch==2.13.0" --index-url "${DELTAD_TORCH_INDEX:?set DELTAD_TORCH_INDEX to the CUDA torch index}"
        "${pip[@]}" "fbgemm-gpu==1.8.0" --index-url "$DELTAD_TORCH_INDEX" ;;
  *) echo "install.sh: DELTAD_VARIANT must be cpu or cuda, not '$variant'" >&2; exit 2 ;;
esac
"${pip[@]}" -e ".[dev]"
# Last, so no later resolver run trips over its fbgemm-gpu requirement.
"${pip[@]}" --no-deps "torchrec==1.8.0"
touch "$stamp"
