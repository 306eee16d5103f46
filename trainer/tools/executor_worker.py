"""The tool executor's child process: `python -m trainer.tools.executor_worker CONFIG_JSON` (see executor.py).

It loads the tools by name as every process does (common/user_code.py; nothing is pickled), sets its resource
limits once the imports are done, then answers JSON lines on a private pipe: stdout is redirected to stderr (which
the parent relays to its log), so a tool that prints cannot corrupt the protocol.

Requests and answers, one JSON object a line:
    {"op": "start", "episode": 3, "kwargs": {...}} -> {"status": "ok", "content": <reset()'s return, or null>}
    {"op": "call", "episode": 3, "name": "f", "arguments": {...}} -> {"status": "ok" | "error", "content": "..."}
    {"op": "reward", "episode": 3} -> {"status": "ok", "content": <get_reward()'s float>} (or "error")
    {"op": "snapshot", "episode": 3, "env": ""} -> {"status": "ok", "content": {"spec", "state" | "error"}}
    {"op": "end", "episode": 3} -> {"status": "ok"}
"""
from __future__ import annotations

import inspect
import json
import os
import resource
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from common import event_loop
from common.user_code import load_object
from trainer.rewards.environments import lost, snapshot  # imported before the limits are set, as the tools are
from trainer.tools.types import one_line, truncate

STUCK = threading.Event()  # an async call past its CPU limit still holds the loop: exit after answering


class CPULimitExceeded(Exception):
    """RLIMIT_CPU's soft limit for this call passed (SIGXCPU)."""


def _on_sigxcpu(signum, frame):
    raise CPULimitExceeded("the call used up its CPU time limit")


def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone, even while a tool hangs (stdin EOF is only seen between calls)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _address_space() -> int:
    """This process's virtual memory size in bytes (what RLIMIT_AS counts)."""
    return int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def set_limits(memory_mb: int, file_mb: int) -> None:
    """RLIMIT_AS: what the imports took plus memory_mb; RLIMIT_FSIZE: file_mb per file written (a write past it
    fails with EFBIG instead of SIGXFSZ killing us). RLIMIT_CPU is set per call (call_with_cpu_limit)."""
    room = _address_space() + memory_mb * 2 ** 20
    resource.setrlimit(resource.RLIMIT_AS, (room, room))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * 2 ** 20, file_mb * 2 ** 20))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.signal(signal.SIGXCPU, _on_sigxcpu)


