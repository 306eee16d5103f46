"""Reward calls under a hard per-call timeout: a reward worker process, killed on timeout, reused otherwise.

Why a process: a thread cannot be stopped (a C-level loop in sympy ignores everything), and
`signal.alarm` (math-verify's own timeout) only works in the main thread, which a DeepSpeed rank's
reward call need not be on. The worker is `python -m trainer.rewards.timeout SPECS_JSON`: it loads the
reward functions by the same names/dotted paths as the trainer (nothing is pickled), then answers
JSON lines on a private pipe (stdout is redirected to stderr there, so a reward that prints cannot
corrupt the protocol).

Per-completion functions (`fn(completion, ground_truth)`) are sent a whole round at once and answer
item by item, each item with its own deadline: a call that hangs costs one timeout, the worker is
killed and restarted for the rest. A TRL-style batch function is one call per round (as TRL calls it once
per generation batch), whose deadline is `timeout` per group it covers.
A timed-out call yields None ("not applicable"); an exception in the reward stays a hard error.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

from common import event_loop
from trainer.rewards.environments import expand, prepare
from trainer.rewards.state import TrainerState
from trainer.run.child_pipe import ChildExited, JsonLineReader

log = logging.getLogger("trainer")

STARTUP_TIMEOUT = 120.0  # importing user reward modules (sympy for math-verify) is not a reward call


class RewardCallError(RuntimeError):
    """A reward function raised (or returned something unusable): the run must stop."""

    def __init__(self, fn_index: int, item: int, message: str):
        super().__init__(message)
        self.fn_index, self.item = fn_index, item


def to_value(x) -> float | None:
    """None stays None (not applicable); anything else must be a real number (bools, numpy/torch scalars)."""
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"returned {x!r} ({type(x).__name__}), not a number or None") from e


def awaited(out):
    """An `async def` reward's coroutine, run to its value on the process's one persistent event loop (as TRL runs
    them: common/event_loop.py; a client bound to the loop survives across calls); anything else as is.
    Inside the reward worker, so the call's timeout covers the wait."""
    return event_loop.run(out) if inspect.iscoroutine(out) else out


def accepted_kwargs(fn, kwargs: dict) -> dict:
    """All of them when fn takes **kwargs (TRL's convention), else only the names it declares."""
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _trl_call(fn, kwargs: dict, state: dict | None) -> tuple[dict, dict, list[int] | None]:
    """The keyword arguments of one TRL-style call, where what it logs goes, and the completions it is called on
    (None: all; environments.prepare). TRL passes every reward `trainer_state`, `log_extra` and `log_metric`
    besides the columns: built here, in the process that calls it (JSON cannot carry callables), as are the
    `environments` copies; what they log comes back with the values ({"extra": {column: [...]}, "metrics": ...})."""
    logged: dict = {"extra": {}, "metrics": {}}
    kwargs = dict(kwargs, trainer_state=TrainerState(**(state or {})),
                  log_extra=lambda column, values: logged["extra"].setdefault(str(column), []).extend(values),
                  log_metric=lambda name, value: logged["metrics"].setdefault(str(name), []).append(float(value)))
    kwargs, keep = prepare(fn, kwargs)
    return accepted_kwargs(fn, kwargs), logged, keep


def _values(out) -> list:
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        raise TypeError(f"returned {type(out).__name__}, not a list with one value per completion")
    return [to_value(v) for v in out]


def call_trl_fn(fn, kwargs: dict, state: dict | None = None) -> tuple[list, dict]:
    """(one value per completion, what it logged); with `environments`, None for a completion whose instance was
    lost (environments.py)."""
    n = _count(kwargs)
    call, logged, keep = _trl_call(fn, kwargs, state)
    if keep == []:  # every instance of the group lost: nothing to call it on
        return [None] * n, logged
    return expand(_values(awaited(fn(**call))), logged, keep, n)


async def _call_trl_async(fn, kwargs: dict, state: dict | None) -> tuple[list, dict]:
    n = _count(kwargs)
    call, logged, keep = _trl_call(fn, kwargs, state)
    if keep == []:
        return [None] * n, logged
    return expand(_values(await awaited_async(fn(**call))), logged, keep, n)


