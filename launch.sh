#!/usr/bin/env bash
# Start the whole GRPO system: ref server, genonly workers and the DeepSpeed trainer.
#
#   ./launch.sh demo [--run-dir DIR] [--seed N] [--model M --data D ...]   the CPU demo (README, docs/demo.md)
#   ./launch.sh train [options] [-- trainer args...]                        a training run
#   ./launch.sh check [options] [-- trainer args...]                        check config, model, data, rewards,
#                                                    placement, port and disk in seconds (no weights loaded)
#   ./launch.sh status [--run-dir D] [--ref-url URL] [--json]                the run's status table (GET /status), or
#                                                    how it ended (exit code, last step, final model)
#   ./launch.sh python my_train.py [args...]         your script (a TRL script on trainer.api: docs/trl.md) with
#                                                    this checkout's venv and code, from where you run it
#
# Several hosts (one command per host; each keeps its own --run-dir, no shared filesystem; docs/nodes.md):
#   ./launch.sh ref-server --host ADDR --ref-model M [--port P] [--token-file F]     the reference model server
#   ./launch.sh trainer-host --nodes N --node-rank R --master-addr ADDR [--master-port P] [--gpus G]
#               --ref-url URL --run-dir DIR [--workers W] [--token-file F] [-- trainer args]
#                                                  this host's ranks (deepspeed --no_ssh --node_rank R)
#   ./launch.sh workers --ref-url URL --run-dir DIR [--workers N] [--first-id K] [--token-file F]
#               [--worker-gpus L] [--share-gpu] [--print-plan] [-- args]
#                                                  genonly workers on this host, each on GPU(s) of its own
#   ./launch.sh slurm --run-dir DIR [--config F] [--ref-nodes N] [--worker-nodes N] [--print-plan] [-- args]
#                                                  one task per node of a Slurm allocation: the node's roles from
#                                                  the allocation (examples/slurm/train.sbatch, docs/nodes.md#slurm)
#   ./launch.sh ROLE --help                        that role's options
#
# train options:
#   --run-dir DIR      where logs, metrics and checkpoints go (default: the output_dir given in the config or
#                      after --, else runs/<timestamp>; relative to where you run this, never the checkout)
#   --config FILE      trainer config JSON (passed to trainer/main.py and the workers)
#   --workers N        genonly workers to start on this machine (default 1)
#   --gpus N           trainer ranks on this machine (default on GPUs: the GPUs the others leave; on CPU 1 or 2,
#                      as measured at the model's shape: common/placement/cpu_ranks.py, said in the plan)
#   --worker-gpus L    GPU indices for the workers, in order, vllm_tensor_parallel_size each (e.g. 2,3; default:
#                      the highest free GPUs)
#   --rank-gpus L      GPU indices for the ranks (deepspeed --include localhost:L; default: the lowest free GPUs)
#   --share-gpu        let processes share GPUs (vLLM workers there get a memory fraction that fits)
#   --print-plan       print the placement plan (which process gets which GPU) and each process's memory
#                      estimate (docs/gpus.md), and exit without starting anything
#   --ref-url URL      use a running ref server instead of starting one
#   --ref-model M      model for the ref server (default: the trainer's --model, or 'tiny')
#   --ref-device D     device for the ref server (auto, cpu, cuda:N; default auto)
#   --ref-dtype D      dtype of the ref server's model (auto, bfloat16, float32; default auto)
#   --worker-dtype D   dtype of the genonly workers, also the dtype rank 0 publishes weights in (default auto)
#   --port P           port of the ref server started here (default 59875)
#   --token-file F     bearer token file shared by server and clients
#   --master-port P    DeepSpeed rendezvous port (default: a free one)
#   --keep-going       a genonly worker that exits does not end the run (a loud line; /status shows it exited);
#                      by default it ends the run with its name, exit code and last log lines
#   --skip-checks      start without the checks of `check` (a line says they were skipped): for a run whose
#                      inputs were checked already, e.g. the test suite's end-to-end runs (~10 s each)
# Options before `--` are launch.sh's (dashes or underscores); trainer options go after `--` (a trainer option
# given before it is refused, naming where it goes). `--config F` is passed on as the trainer's --config.
# Before anything starts, `train` runs the checks of `check` (trainer/check.py) and stops on a failure
# (unless --skip-checks).
# Placement: every process gets its own GPU(s) (common/placement/plan.py): ref server on the highest GPU, workers below
# it (vllm_tensor_parallel_size GPUs each), ranks from GPU 0; each sees only its GPUs (CUDA_VISIBLE_DEVICES). The
# plan is printed at start, written to RUN_DIR/placement.json and shown by the ref server's /status. One GPU: all
# share it (said so); a vLLM worker sharing a GPU with the ranks builds its engine once they are ready
# (--wait_for_ranks, docs/gpus.md). No GPU: CPU. `launch.sh workers` places a worker host's workers the same way.
# GRPO_PYTHON=/path/to/python: use that interpreter and its packages as they are (no scripts/setup.sh, no .venv).
# Everything this script starts is stopped on exit, error or Ctrl-C; each process logs to RUN_DIR/<name>.log
# (an earlier attempt's log is kept as <name>.log.1, .2, ...). Relative paths (--run-dir, --config, --token-file,
# and --model/--ref_model/--data/--ds_config/--sync_dir after --) are taken from where you run this script.
set -euo pipefail
CALLER_DIR=$(pwd)
USER_DIR_GIVEN=${GRPO_USER_DIR:-}
# your own modules and files (rewards, tools: 'my_rewards:fn', 'path/to/file.py:fn') load from here, in every process
export GRPO_USER_DIR="${GRPO_USER_DIR:-$CALLER_DIR}"  # (common/user_code.py)
cd "$(dirname "$0")"
ROOT=$(pwd)

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
[ $# -ge 1 ] || { usage; exit 2; }
MODE=$1; shift
ORIG_ARGS=("$@")  # as typed: the resume command repeats them (resume_command below)
# what a config error tells the user to run for the options: their own command, not trainer/main.py's
export GRPO_HELP_PROG="${GRPO_HELP_PROG:-$(basename "$0") $MODE --}"
case "$MODE" in
  -h|--help) usage; exit 0 ;;
  demo|train|check|status|python|ref-server|trainer-host|workers|slurm) ;;
  *) echo "unknown mode '$MODE'" >&2; usage; exit 2 ;;
