#!/usr/bin/env bash
# Creates .venv (or $DELTAD_VENV) and installs deltad with one tested torch/fbgemm/torchrec trio.
# pyproject.toml declares the ranges deltad supports (torch >=2.13,<2.15, torchrec 1.8-1.9);
# this script pins the trio tested together, CPU by default:
#   DELTAD_STACK=2.13 (default) torch 2.13.0 + fbgemm-gpu-cpu 1.8.0 + torchrec 1.8.0
#   DELTAD_STACK=2.14           torch 2.14.1 + fbgemm-gpu-cpu 1.9.0 + torchrec 1.9.2
#     (torch 2.14.1 installs here only as its CUDA build, a ~5.6 GB venv; it runs on CPU)
#   DELTAD_VARIANT=cpu  (default) fbgemm-gpu-cpu next to the stack's torch
#   DELTAD_VARIANT=cuda           torch from $DELTAD_TORCH_INDEX + fbgemm-gpu of the same stack
# torchrec is installed with --no-deps: its metadata requires the CUDA fbgemm-gpu (~500 MB);
# its small needs (tensordict, torchmetrics, tqdm, pyre-extensions) come from deltad's own
# dependencies. torch is always pinned so no resolver pulls a newer build.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DELTAD_VENV:-.venv}"
stack="${DELTAD_STACK:-2.13}"
variant="${DELTAD_VARIANT:-cpu}"
case "$stack" in
  2.13) torch=2.13.0 fbgemm=1.8.0 torchrec=1.8.0 ;;
  2.14) torch=2.14.1 fbgemm=1.9.0 torchrec=1.9.2 ;;
  *) echo "install.sh: DELTAD_STACK must be 2.13 or 2.14, not '$stack'" >&2; exit 2 ;;
esac
stamp="$venv/.deltad-installed-$stack-$variant"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/install.sh ]; then
  exit 0
fi
for other in "$venv"/.deltad-installed-*; do  # one venv holds one stack
  [ -e "$other" ] || continue
  have="${other##*/.deltad-installed-}"
  [ "$have" = "$variant" ] && have="2.13-$variant"  # a stamp written before stacks were named
  if [ "$have" != "$stack-$variant" ]; then
    echo "install.sh: $venv holds the $have stack, not $stack-$variant; remove it or pick" \
      "another venv (make setup STACK=$stack VENV=.venv-$stack)" >&2
    exit 2
  fi
done
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
case "$variant" in
  cpu)  "${pip[@]}" "torch==$torch" "fbgemm-gpu-cpu==$fbgemm" ;;
  cuda) "${pip[@]}" "torch==$torch" --index-url "${DELTAD_TORCH_INDEX:?set DELTAD_TORCH_INDEX to the CUDA torch index}"
        "${pip[@]}" "fbgemm-gpu==$fbgemm" --index-url "$DELTAD_TORCH_INDEX" ;;
  *) echo "install.sh: DELTAD_VARIANT must be cpu or cuda, not '$variant'" >&2; exit 2 ;;
esac
# deltad's own range (torch >=2.13,<2.15) is met by the torch just installed: pip keeps it.
"${pip[@]}" -e ".[dev]"
# Last, so no later resolver run trips over its fbgemm-gpu requirement.
"${pip[@]}" --no-deps "torchrec==$torchrec"
rm -f "$venv"/.deltad-installed-*
touch "$stamp"
