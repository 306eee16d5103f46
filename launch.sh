#!/usr/bin/env bash
# Start the whole GRPO system: ref server, genonly workers and the DeepSpeed trainer.
#
#   ./launch.sh demo [--run-dir DIR] [--seed N] [--model M --data D ...]   the CPU demo (see README)
#   ./launch.sh train [options] [-- trainer args...]                        a training run
#   ./launch.sh status [--ref-url URL] [--token-file F] [--json]             the run's status table (GET /status)
#
# train options:
#   --run-dir DIR      where logs, metrics and checkpoints go (default runs/<timestamp>)
#   --config FILE      trainer config JSON (passed to trainer/main.py and the workers)
#   --workers N        genonly workers to start on this machine (default 1)
#   --gpus N           trainer ranks on this machine (deepspeed --num_gpus; default 2 on CPU, all GPUs on CUDA)
#   --ref-url URL      use a running ref server instead of starting one
#   --ref-model M      model for the ref server (default: the trainer's --model, or 'tiny')
#   --ref-device D     device for the ref server (auto, cpu, cuda:N; default auto)
#   --port P           port of the ref server started here (default 59875)
#   --token-file F     bearer token file shared by server and clients
#   --master-port P    DeepSpeed rendezvous port (default: a free one)
# Everything this script starts is stopped on exit, error or Ctrl-C; each process logs to RUN_DIR/<name>.log.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
[ $# -ge 1 ] || { usage; exit 2; }
MODE=$1; shift
case "$MODE" in
  -h|--help) usage; exit 0 ;;
  demo|train|status) ;;
  *) echo "unknown mode '$MODE'" >&2; usage; exit 2 ;;
esac

bash scripts/setup.sh
PY="$ROOT/.venv/bin/python"
export PATH="$ROOT/.venv/bin:$PATH"
export TOKENIZERS_PARALLELISM=false
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

if [ "$MODE" = status ]; then
  exec "$PY" -m ref_server.status_cli "$@"
fi
if [ "$MODE" = demo ]; then
  exec "$PY" -m trainer.demo "$@"
fi

RUN_DIR="runs/$(date +%Y%m%d-%H%M%S)"; CONFIG=""; WORKERS=1; GPUS=""; REF_URL=""; REF_MODEL=""; REF_DEVICE=auto
PORT=59875; TOKEN_FILE=""; MASTER_PORT=""; EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --run-dir) RUN_DIR=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --workers) WORKERS=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --ref-url) REF_URL=$2; shift 2 ;;
    --ref-model) REF_MODEL=$2; shift 2 ;;
    --ref-device) REF_DEVICE=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --token-file) TOKEN_FILE=$2; shift 2 ;;
    --master-port) MASTER_PORT=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option '$1'" >&2; usage; exit 2 ;;
  esac
done
mkdir -p "$RUN_DIR"
rm -f "$RUN_DIR/diagnosis.txt"  # written by a rank that stops on purpose (trainer/health.py)
CFG_ARGS=(); [ -n "$CONFIG" ] && CFG_ARGS=(--config "$CONFIG")
# The trainer's model (from --config or --model in EXTRA) also serves as reference unless told otherwise.
if [ -z "$REF_MODEL" ]; then
  REF_MODEL=$("$PY" - "${CFG_ARGS[@]}" "${EXTRA[@]}" <<'PYEOF'
import sys
from common.config import GRPOConfig, load_config
cfg = load_config(GRPOConfig, sys.argv[1:])
print(cfg.ref_model or cfg.model)
PYEOF
)
fi
if [ -z "$MASTER_PORT" ]; then  # not DeepSpeed's fixed 29500: two runs on one machine must not collide
  MASTER_PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
fi
if [ -z "$GPUS" ]; then
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() or 2)")
fi

PIDS=()
cleanup() {
  local code=$?
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; done
  # a stopped (SIGSTOP) process only sees the TERM once continued
  for pid in "${PIDS[@]}"; do kill -CONT -- "-$pid" 2>/dev/null || kill -CONT "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 30); do
    alive=0; for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.5
  done
  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  echo "[launch] stopped everything; logs in $RUN_DIR" >&2
  # a rank that stopped on purpose (stall, dead peer) left one line saying why: it is our last line
  if [ "$code" != 0 ] && [ -s "$RUN_DIR/diagnosis.txt" ]; then
    echo "[launch] run failed (exit $code): $(head -n 1 "$RUN_DIR/diagnosis.txt")" >&2
  fi
  exit $code
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start() {  # start NAME CMD...: own process group, log to RUN_DIR/NAME.log
  local name=$1; shift
  setsid "$@" >"$RUN_DIR/$name.log" 2>&1 &
  PIDS+=($!)
  echo "[launch] $name (pid $!) -> $RUN_DIR/$name.log" >&2
}

TOKEN_ARGS=()
if [ -n "$TOKEN_FILE" ]; then
  export GRPO_REF_TOKEN=$(tr -d '[:space:]' <"$TOKEN_FILE")
  TOKEN_ARGS=(--token-file "$TOKEN_FILE")
fi
if [ -z "$REF_URL" ]; then
  REF_URL="http://127.0.0.1:$PORT"
  start ref_server "$PY" -m ref_server --model "$REF_MODEL" --port "$PORT" --device "$REF_DEVICE" "${TOKEN_ARGS[@]}"
fi
echo "[launch] waiting for $REF_URL/health" >&2
for i in $(seq 1 300); do
  if "$PY" -c "import requests,sys; sys.exit(0 if requests.get('$REF_URL/health', timeout=2).ok else 1)" 2>/dev/null; then break; fi
  [ "$i" = 300 ] && { echo "[launch] ref server did not become healthy; see $RUN_DIR/ref_server.log" >&2; exit 1; }
  sleep 1
done
for w in $(seq 0 $((WORKERS - 1))); do
  [ "$WORKERS" -gt 0 ] || break
  start "worker$w" "$PY" trainer/main.py genonly "${CFG_ARGS[@]}" "${EXTRA[@]}" --ref_server "$REF_URL" --worker_id "$w" \
    --output_dir "$RUN_DIR"  # the worker keeps its data-order state there (exact resume)
done
echo "[launch] trainer: deepspeed --num_gpus $GPUS (log: $RUN_DIR/trainer.log)" >&2
# In the background with `wait`: bash runs a trap only after the foreground command ends, so a
# Ctrl-C / SIGINT to this script would otherwise wait for the whole run. Own process group, like the
# others, so that cleanup stops the launcher and every rank.
setsid deepspeed --num_gpus "$GPUS" --master_port "$MASTER_PORT" trainer/main.py "${CFG_ARGS[@]}" "${EXTRA[@]}" \
  --ref_server "$REF_URL" --num_gen_workers "$WORKERS" --output_dir "$RUN_DIR" > >(tee "$RUN_DIR/trainer.log") 2>&1 &
TRAINER=$!
PIDS+=("$TRAINER")
set +e
wait "$TRAINER"
rc=$?
set -e
exit "$rc"
