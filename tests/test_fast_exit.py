"""common/fast_exit.py: a process that ended cleanly leaves without the interpreter's teardown, but with what a
normal exit does that matters: non-daemon threads joined, atexit handlers run, stdout/stderr flushed."""
from __future__ import annotations

import subprocess
import sys

from conftest import REPO, subprocess_env

SCRIPT = r"""
import atexit, sys, threading, time
from common.fast_exit import exit_cleanly

class Teardown:
    def __del__(self):  # runs only in the interpreter's teardown (module globals cleared)
        open(OUT + "/teardown", "w").write("ran")

OUT = sys.argv[1]
keep = Teardown()
atexit.register(lambda: open(OUT + "/atexit", "w").write("ran"))
threading.Thread(target=lambda: (time.sleep(0.3), open(OUT + "/thread", "w").write("ran"))).start()
sys.stdout.write("no newline, still buffered")
sys.stderr.write("said on stderr")
exit_cleanly(0)
print("never")
"""


def test_exit_cleanly_runs_exit_handlers_joins_threads_flushes_and_skips_the_teardown(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=subprocess_env(PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "no newline, still buffered" and proc.stderr == "said on stderr"
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()  # what a plain exit would have spent its time on

