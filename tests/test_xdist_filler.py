"""The suite's filler worker (tests/xdist_filler.py, `pytest --filler-worker`, what ./run_tests.sh runs): the last
worker takes only files with no slow or multiproc test, the others take those first, and the filler runs at a lower
CPU priority in a session of its own."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import xdist_filler
from conftest import REPO, subprocess_env

HEAVY = "tests/test_start_order.py"  # slow and multiproc tests beside a quick one: -k keeps that, the file stays heavy
LIGHT = ("tests/test_child_pipe.py", "tests/test_cli.py")  # quick, and none imports torch: three workers collect


@pytest.mark.multiproc
def test_the_filler_takes_only_files_without_a_slow_or_multiproc_test():
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "3", "--dist", "loadfile",
           "--no-loadscope-reorder", "--filler-worker", *LIGHT, HEAVY, "-k", "recent_heartbeat or not test_start_order"]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran: dict[str, set[str]] = {}
    for worker, path in re.findall(r"^\[(gw\d)\] \[ *\d+%\] PASSED (tests/\w+\.py)::", proc.stdout, re.M):
        ran.setdefault(path, set()).add(worker)
    assert set(ran) == {HEAVY, *LIGHT}, proc.stdout[-3000:]
    assert all(len(w) == 1 for w in ran.values()), ran  # a file stays on one worker (its module fixtures: once)
    assert ran[HEAVY] != {"gw2"}, ran  # never on the filler (gw2 of 3), though third in line
    assert {"gw2"} in ran.values(), ran  # the filler ran a light file


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="Linux autogroup only")
def test_the_filler_runs_in_a_session_of_its_own_at_a_lower_priority():
    code = ("import os, xdist_filler; before = os.getsid(0); xdist_filler.lower_priority(); "
            "print(os.getsid(0) != before, open('/proc/self/autogroup').read().split()[-1], os.nice(0))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO / "tests", capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO / "tests")), timeout=60)
    assert out.stdout.split() == ["True", str(xdist_filler.NICE), str(xdist_filler.NICE)], out.stderr


@pytest.mark.parametrize("args", [["-n", "1"], ["-n", "2", "--dist", "load"], ["-p", "no:xdist"]],
                         ids=["one_worker", "dist_load", "no_xdist"])
def test_the_filler_without_the_workers_it_needs_is_a_usage_error(args):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "--filler-worker",
                           "tests/test_cli.py"], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--filler-worker needs -n 2 or more and --dist loadfile" in proc.stderr, proc.stderr[-2000:]


def test_a_refused_priority_change_is_one_line_and_the_filler_runs_on():
    # a session leader may not call setsid() again (EPERM): the refusal the filler must survive
    code = "import os, xdist_filler; os.setsid(); xdist_filler.lower_priority(); print('ran on')"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO / "tests", capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO / "tests")), timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ran on", out.stderr
    assert out.stderr.count("\n") == 1 and "could not lower the filler's CPU priority" in out.stderr, out.stderr