esac

if [ -n "${GRPO_PYTHON:-}" ]; then  # an environment made elsewhere (bench/gpu_check.py's bare GPU machine)
  PY=$GRPO_PYTHON
else
  bash scripts/setup.sh
  PY="$ROOT/.venv/bin/python"
  export PATH="$ROOT/.venv/bin:$PATH"
  # DeepSpeed's JIT-built ops (the CPU shm op) in this venv: one build per venv, no lock shared with other checkouts
  export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.venv/torch_extensions}"
fi
export TOKENIZERS_PARALLELISM=false
if ! "$PY" -m common.placement.cuda; then  # (a CPU build of torch is told from its version file, not imported)
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

if [ "$MODE" = python ]; then  # the script in the caller's folder; `import trainer.api` finds this checkout
  cd "$CALLER_DIR"
  [ -n "$USER_DIR_GIVEN" ] || unset GRPO_USER_DIR  # the script's own folder, as trainer/api/process.py sets it
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" "$@"
fi
if [ "$MODE" = status ]; then
  GRPO_CALLER_DIR="$CALLER_DIR" exec "$PY" -m ref_server.status_cli "$@"  # --run-dir is relative to the caller
fi
if [ "$MODE" = demo ]; then
  GRPO_CALLER_DIR="$CALLER_DIR" exec "$PY" -m trainer.demo "$@"  # its relative paths are the caller's
fi
case "$MODE" in  # one host's role in a multi-host run (trainer/dist/hosts.py); a Slurm allocation's node (slurm.py)
  ref-server|trainer-host|workers) GRPO_CALLER_DIR="$CALLER_DIR" exec "$PY" -m trainer.dist.hosts "$MODE" "$@" ;;
  slurm) GRPO_CALLER_DIR="$CALLER_DIR" exec "$PY" -m trainer.dist.slurm "$@" ;;
