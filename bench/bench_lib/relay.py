"""A real ref server process that only relays weights, for bench/weight_sync.py and bench/weight_sync_file.py (one
definition, so neither script imports the other's)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import torch

from common.listen import free_port

REPO = Path(__file__).resolve().parents[2]


def start_server(model: torch.nn.Module) -> tuple[subprocess.Popen, str]:
    """A real ref server process; it only relays weights, so it loads the tiny model as its reference. Its
    --max_weights_mb fits `model` published in float32 (the widest dtype a publish uses) plus 64 MiB for the
    header: the default, derived from the tiny model (~70 MiB, ref_server/weights_limit.py), would refuse the
    published weights with 413. (Computed here, not by ref_server.weights_limit: the bench measures the relay.)"""
    from common.tiny_model import ensure_tiny_model
    limit_mb = math.ceil(sum(p.numel() for p in model.parameters()) * 4 / (1 << 20)) + 64
    port = free_port()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    log = tempfile.TemporaryFile()  # its output, shown if it does not start
    srv = subprocess.Popen([sys.executable, "-m", "ref_server", "--model", str(ensure_tiny_model()), "--port",
                            str(port), "--max_weights_mb", str(limit_mb)],
                           cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if requests.get(url + "/health", timeout=1).ok:
                return srv, url
        except requests.RequestException:
            if srv.poll() is not None:
                break
            time.sleep(0.2)
    srv.terminate()
    srv.wait(30)
    log.seek(0)
    tail = log.read().decode(errors="replace").strip().splitlines()[-5:]
    raise SystemExit("ref server did not start: " + " | ".join(tail))
