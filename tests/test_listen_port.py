"""common/listen.py free_port_for_later: launch.sh's DeepSpeed master port (and the suite's server ports) come from
outside the kernel's ephemeral range, where no outgoing connection takes them between the pick and the bind."""
from __future__ import annotations

import socket
import subprocess
import sys

from conftest import REPO, subprocess_env

from common import listen


def test_the_port_is_free_and_outside_the_ephemeral_range():
    lo, hi = listen.ephemeral_range()
    for _ in range(20):
        port = listen.free_port_for_later()
        assert not lo <= port <= hi and 10000 <= port <= 65535
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free


def test_a_range_file_it_cannot_read_means_linuxs_default(tmp_path, monkeypatch):
    monkeypatch.setattr(listen, "PORT_RANGE_FILE", tmp_path / "missing")
    assert listen.ephemeral_range() == (32768, 60999)
    (tmp_path / "range").write_text("20000\t50000\n")
    monkeypatch.setattr(listen, "PORT_RANGE_FILE", tmp_path / "range")
    assert listen.ephemeral_range() == (20000, 50000)
    assert not 20000 <= listen.free_port_for_later() <= 50000


def test_with_every_port_in_the_range_the_os_picks(tmp_path, monkeypatch):
    (tmp_path / "range").write_text("1024 65535\n")
    monkeypatch.setattr(listen, "PORT_RANGE_FILE", tmp_path / "range")
    assert 1024 <= listen.free_port_for_later() <= 65535


def test_launch_sh_gets_its_master_port_from_the_module():
    proc = subprocess.run([sys.executable, "-m", "common.listen"], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=60)
    lo, hi = listen.ephemeral_range()
    assert proc.returncode == 0 and not lo <= int(proc.stdout) <= hi, proc.stderr
    assert '"$PY" -m common.listen' in (REPO / "launch.sh").read_text()