esac

RUN_DIR=""; CONFIG=""; WORKERS=1; GPUS=""; REF_URL=""; REF_MODEL=""; REF_DEVICE=auto
PORT=59875; TOKEN_FILE=""; MASTER_PORT=""; EXTRA=(); REF_DTYPE=auto; WORKER_DTYPE=""; PLAN_FLAGS=(); PRINT_PLAN=""
KEEP_GOING=""; SKIP_CHECKS=""
from_caller() {  # a path the user typed, relative to where they ran us (we cd'ed to the repository)
  case "$1" in /*|"") printf '%s' "$1" ;; *) printf '%s' "$CALLER_DIR/$1" ;; esac
}
maybe_path() {  # a --model/--data value: a path when it names something there or starts with ./ ../ ~
  case "$1" in
    ./*|../*) from_caller "$1" ;;
    *) if [ -e "$CALLER_DIR/$1" ] && [ "$CALLER_DIR" != "$(pwd)" ]; then from_caller "$1"; else printf '%s' "$1"; fi ;;
  esac
}
while [ $# -gt 0 ]; do
  opt=$1; [ "${opt#--}" != "$opt" ] && opt="--$(printf '%s' "${opt#--}" | tr _ -)"  # --run_dir == --run-dir
  case "$opt" in
    --run-dir) RUN_DIR=$(from_caller "$2"); shift 2 ;;
    --config) CONFIG=$(from_caller "$2"); shift 2 ;;
    --workers) WORKERS=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --ref-url) REF_URL=$2; shift 2 ;;
    --ref-model) REF_MODEL=$(maybe_path "$2"); shift 2 ;;
    --ref-dtype) REF_DTYPE=$2; shift 2 ;;
    --worker-dtype) WORKER_DTYPE=$2; shift 2 ;;
    --ref-device) REF_DEVICE=$2; shift 2 ;;
    --worker-gpus|--rank-gpus) PLAN_FLAGS+=("$1" "$2"); shift 2 ;;
    --share-gpu) PLAN_FLAGS+=(--share-gpu); shift ;;
    --print-plan) PRINT_PLAN=1; shift ;;
    --port) PORT=$2; shift 2
      if ! [[ "$PORT" =~ ^[0-9]+$ ]] || (( 10#$PORT < 1 || 10#$PORT > 65535 )); then  # 0: a port nobody else learns
        echo "[launch] --port '$PORT': give the ref server a port number from 1 to 65535" >&2; exit 2
      fi ;;
    --token-file) TOKEN_FILE=$(from_caller "$2"); shift 2 ;;
    --master-port) MASTER_PORT=$2; shift 2 ;;
    --keep-going) KEEP_GOING=1; shift ;;
    --skip-checks) SKIP_CHECKS=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) if "$PY" -c "import sys; from common.config import GRPOConfig as C; sys.exit(0 if sys.argv[1] in C.__dataclass_fields__ else 1)" "$(printf '%s' "${opt#--}" | tr - _)" 2>/dev/null; then
         echo "[launch] '$1' is a trainer option: put it after '--' (./launch.sh $MODE [launch options] -- $1 ...)" >&2
       else
         echo "[launch] unknown option '$1' (./launch.sh $MODE --help lists them; trainer options go after '--')" >&2
       fi
       exit 2 ;;
  esac
done
for i in "${!EXTRA[@]}"; do  # path-valued trainer flags (either spelling, or --flag=value): relative to the caller too
  arg=${EXTRA[$i]}; flag=$(printf '%s' "${arg%%=*}" | tr - _)
  case "$flag" in
    __model|__ref_model|__data|__eval_data|__ds_config|__sync_dir)
      if [ "$arg" != "${arg#*=}" ]; then EXTRA[$i]="${arg%%=*}=$(maybe_path "${arg#*=}")"
      else j=$((i + 1)); [ $j -lt ${#EXTRA[@]} ] && EXTRA[$j]=$(maybe_path "${EXTRA[$j]}"); fi ;;
  esac
done
for arg in "${EXTRA[@]}"; do  # the trainer's own grouped --help (every GRPOConfig knob), not a run
  case "$arg" in -h|--help) exec "$PY" -m trainer.main --help ;; esac
done
[ -n "$WORKER_DTYPE" ] && EXTRA+=(--worker_dtype "$WORKER_DTYPE")  # workers load in it, rank 0 publishes in it
CFG_ARGS=(); [ -n "$CONFIG" ] && CFG_ARGS=(--config "$CONFIG")
# Which GPU(s) each process gets (common/placement/plan.py): sets PLAN_REF_ENV/PLAN_REF_DEVICE, PLAN_WORKER_ENV[w],
# PLAN_WORKER_ARGS[w] and PLAN_DS (deepspeed --include ... or --num_gpus N); prints the plan. The same process reads
# the config once for us (a bad config: one line, exit 2): PLAN_REF_MODEL, the trainer's model (from --config or
# --model in EXTRA), which also serves as reference unless told otherwise, and PLAN_OUTPUT_DIR, the output_dir the
# user gave (the last --output_dir after --, else the config file's).
[ -n "$GPUS" ] && PLAN_FLAGS+=(--gpus "$GPUS")
[ -n "$REF_URL" ] && PLAN_FLAGS+=(--no-ref)
[ -n "$REF_MODEL" ] && PLAN_FLAGS+=(--ref-model "$REF_MODEL")
[ -z "$PRINT_PLAN" ] && [ "$MODE" = train ] && PLAN_FLAGS+=(--check-torch)
PLAN=$("$PY" -m common.placement.launch_plan --workers "$WORKERS" --ref-device "$REF_DEVICE" "${PLAN_FLAGS[@]}" \
  --ref-dtype "$REF_DTYPE" -- "${CFG_ARGS[@]}" "${EXTRA[@]}") || exit 2
eval "$PLAN"
EXTRA+=("${PLAN_ALL_ARGS[@]}")  # one CPU rank taking two ranks' step: train_batch_groups for every process
[ -n "$REF_MODEL" ] || REF_MODEL=$PLAN_REF_MODEL
# The run directory: --run-dir, else the output_dir the user gave, else runs/<timestamp>, all relative to where
# the user runs this (never the checkout). A folder that already holds a run is used as --run-dir uses it.
[ -n "$RUN_DIR" ] || RUN_DIR=$(from_caller "${PLAN_OUTPUT_DIR:-runs/$(date +%Y%m%d-%H%M%S)}")
if [ -z "$PRINT_PLAN" ] && [ "$MODE" = train ]; then  # the plan the ref server's /status shows
  mkdir -p "$RUN_DIR" && printf '%s\n' "$PLAN_JSON" >"$RUN_DIR/placement.json"
fi
if [ -n "$PRINT_PLAN" ]; then  # what each process would be started with, then nothing is started
  [ -z "$REF_URL" ] && echo "ref_server: ${PLAN_REF_ENV:-(environment unchanged)} --device $PLAN_REF_DEVICE"
  for w in $(seq 0 $((WORKERS - 1))); do
    [ "$WORKERS" -gt 0 ] && echo "worker$w: ${PLAN_WORKER_ENV[$w]:-(environment unchanged)} ${PLAN_WORKER_ARGS[$w]}"
  done
  TRAIN_SHOWN=("${PLAN_ALL_ARGS[@]}" "${PLAN_TRAIN_ARGS[@]}")
  echo "trainer: deepspeed ${PLAN_DS[*]}${TRAIN_SHOWN[*]:+ ${TRAIN_SHOWN[*]}}"
  exit 0
fi
# The checks of trainer/check.py (config, model, data, rewards, port, disk): `check` stops here, `train` goes on
# only if they pass (the placement plan above was the first check).
CHECK_ARGS=(--run-dir "$RUN_DIR" --port "$PORT"); [ -n "$REF_URL" ] && CHECK_ARGS+=(--ref-url "$REF_URL")
if [ "$MODE" = check ]; then
  [ -n "$SKIP_CHECKS" ] && { echo "[launch] --skip-checks is for train: check is the checks" >&2; exit 2; }
  exec "$PY" -m trainer.check "${CHECK_ARGS[@]}" -- "${CFG_ARGS[@]}" "${EXTRA[@]}"
fi
if [ -n "$SKIP_CHECKS" ]; then  # asked for by name, never a default: a bad input then fails in the process that reads it
  echo "[launch] --skip-checks: the checks of 'launch.sh check' were not run" >&2
else
  CHECK_LOG=$(mktemp)
  "$PY" -m trainer.check "${CHECK_ARGS[@]}" -- "${CFG_ARGS[@]}" "${EXTRA[@]}" | tee "$CHECK_LOG" | sed 's/^/[check] /' >&2 || {
    fails=$(sed -n 's/^FAIL *//p' "$CHECK_LOG" | paste -sd ';' | cut -c1-400); rm -f "$CHECK_LOG"  # named on the last line
    echo "[launch] a check failed ($fails): nothing was started" >&2; exit 2; }
  rm -f "$CHECK_LOG"