def _count(kwargs: dict) -> int:
    return len(kwargs.get("environments") or [])


def gather_trl_fns(fns: list, idxs: list[int], kwargs: dict, state: dict | None = None) -> list[tuple[list, dict]]:
    """The `async def` TRL-style rewards of a call, gathered on the process's loop as TRL does (asyncio.gather):
    [(values, logged)] in order. The first that raised -> RewardCallError naming it."""
    async def every():
        return await asyncio.gather(*(_call_trl_async(fns[i], kwargs, state) for i in idxs), return_exceptions=True)

    out = event_loop.run(every())
    for i, r in zip(idxs, out):
        if isinstance(r, Exception):
            raise RewardCallError(i, 0, f"{type(r).__name__}: {r}") from r
    return out


async def awaited_async(out):
    return await out if inspect.isawaitable(out) else out


class InProcessCaller:
    """reward_timeout = 0: call the functions directly (no isolation, no timeout)."""

    def __init__(self, fns: list):
        self.fns = fns
        self.timeouts = 0

    def call_simple(self, idx: int, items: list[tuple[str, str]]) -> tuple[list[float | None], list[int]]:
        out = []
        for k, (completion, gt) in enumerate(items):
            try:
                out.append(to_value(awaited(self.fns[idx](completion, gt))))
            except Exception as e:  # noqa: BLE001 - re-raised with the function and the example named
                raise RewardCallError(idx, k, f"{type(e).__name__}: {e}") from e
        return out, []

    def call_trl(self, idx: int, kwargs: dict, state: dict | None = None, groups: int = 1) -> tuple[list, dict] | None:
        try:
            return call_trl_fn(self.fns[idx], kwargs, state)
        except Exception as e:  # noqa: BLE001 - re-raised with the function and the example named
            raise RewardCallError(idx, 0, f"{type(e).__name__}: {e}") from e

    def gather_trl(self, idxs: list[int], kwargs: dict, state: dict | None = None, groups: int = 1) -> list | None:
        return gather_trl_fns(self.fns, idxs, kwargs, state)

    def close(self) -> None:
        pass


