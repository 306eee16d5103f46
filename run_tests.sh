#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Extra arguments go to pytest (a file, a marker, -x, -k ...).
#
#   ./run_tests.sh            the whole suite, slow end-to-end tests included: what CI runs (.ci/run)
#   ./run_tests.sh --fast     unit and component tests only: no `slow` (end-to-end) and no `multiproc` test
#                             (one that starts deepspeed ranks, a vLLM engine or launch.sh's processes); the loop to
#                             iterate with (a few minutes on 2 cores, docs/benchmarks.md#test-suite)
#   ./run_tests.sh --help     this text (pytest's own options: .venv/bin/python -m pytest --help)
#
# GRPO_TEST_WORKERS=N: test files run N at a time (default 2; 0: in this process, which -s needs).
# GRPO_TEST_FILLER=0: no filler worker, which the whole suite runs besides those N (unit and component files
# only, at a lower CPU priority: tests/xdist_filler.py).
# Each run prints its wall time and its 25 slowest tests.
set -euo pipefail
cd "$(dirname "$0")"
FAST_MARKS="not slow and not multiproc"
ARGS=()
for arg in "$@"; do
  case "$arg" in
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    --fast) ARGS+=(-m "$FAST_MARKS") ;;
    *) ARGS+=("$arg") ;;
  esac
done
if [[ " $* " == *" --fast "* ]] && [[ " $* " =~ \ -m\ |\ -m[^\ ]|\ --markexpr ]]; then
  echo "run_tests.sh: --fast is -m \"$FAST_MARKS\"; give one marker expression, not both" >&2; exit 2
fi
bash scripts/setup.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
# DeepSpeed JIT-builds its CPU shared-memory op (deepspeed_shm_comm) on every process's first init_distributed;
# in the shared ~/.cache/torch_extensions two checkouts' venvs (other include paths) rebuild it in turn, each
# build minutes of both cores with every rank waiting on its lock. One build per venv, kept in it:
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
# Two test files at a time (pytest-xdist; a file's tests stay together, so a module's shared run is made
# once): an end-to-end test spends much of its time waiting on its processes, and one file at a time left
# half of 2 cores idle (measured 102% CPU, 1113 s; two at a time 166%, 709 s). GRPO_TEST_WORKERS=0: one.
# Three at a time: -3% of wall for +4% of CPU, each test ~45% longer under its timeouts (docs/benchmarks.md).
# A test past 15 minutes is stuck (the slowest takes ~2.5): its stacks go to the log, so CI shows where.
# --no-loadscope-reorder: xdist otherwise hands out the files with the most tests first, which undid the slow-first
# order of tests/conftest.py and left the one- and two-test end-to-end files to the end, one worker running on alone.
# The whole suite (not --fast) runs one more worker, the filler: it takes only files with no slow or multiproc test,
# at a lower CPU priority, so it runs them in the seconds both end-to-end tests wait on their processes
# (tests/xdist_filler.py; ~12 % of 2 cores idled without it: docs/benchmarks.md#test-suite).
WORKERS=${GRPO_TEST_WORKERS:-2}
FILLER=()
if [[ " $* " != *" --fast "* ]] && [[ "$WORKERS" != 0 ]] && [[ "${GRPO_TEST_FILLER:-1}" != 0 ]]; then
  WORKERS=$((WORKERS + 1)); FILLER=(--filler-worker)
fi
exec .venv/bin/python -m pytest -q -ra --durations=25 -o faulthandler_timeout=900 -n "$WORKERS" "${FILLER[@]}" \
    --dist loadfile --no-loadscope-reorder "${ARGS[@]}"
