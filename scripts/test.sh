#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh) and run the lint and the whole test suite, as CI does.
#
# vLLM tests run in their own pytest process: an in-process vLLM engine changes process-wide state
# (torch threads, RNG), which would slow and perturb the other tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TOKENIZERS_PARALLELISM=false
py=.venv/bin/python

"$py" -m ruff check .
"$py" -m ruff format --check .

run_pytest() {
    set +e
    "$py" -m pytest "$@"
    local status=$?
    set -e
    # 5 = no test collected for this selection: not a failure of the suite.
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
}
run_pytest -q --durations=15 -m "not vllm" "$@"
run_pytest -q --durations=10 -m "vllm" "$@"
