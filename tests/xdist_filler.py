"""The filler worker: one extra pytest-xdist worker that runs only the unit and component test files, at a lower CPU
priority, in the time the end-to-end files' workers wait on their processes (`pytest --filler-worker`, which
./run_tests.sh passes for the whole suite; tests/conftest.py imports the hooks below, pytest finds them there).

Why: two files at a time (run_tests.sh) left ~12 % of 2 cores idle, a few seconds here and there while both end-to-end
tests waited on their ref servers, ranks and workers; a third worker taking any file ran three end-to-end runs at once,
each ~45 % longer under its timeouts, for 3 % of wall (docs/benchmarks.md#test-suite). The filler never takes a file
with a `slow` or `multiproc` test (what `./run_tests.sh --fast` leaves out), so no timing-bound run shares the box with
two others, and it runs at a lower priority, so it mostly takes what would idle. The other workers take those files
first, in collection order (tests/conftest.py puts the slow ones first), then any unit file the filler has not reached.

How: each worker writes the files it collected with such a test to a file the controller named (workers collect,
the controller does not); LoadFileScheduling, one file per work unit, then hands each worker only the files it may
run. The filler leaves its parent's session: Linux shares the CPU between sessions first (autogroup: each of
launch.sh's processes is a session of its own), so only a session of its own makes a lower priority count.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling

OPTION = "--filler-worker"
HEAVY_MARKS = ("slow", "multiproc")  # run_tests.sh --fast leaves these out: not for the filler
NICE = 5  # one autogroup at nice 5 weighs 335 against 1024: ~25 % of a core it contends for, all of an idle one
PLAN_KEY, FILLER_KEY = "grpo_heavy_files", "grpo_filler"


def filler_id(config) -> str:
    """The last worker (gw0, gw1, ... as xdist names them) fills."""
    return f"gw{int(config.getoption('numprocesses')) - 1}"


def pytest_addoption(parser):
    parser.addoption(OPTION, action="store_true",
                     help="with -n N (N >= 2): the last worker runs only the files with no slow or multiproc test, "
                          "at a lower CPU priority, while the others run those first (tests/xdist_filler.py); "
                          "./run_tests.sh passes it for the whole suite")


def filling(config) -> bool:
    return (bool(config.getoption(OPTION)) and int(config.getoption("numprocesses", 0) or 0) >= 2
            and config.getoption("dist", "no") == "loadfile")  # defaults: with -p no:xdist neither option exists


def configure(config) -> None:
    """From conftest's pytest_configure. The filler worker: lower its priority. The controller: refuse the option
    where it cannot work."""
    if getattr(config, "workerinput", {}).get(FILLER_KEY):
        lower_priority()
    elif not hasattr(config, "workerinput") and config.getoption(OPTION) and not filling(config):
        raise pytest.UsageError(f"{OPTION} needs -n 2 or more and --dist loadfile (./run_tests.sh passes all three)")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Controller: tell each worker where to list its heavy files, and the last one that it fills."""
    if filling(node.config):
        if not hasattr(node.config, "_grpo_plan_dir"):
            node.config._grpo_plan_dir = tempfile.mkdtemp(prefix="grpo-test-plan-")
        node.workerinput[PLAN_KEY] = os.path.join(node.config._grpo_plan_dir, "heavy.json")
        node.workerinput[FILLER_KEY] = node.gateway.id == filler_id(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if filling(config):  # the nodes were configured first: the plan's folder is there
        return FillerScheduling(config, log, os.path.join(config._grpo_plan_dir, "heavy.json"))
    return None  # xdist's own


def pytest_unconfigure(config):
    if getattr(config, "_grpo_plan_dir", None):
        shutil.rmtree(config._grpo_plan_dir, ignore_errors=True)


def write_heavy_files(config, items) -> None:
    """Worker side, at collection (from conftest's pytest_collection_modifyitems), with --filler-worker: the files
    with a slow or multiproc test. Every worker writes the same list; written whole and renamed into place, so the
    controller never reads half of one."""
    path = getattr(config, "workerinput", {}).get(PLAN_KEY)
    if not path:
        return
    heavy = sorted({item.nodeid.split("::", 1)[0] for item in items
                    if any(item.get_closest_marker(m) for m in HEAVY_MARKS)})
    tmp = f"{path}.{os.getpid()}"
    Path(tmp).write_text(json.dumps(heavy))
    os.replace(tmp, path)


def lower_priority() -> None:
    """Worker side, the filler: a session of its own at nice NICE, and the process at nice NICE within it. Where the
    system refuses a step (a read-only /proc, say), the filler says so in one line and runs on without it: slower
    end-to-end tests beside it, not a failed suite."""
    autogroup = Path("/proc/self/autogroup")
    try:
        os.setsid()
        if autogroup.exists():  # Linux with CONFIG_SCHED_AUTOGROUP: the session's weight is what counts
            autogroup.write_text(str(NICE))
        os.nice(NICE)  # without autogroup, the process's own nice is what counts
    except OSError as e:
        sys.stderr.write(f"{OPTION}: could not lower the filler's CPU priority ({e}); it runs at the usual one\n")


class FillerScheduling(LoadFileScheduling):
    """LoadFileScheduling, except that the filler worker gets only files with no slow or multiproc test, and the
    other workers take those heavy files before any other. A filler with nothing it may take shuts down; if it is
    the only worker left (one file asked for, the other workers shut down as unneeded), it takes anything."""

    def __init__(self, config, log=None, plan_path: str = ""):
        super().__init__(config, log)
        self.plan_path, self.filler, self.heavy = plan_path, filler_id(config), None

    def schedule(self) -> None:
        if self.heavy is None and self.collection_is_completed:
            try:
                self.heavy = set(json.loads(Path(self.plan_path).read_text()))
            except (OSError, ValueError) as e:
                raise RuntimeError(f"{OPTION}: no list of heavy test files from the workers at {self.plan_path} "
                                   f"({e}); run without {OPTION}") from e
        super().schedule()

    def _pick(self, node) -> str | None:
        """The first file in the queue this node may run, or None."""
        if node.gateway.id == self.filler and any(n.gateway.id != self.filler and not n.shutting_down
                                                  for n in self.nodes):
            return next((s for s in self.workqueue if s not in self.heavy), None)
        return next((s for s in self.workqueue if s in self.heavy), next(iter(self.workqueue), None))

    def _assign_work_unit(self, node) -> None:
        scope = self._pick(node)
        if scope is None:
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if self._pick(node) is None:  # nothing left it may run: it finishes what it has, then stops
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 2:  # as LoadScopeScheduling: refill when nearly done
            return
        self._assign_work_unit(node)