class ProcessCaller:
    """Runs the reward functions named by `specs` in a worker process, each call under `timeout` seconds."""

    def __init__(self, specs: list[str], timeout: float):
        self.specs, self.timeout = list(specs), float(timeout)
        self.proc: subprocess.Popen | None = None
        self._reader: JsonLineReader | None = None  # one per worker: its buffer dies with the process
        self.timeouts = 0  # timed-out calls over this caller's life
        self.restarts = 0

    # ------------------------------------------------------------------ process
    def _start(self) -> None:
        env = dict(os.environ)
        # The child imports the same modules by name: give it the parent's import path.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # Its own process group: launch.sh's SIGTERM to ours (a run that is done) must not reach it while it
        # starts, before _serve ignores signals (it died with -15 there, mid-round); it ends on our kill, on stdin
        # EOF, or by _watch_parent when we are gone.
        self.proc = subprocess.Popen([sys.executable, "-m", "trainer.rewards.timeout", json.dumps(self.specs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0,
                                     process_group=0)
        self._reader = JsonLineReader(self.proc.stdout)
        try:
            msg = self._read(STARTUP_TIMEOUT)
        except RuntimeError as e:  # it died while importing the rewards: reap it, so no later send hits a dead pipe
            self._kill()
            raise RuntimeError(f"reward worker failed to start: {e}") from None
        if msg is None or "ready" not in msg:
            err = (msg or {}).get("error", f"no answer within {STARTUP_TIMEOUT:.0f} s")
            self._kill()
            raise RuntimeError(f"reward worker failed to start: {err}")

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                f.close()
            self.proc = None

    def close(self) -> None:
        self._kill()

    def __del__(self):  # best effort: the worker also exits on EOF of its stdin
        if getattr(self, "proc", None) is not None:
            self._kill()

    def _send(self, obj: dict) -> None:
        if self.proc is None:
            self._start()
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())

    def _read(self, timeout: float) -> dict | None:
        """Next JSON line from the worker, or None when `timeout` passes first."""
        try:
            return self._reader.read(timeout)
        except ChildExited:  # a reward that kills its process is a broken reward, not a timeout: stop the run
            code = self.proc.poll()
            raise RuntimeError(f"reward worker exited unexpectedly (code {code}); see its stderr above") from None

    def _on_timeout(self) -> None:
        self.timeouts += 1
        self.restarts += 1
        self._kill()  # a hung call cannot be interrupted any other way; restarted lazily by the next send

    # ------------------------------------------------------------------ calls
    def _answer(self, idx: int, item: int, groups: int = 1) -> tuple[bool, object]:
        msg = self._read(self.timeout * groups)
        if msg is None:
            self._on_timeout()
            return False, None
        if "error" in msg:
            raise RewardCallError(msg.get("fn", idx), item, msg["error"])
        return True, msg["ok"]

    def call_simple(self, idx: int, items: list[tuple[str, str]]) -> tuple[list[float | None], list[int]]:
        """(one value per item, indices of the items that timed out)."""
        out: list[float | None] = []
        timed_out: list[int] = []
        while len(out) < len(items):
            start = len(out)
            self._send({"fn": idx, "kind": "simple", "items": items[start:]})
            for k in range(start, len(items)):
                done, value = self._answer(idx, k)
                out.append(value)
                if not done:
                    timed_out.append(k)
                    break  # worker killed: resend the rest of the group to a fresh one
        return out, timed_out

    def call_trl(self, idx: int, kwargs: dict, state: dict | None = None, groups: int = 1) -> tuple[list, dict] | None:
        """(values, what the function logged), or None when it timed out; a call covering `groups` groups may take
        `timeout` seconds for each."""
        self._send({"fn": idx, "kind": "trl", "kwargs": kwargs, "state": state})
        done, value = self._answer(idx, 0, groups)
        return (value["values"], value["logged"]) if done else None

    def gather_trl(self, idxs: list[int], kwargs: dict, state: dict | None = None, groups: int = 1) -> list | None:
        """The async rewards of a call at once, under one timeout (per group covered): [(values, logged)], or None
        when it passed."""
        self._send({"fn": idxs[0], "fns": idxs, "kind": "gather", "kwargs": kwargs, "state": state})
        done, value = self._answer(idxs[0], 0, groups)
        return [(v["values"], v["logged"]) for v in value] if done else None


def make_caller(specs: list[str], fns: list, timeout: float):
    return ProcessCaller(specs, timeout) if timeout > 0 else InProcessCaller(fns)


# ---------------------------------------------------------------------- worker side
def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone, even while a reward hangs (stdin EOF is only seen between calls)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _serve(specs: list[str]) -> None:
    # The parent decides when we stop (kill on timeout, stdin EOF on close): a Ctrl-C or launch.sh's SIGTERM to
    # the process group must not kill us mid-call, while the parent finishes its round.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    out = os.fdopen(os.dup(1), "wb", buffering=0)  # private protocol channel
    os.dup2(2, 1)  # what reward code prints goes to stderr
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        out.write((json.dumps(obj, allow_nan=True) + "\n").encode())

    try:
        from trainer.rewards.registry import load_reward_fns

        fns = load_reward_fns(specs)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        send({"error": f"{type(e).__name__}: {e}"})
        return
    send({"ready": True})
    for line in sys.stdin.buffer:
        req = json.loads(line)
        fn = fns[req["fn"]]
        try:
            if req["kind"] == "gather":
                answers = gather_trl_fns(fns, req["fns"], req["kwargs"], req.get("state"))
                send({"ok": [{"values": v, "logged": lg} for v, lg in answers]})
                continue
            if req["kind"] == "trl":
                values, logged = call_trl_fn(fn, req["kwargs"], req.get("state"))
                send({"ok": {"values": values, "logged": logged}})
                continue
            for completion, gt in req["items"]:
                send({"ok": to_value(awaited(fn(completion, gt)))})  # NaN travels as JSON NaN; the parent refuses it
        except RewardCallError as e:  # a gathered reward raised: name it
            send({"error": str(e), "fn": e.fn_index})
        except Exception as e:  # noqa: BLE001 - reported to the parent, which stops the run
            tb = traceback.format_exc(limit=3)
            send({"error": f"{type(e).__name__}: {e}\n{tb}"})


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