def call_with_cpu_limit(fn, arguments: dict, cpu_seconds: float):
    """fn(**arguments) with RLIMIT_CPU's soft limit at the CPU time used so far + cpu_seconds (the worker is
    reused, and the limit counts the process's whole life). The hard limit stays where it was."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + cpu_seconds) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    try:
        out = fn(**arguments)
        if not inspect.iscoroutine(out):
            return out
        try:  # TRL takes async tools (and get_reward) too, and runs them on one persistent loop
            return event_loop.run(out)
        except CPULimitExceeded:  # cancelled; one that never awaits keeps the loop's thread: end this process
            resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))  # SIGXCPU repeats each second past the limit
            if not event_loop.responsive(1.0):
                STUCK.set()
            raise
    finally:  # lifted between calls: SIGXCPU, sent every second past the soft limit, must not hit the serve loop
        resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))


class Worker:
    def __init__(self, conf: dict):
        self.conf = conf
        self.fns = {name: load_object(spec) for name, spec in conf["functions"].items()}
        self.env_cls = {name: load_object(spec) for name, spec in (conf.get("envs") or {}).items()}
        self.env_tools = {name: set(tools) for name, tools in (conf.get("env_tools") or {}).items()}
        self.envs: dict[int, object] = {}
        self.env_of: dict[int, str] = {}  # live episode -> its environment's name
        # TRL keeps a pool of instances per environment, reset() for each new rollout, instead of new ones
        self.pool: dict[str, list] = {name: [] for name in self.env_cls}
        self.scratch = Path(conf["scratch"])

    def folder(self, episode: int) -> Path:
        path = self.scratch / f"episode_{episode}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self, req: dict) -> dict:
        os.chdir(self.folder(req["episode"]))
        name = req.get("env", "")
        env = self.pool[name].pop() if self.pool[name] else self.env_cls[name]()
        observation = call_with_cpu_limit(env.reset, req.get("kwargs") or {}, self.conf["timeout"])
        self.envs[req["episode"]], self.env_of[req["episode"]] = env, name
        return {"status": "ok", "content": None if observation is None else str(observation)}

    def call(self, req: dict) -> dict:
        name, episode = req["name"], req["episode"]
        if name in self.env_tools.get(self.env_of.get(episode, ""), ()) or (
                episode not in self.envs and any(name in tools for tools in self.env_tools.values())):
            if episode not in self.envs:
                return {"status": "error", "content": "Error: this rollout's environment is gone: the tool process "
                                                      "was restarted after a call timed out or crashed"}
            fn = getattr(self.envs[episode], name)
        else:
            fn = self.fns[name]
        os.chdir(self.folder(episode))
        try:
            result = call_with_cpu_limit(fn, req["arguments"], self.conf["timeout"])
        except CPULimitExceeded as e:
            return {"status": "timeout", "content": f"Error: {e}"}
        except Exception as e:  # noqa: BLE001 - a tool's exception is its result: the model reads it
            return {"status": "error", "content": f"Error: {one_line(f'{type(e).__name__}: {e}')}"}
        except SystemExit as e:  # a tool calling exit() must not end the executor
            return {"status": "error", "content": f"Error: the tool called exit({e.code})"}
        return {"status": "ok", "content": truncate(str(result), self.conf["output_chars"])}

    def reward(self, req: dict) -> dict:
        """TRL: an environment with get_reward() scores its own rollout from its state."""
        env = self.envs.get(req["episode"])
        if env is None:
            return {"status": "error", "content": "the rollout's environment is gone (the tool process restarted)"}
        value = call_with_cpu_limit(env.get_reward, {}, self.conf["timeout"])
        return {"status": "ok", "content": None if value is None else float(value)}

    def snapshot(self, req: dict) -> dict:
        """TRL passes rewards the episode's instance (`environments`): a copy of it, its state as JSON
        (trainer/rewards/env_state.py)."""
        env, spec = self.envs.get(req["episode"]), self.conf["envs"].get(req.get("env", ""), "")
        if env is None:
            return {"status": "ok", "content": lost(spec, "the rollout's environment is gone (the tool process "
                                                          "restarted after a tool call timed out or crashed)")}
        return {"status": "ok", "content": snapshot(env, spec)}

    def end(self, req: dict) -> dict:
        env, name = self.envs.pop(req["episode"], None), self.env_of.pop(req["episode"], "")
        if env is not None:  # back to its pool: the next rollout's reset() starts it afresh
            self.pool[name].append(env)
        os.chdir(self.scratch)
        shutil.rmtree(self.scratch / f"episode_{req['episode']}", ignore_errors=True)
        return {"status": "ok"}

    def handle(self, req: dict) -> dict:
        op = req["op"]
        if op in ("start", "reward"):
            try:
                return self.start(req) if op == "start" else self.reward(req)
            except Exception as e:  # noqa: BLE001 - said to the parent, which marks the episode or reward
                what = "reset()" if op == "start" else "get_reward()"
                return {"status": "error", "content": f"Error: {what} failed: {one_line(f'{type(e).__name__}: {e}')}"}
        if op == "snapshot":
            return self.snapshot(req)
        return self.call(req) if op == "call" else self.end(req)


def serve(conf: dict) -> None:
    # The parent decides when we stop (kill on timeout, stdin EOF on close): a Ctrl-C or launch.sh's SIGTERM to the
    # process group must not end us mid-call.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    out = os.fdopen(os.dup(1), "wb", buffering=0)  # the private protocol channel
    os.dup2(2, 1)  # what tools print goes to stderr (the parent relays it)
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        out.write((json.dumps(obj) + "\n").encode())

    try:
        worker = Worker(conf)
        os.chdir(worker.scratch)
        set_limits(conf["memory_mb"], conf["file_mb"])
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it in one line
        send({"error": one_line(f"{type(e).__name__}: {e}", 1000)})
        return
    send({"ready": True})
    for line in sys.stdin.buffer:
        send(worker.handle(json.loads(line)))
        if STUCK.is_set():  # the parent sees us gone at its next request and starts a fresh process (a kill)
            return


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