fi
mkdir -p "$RUN_DIR"
rm -f "$RUN_DIR/diagnosis.txt" "$RUN_DIR/stop_request"  # a rank's line; an earlier attempt's stop request
if [ -z "$MASTER_PORT" ]; then  # not DeepSpeed's fixed 29500: two runs on one machine must not collide
  MASTER_PORT=$("$PY" -m common.listen)  # outside the ephemeral range: no outgoing connection takes it meanwhile
fi

resume_command() {  # the command as typed, in this run directory, with --resume true
  local launch=() trainer=() seen_sep="" skip="" a
  for a in "${ORIG_ARGS[@]}"; do
    if [ -n "$skip" ]; then skip=""; continue; fi
    if [ -z "$seen_sep" ]; then
      case "$a" in --) seen_sep=1 ;; --run-dir|--run_dir) skip=1 ;; *) launch+=("$a") ;; esac
    else
      case "$a" in --resume|--resume=*) [ "$a" = --resume ] && skip=1 ;; *) trainer+=("$a") ;; esac
    fi
  done
  printf 'cd %q && %q %s' "$CALLER_DIR" "$ROOT/launch.sh" "$MODE"
  printf ' %q' "${launch[@]}" --run-dir "$RUN_DIR" -- "${trainer[@]}" --resume true
}
PIDS=(); declare -A NAMES=()  # every process started here, and its name (pid -> name) for the watch below
cleanup() {
  local code=$?
  trap - EXIT INT TERM
  # A signal between `cmd &` and `PIDS+=($!)` runs this trap with that child not yet listed (seen under load:
  # the trainer kept running, its tee holding our stderr, until the ranks gave up minutes later): every
  # background job this shell started is stopped too.
  local job; for job in $(jobs -p); do PIDS+=("$job"); done
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; done
  # a stopped (SIGSTOP) process only sees the TERM once continued
  for pid in "${PIDS[@]}"; do kill -CONT -- "-$pid" 2>/dev/null || kill -CONT "$pid" 2>/dev/null || true; done
  local skipped_drain=""
  for _ in $(seq 1 150); do  # up to 15 s
    alive=0; for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    # The ref server keeps scored batches for the ranks to fetch for drain_timeout after a TERM; the ranks are
    # stopped here too, so once they are gone that wait is for nobody: a 2nd TERM skips it (ref_server/serve.py).
    # Two TERMs that arrive as one leave the drain as it was.
    if [ -n "$REF_PID" ] && [ -z "$skipped_drain" ] && ! kill -0 "${TRAINER:-}" 2>/dev/null; then
      kill -TERM "$REF_PID" 2>/dev/null || true; skipped_drain=1
    fi
    sleep 0.1
  done
  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  echo "[launch] stopped everything; logs in $RUN_DIR" >&2
  # how it ended, for `launch.sh status` once the server is gone; a checkpoint the stop left half-written goes
  "$PY" -m common.run_record end "$RUN_DIR" "$code" || true
  # a rank that stopped on purpose (stall, dead peer) left one line saying why: it is our last line
  if [ "$code" != 0 ] && [ -s "$RUN_DIR/diagnosis.txt" ]; then
    echo "[launch] run failed (exit $code): $(head -n 1 "$RUN_DIR/diagnosis.txt")" >&2
  fi
  if { [ "$code" = 130 ] || [ "$code" = 143 ]; } && [ -s "$RUN_DIR/ds/latest" ]; then  # the last line: how to go on
    echo "[launch] interrupted; to continue this run from its last checkpoint: $(resume_command)" >&2
  elif [ "$code" = 130 ] || [ "$code" = 143 ]; then  # --resume would find no checkpoint and start from step 0
    echo "[launch] interrupted before the first checkpoint (save_steps): there is nothing to resume; run the same command again to start over" >&2
  fi
  exit $code
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

rotate() {  # keep an earlier attempt's log (a crashed run's, before --resume) as NAME.log.1, .2, ...
  local f="$RUN_DIR/$1.log" n=1
  [ -e "$f" ] || return 0
  while [ -e "$f.$n" ]; do n=$((n + 1)); done
  mv "$f" "$f.$n"
}
start() {  # start NAME CMD...: own process group, log to RUN_DIR/NAME.log
  local name=$1; shift
  rotate "$name"
  setsid "$@" >"$RUN_DIR/$name.log" 2>&1 &
  PIDS+=($!)
  NAMES[$!]=$name
  echo "[launch] $name (pid $!) -> $RUN_DIR/$name.log" >&2
}

TOKEN_ARGS=()
if [ -n "$TOKEN_FILE" ]; then
  export GRPO_REF_TOKEN=$(tr -d '[:space:]' <"$TOKEN_FILE")
  TOKEN_ARGS=(--token-file "$TOKEN_FILE")
fi
NONCE=""; REF_PID=""
[ -n "$REF_URL" ] || REF_URL_STARTED="http://127.0.0.1:$PORT"
"$PY" -m common.run_record start "$RUN_DIR" "${REF_URL:-$REF_URL_STARTED}"  # `launch.sh status --run-dir` asks it
if [ -z "$REF_URL" ]; then
  REF_URL="http://127.0.0.1:$PORT"
  NONCE=$("$PY" -c "import secrets; print(secrets.token_hex(8))")  # /health echoes it: our server, no stranger's
  start ref_server env $PLAN_REF_ENV "$PY" -m ref_server --model "$REF_MODEL" --port "$PORT" \
    --device "$PLAN_REF_DEVICE" --dtype "$REF_DTYPE" --run-nonce "$NONCE" --placement-file "$RUN_DIR/placement.json" \
    "${TOKEN_ARGS[@]}" "${PLAN_REF_ARGS[@]}"
  REF_PID=${PIDS[-1]}
fi
echo "[launch] waiting for $REF_URL/health" >&2
# health: 0 = ours and healthy, 3 = healthy but another run's server, 1 = not answering yet
health() {
  "$PY" - "$REF_URL" "$NONCE" <<'PYEOF' 2>/dev/null
import sys, requests
url, nonce = sys.argv[1], sys.argv[2]
try:
    r = requests.get(url + "/health", timeout=2)
except requests.RequestException:
    sys.exit(1)
if not r.ok:
    sys.exit(1)
h = r.json()
if nonce and h.get("run_nonce") != nonce:
    print(f"pid {h.get('pid')}, model {h.get('model')}")
    sys.exit(3)
PYEOF
}
# Polled every 0.2 s: a started server is asked (a Python process) once its port takes connections (bash's
# /dev/tcp), and every 5th poll in any case (a bash built without /dev/tcp, a server elsewhere); up to 300 s.
for i in $(seq 1 1500); do
  if [ -n "$REF_PID" ] && ! kill -0 "$REF_PID" 2>/dev/null; then  # died (port taken, bad model...): no wait
    echo "[launch] the ref server exited before becoming healthy; last lines of $RUN_DIR/ref_server.log:" >&2
    tail -n 15 "$RUN_DIR/ref_server.log" | sed 's/^/    /' >&2
    exit 1
  fi
  if [ $((i % 5)) != 1 ] && ! { [ -n "$REF_PID" ] && (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }; then
    sleep 0.2; continue
  fi
  set +e; who=$(health); hc=$?; set -e
  [ $hc = 0 ] && break
  if [ $hc = 3 ]; then
    echo "[launch] port $PORT is answered by another run's ref server ($who), not the one started here; pick a free --port" >&2
    exit 1
  fi
  [ "$i" -ge 1496 ] && { echo "[launch] ref server did not become healthy; see $RUN_DIR/ref_server.log" >&2; exit 1; }
  sleep 0.2
done
for w in $(seq 0 $((WORKERS - 1))); do
  [ "$WORKERS" -gt 0 ] || break
  # shellcheck disable=SC2086  # the plan's env prefix and extra flags are words without spaces
  start "worker$w" env ${PLAN_WORKER_ENV[$w]} "$PY" trainer/main.py genonly "${CFG_ARGS[@]}" "${EXTRA[@]}" \
    ${PLAN_WORKER_ARGS[$w]} --ref_server "$REF_URL" --worker_id "$w" \
    --output_dir "$RUN_DIR"  # the worker keeps its data-order state there (exact resume)
done
rotate trainer
echo "[launch] trainer: deepspeed ${PLAN_DS[*]} (log: $RUN_DIR/trainer.log)" >&2
# In the background with `wait`: bash runs a trap only after the foreground command ends, so a
# Ctrl-C / SIGINT to this script would otherwise wait for the whole run. Own process group, like the
# others, so that cleanup stops the launcher and every rank.
setsid deepspeed "${PLAN_DS[@]}" --master_port "$MASTER_PORT" trainer/main.py "${CFG_ARGS[@]}" "${EXTRA[@]}" \
  "${PLAN_TRAIN_ARGS[@]}" --ref_server "$REF_URL" --num_gen_workers "$WORKERS" --output_dir "$RUN_DIR" > >(tee "$RUN_DIR/trainer.log") 2>&1 &
TRAINER=$!
PIDS+=("$TRAINER")
# Watch every child until the trainer ends: a ref server that exits, or a worker that fails, ends the run with
# its name, exit code and last log lines (--keep-going: a worker's exit is a loud line and its row in /status).
while kill -0 "$TRAINER" 2>/dev/null; do
  for pid in "${!NAMES[@]}"; do
    kill -0 "$pid" 2>/dev/null && continue
    name=${NAMES[$pid]}; unset "NAMES[$pid]"
    set +e; wait "$pid"; code=$?; set -e
    if [ "$code" = 0 ] && [ "$name" != ref_server ]; then
      echo "[launch] $name finished (exit 0) while the trainer runs on" >&2; continue
    fi
    echo "[launch] $name exited with code $code while the trainer was running; last lines of $RUN_DIR/$name.log:" >&2
    tail -n 15 "$RUN_DIR/$name.log" | sed 's/^/    /' >&2
    if [ -n "$KEEP_GOING" ] && [ "$name" != ref_server ]; then
      echo "[launch] !!! --keep-going: the run goes on WITHOUT $name (the ranks generate for themselves after get_wait)" >&2
      "$PY" -m trainer.dist.exits "$REF_URL" "$name" "$code" || true
      continue
    fi
    # the process's own one-line diagnosis (trainer/main.py: its name, the exception, the cause), else its last line
    own=$(head -n 1 "$RUN_DIR/diagnosis.txt" 2>/dev/null || true); why=${own#"$name: "}
    [ -n "$why" ] || why=$(grep -v '^\s*$' "$RUN_DIR/$name.log" | tail -n 1 | cut -c1-300)
    echo "$name exited with code $code: $why (see $RUN_DIR/$name.log; --keep-going to go on without it)" >"$RUN_DIR/diagnosis.txt"
    case "$code" in 7|8) [ -n "$own" ] && exit "$code" ;; esac  # "nothing to train on" (trainer/run/stall.py): docs/hangs.md
    exit 3
  done
  sleep 0.2
done
set +e
wait "$TRAINER"
rc=$?
set -e
exit "$rc"
