"""The tool executor: user tools, the built-in `python` tool and the environment instances run in ONE reused
child process (trainer/tools/executor_worker.py), never in the rollout process.

Per call: a wall-clock timeout (tool_timeout): a call past it has its process (group) killed, the kill counted, and
a fresh process started for the next call; the call's result is status "timeout" and the rollout goes on. In the
child: RLIMIT_CPU (this call's CPU seconds = tool_timeout), RLIMIT_AS (the imports' address space + memory_mb),
RLIMIT_FSIZE (file_mb per written file), and a scratch working folder per episode (rollout) under one folder that
close() removes. A tool that raises is status "error" with the exception in one line; output is truncated to
tool_output_chars. Environment instances (environment_factory) live in the child, keyed by episode id: a stateful
environment keeps its state across the calls of one rollout. A kill loses every live instance: their later calls
say so (status "error"), in one line.

This is best-effort isolation, NOT a security boundary: the child runs as the same user, with the same network and
filesystem access as the trainer (a tool can read and write anything the trainer can, outside the scratch folder
too). It keeps a hanging, crashing, memory-hungry or chatty tool from taking the rollout down; it does not contain
hostile code. Run untrusted code in a container or VM around the whole run.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from trainer.run.child_pipe import ChildExited, JsonLineReader
from trainer.tools.types import ToolResult

log = logging.getLogger("trainer")

STARTUP_TIMEOUT = 120.0  # importing the user's tool modules is not a tool call
MEMORY_MB = 2048  # RLIMIT_AS headroom over what the child's imports took
FILE_MB = 64  # RLIMIT_FSIZE: the largest file a tool may write


class ToolExecutor:
    """Runs `functions` ({tool name: spec}) and the environments `envs` ({name: class spec}, whose methods
    `env_tools[name]` are the tools) in a child process. `kills` counts the processes killed for a timeout (or
    found dead)."""

    def __init__(self, functions: dict[str, str], envs: dict[str, str] | None, env_tools: dict[str, list[str]],
                 timeout: float, output_chars: int, memory_mb: int = MEMORY_MB, file_mb: int = FILE_MB):
        self.scratch = tempfile.mkdtemp(prefix="grpo-tools-")
        self.conf = {"functions": dict(functions), "envs": dict(envs or {}),
                     "env_tools": {k: list(v) for k, v in (env_tools or {}).items()}, "timeout": timeout,
                     "output_chars": output_chars, "memory_mb": memory_mb, "file_mb": file_mb,
                     "scratch": self.scratch}
        self.timeout = float(timeout)
        self._live: dict = {"proc": None}  # what the finalizer cleans up if close() is never called
        self._reader: JsonLineReader | None = None  # one per child: its buffer dies with the process
        self.kills = 0
        self._finalizer = weakref.finalize(self, _cleanup, self._live, self.scratch)

    @property
    def proc(self) -> subprocess.Popen | None:
        return self._live["proc"]

    @proc.setter
    def proc(self, value: subprocess.Popen | None) -> None:
        self._live["proc"] = value

    # ------------------------------------------------------------------ the process
    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the child imports by the same names
        # Own session: a kill takes what a tool started (subprocesses) along; the child watches for our exit.
        self.proc = subprocess.Popen([sys.executable, "-m", "trainer.tools.executor_worker", json.dumps(self.conf)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, bufsize=0, start_new_session=True, cwd=self.scratch)
        threading.Thread(target=_relay, args=(self.proc.stderr,), daemon=True).start()
        self._reader = JsonLineReader(self.proc.stdout)
        msg = self._read(STARTUP_TIMEOUT)
        if not isinstance(msg, dict) or "ready" not in msg:
            err = (msg.get("error") if isinstance(msg, dict) else
                   f"it exited (code {self.proc.wait()}; its stderr is above)" if msg == "died" else
                   f"no answer within {STARTUP_TIMEOUT:.0f} s")
            self._kill()
            raise RuntimeError(f"the tool executor failed to start: {err}")

    def _kill(self) -> None:
        _kill(self.proc)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        self._finalizer()  # kills the child, removes the scratch folder; once

    def _read(self, timeout: float) -> dict | str | None:
        """The child's next JSON line; None when `timeout` passes first; "died" when the child exited."""
        try:
            return self._reader.read(timeout)
        except ChildExited:  # a tool may crash its process: a result for this call, not an error for the rollout
            return "died"

    # ------------------------------------------------------------------ requests
    def request(self, req: dict) -> tuple[str, str | None]:
        """(status, content) of one request, under the timeout. Never raises for the tool's own failure."""
        if not self.alive():
            if self.proc is not None:  # it died between requests (a tool's thread crashed it): start afresh
                self._kill()
                self.kills += 1
            self._start()
        try:
            self.proc.stdin.write((json.dumps(req, default=str) + "\n").encode())  # (rows: dates...)
            msg = self._read(self.timeout)
        except BrokenPipeError:
            msg = "died"
        if isinstance(msg, dict):
            return msg["status"], msg.get("content")
        self._kill()  # a hung call cannot be interrupted any other way; the next request starts a fresh child
        self.kills += 1
        if msg is None:
            return "timeout", f"Error: the tool did not finish within {self.timeout:g} seconds and was stopped"
        return "error", "Error: the tool's process ended during this call (it exited, crashed or ran out of memory)"

    def call(self, episode: int, name: str, arguments: dict) -> ToolResult:
        t0 = time.monotonic()
        status, content = self.request({"op": "call", "episode": episode, "name": name, "arguments": arguments})
        return ToolResult(name=name, content=content or "", status=status, seconds=time.monotonic() - t0)

    def start_episode(self, episode: int, kwargs: dict, env: str = "") -> tuple[str, str | None]:
        return self.request({"op": "start", "episode": episode, "kwargs": kwargs, "env": env})

    def episode_reward(self, episode: int) -> tuple[str, float | str | None]:
        return self.request({"op": "reward", "episode": episode})

    def snapshot(self, episode: int, env: str = "") -> tuple[str, dict | str | None]:
        """A copy of the episode's instance, its class spec and its state as JSON (trainer/rewards/environments.py),
        for rewards."""
        return self.request({"op": "snapshot", "episode": episode, "env": env})

    def end_episode(self, episode: int) -> None:
        if self.alive():
            self.request({"op": "end", "episode": episode})
        shutil.rmtree(os.path.join(self.scratch, f"episode_{episode}"), ignore_errors=True)


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and whatever its tools started
    except ProcessLookupError:  # already gone (it crashed): nothing to kill
        pass
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        f.close()


def _cleanup(live: dict, scratch: str) -> None:
    """close(), or at garbage collection / interpreter exit when close() was never called."""
    _kill(live["proc"])
    live["proc"] = None
    shutil.rmtree(scratch, ignore_errors=True)


def _relay(stream) -> None:
    """The child's stderr (tools' prints, its crash traceback) into our log, one bounded line at a time."""
    for raw in stream:
        line = raw.decode(errors="replace").rstrip()
        if line:
            log.info("[tool] %s", line[:500])
    stream.close()
