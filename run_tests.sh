#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, slow end-to-end tests included.
# Extra arguments go to pytest (e.g. ./run_tests.sh -m "not slow" -x).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -ra "$@"
