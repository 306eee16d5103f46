#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, slow end-to-end tests included.
# Extra arguments go to pytest (e.g. ./run_tests.sh -m "not slow" -x).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
# Two test files at a time (pytest-xdist; a file's tests stay together, so a module's shared run is made
# once): an end-to-end test spends much of its time waiting on its processes, and one file at a time left
# half of 2 cores idle (measured 102% CPU, 1113 s; two at a time 166%, 709 s). GRPO_TEST_WORKERS=0: one.
# A test past 15 minutes is stuck (the slowest takes ~2.5): its stacks go to the log, so CI shows where.
exec .venv/bin/python -m pytest -q -ra --durations=25 -o faulthandler_timeout=900 -n "${GRPO_TEST_WORKERS:-2}" \
    --dist loadfile "$@"
