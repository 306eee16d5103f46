"""trainer/run/health.py Watchdog's peer check on real processes: a peer that exits (SIGKILL, left a zombie until
its parent reaps it) is named; one still running is not."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

from common.config import GRPOConfig
from common.settings.knobs import load_config
from trainer.run.health import Watchdog


def test_peer_diagnosis_names_a_peer_that_dies_within_the_grace():
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        host = os.uname().nodename
        wd = Watchdog(load_config(GRPOConfig, []), None, rank=0, peers=[(host, os.getpid()), (host, peer.pid)])
        wd.activity = "training step 3"
        assert wd.dead_peers() == []
        line = wd.peer_diagnosis(RuntimeError("Connection reset by peer"))
        assert "a peer rank (not on this host, or stuck) stopped answering" in line, line
        # the collective failed a moment before the peer process is gone: the grace looks again
        threading.Timer(0.3, peer.kill).start()
        line = wd.peer_diagnosis(RuntimeError("Connection reset by peer"), grace=10.0)
        assert line.startswith(f"rank 0: rank 1 (pid {peer.pid} on {host}) is gone while this rank was "
                               "training step 3: RuntimeError: Connection reset by peer"), line
    finally:
        peer.kill()
        peer.wait()
