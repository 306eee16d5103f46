"""CPU-seconds of a command's whole process tree: every process it starts (ranks, ref server, worker, vLLM's engine
core, ...) found by sampling, each one's user + system time read until it exits.

psutil reads each live process's own CPU time (not its children's); a process is remembered from the first sample
that sees it, so one that is re-parented away from the tree (a daemonised child) is still counted. What a sample
misses: the CPU time of a process in its last interval before it exits, and processes that live less than one
interval (shell helpers). getrusage(RUSAGE_CHILDREN) of the launched command, which counts every descendant that
was waited for by its parent, is reported beside as a cross-check.
"""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
from dataclasses import dataclass, field

import psutil


@dataclass
class Measured:
    rc: int
    wall_s: float
    cpu_s: float  # the sum over sampled processes
    rusage_children_cpu_s: float  # the cross-check (waited descendants only)
    per_process: list[dict] = field(default_factory=list)  # {pid, name, cmd, cpu_s}, most CPU first


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def run_measured(cmd: list[str], *, env: dict, cwd: str, log_path, interval: float = 0.5,
                 label=None) -> Measured:
    """Run `cmd` (its own session, stdout+stderr to log_path) to the end, sampling its process tree."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    root = psutil.Process(proc.pid)
    seen: dict[tuple, dict] = {}  # (pid, start time) -> {"proc", "name", "cmd", "cpu_s"}

    def tree(p: psutil.Process) -> list[psutil.Process]:
        try:
            return [p] + p.children(recursive=True)
        except psutil.Error:
            return []

    def sample() -> None:
        found = tree(root)
        keys = set()
        for q in found:
            try:
                keys.add((q.pid, q.create_time()))
            except psutil.Error:
                pass
        # processes that left the tree (re-parented) and are still running: their own trees too
        for key, s in list(seen.items()):
            if key not in keys and s["proc"].is_running():
                found += tree(s["proc"])
        for q in found:
                try:
                    key = (q.pid, q.create_time())
                    s = seen.get(key)
                    if s is None:
                        s = seen[key] = {"proc": q, "name": q.name(), "cmd": " ".join(q.cmdline())[:300],
                                         "cpu_s": 0.0}
                    s["cpu_s"] = max(s["cpu_s"], _cpu(s["proc"]))
                except psutil.Error:
                    continue

    try:
        while proc.poll() is None:
            sample()
            time.sleep(interval)
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        raise
    wall = time.time() - t0
    sample()  # processes the command left running (it should leave none)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rusage = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    rows = sorted(({"pid": key[0], "name": s["name"], "cmd": s["cmd"],
                    "role": label(s["cmd"]) if label else s["name"], "cpu_s": round(s["cpu_s"], 2)}
                   for key, s in seen.items()), key=lambda r: -r["cpu_s"])
    return Measured(rc=proc.returncode, wall_s=round(wall, 1), cpu_s=round(sum(r["cpu_s"] for r in rows), 1),
                    rusage_children_cpu_s=round(rusage, 1), per_process=rows)
