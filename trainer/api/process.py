"""`launch.sh train` as a child of the user's script: the real placement (ref server, workers, ranks), its output
streamed to the script's terminal, Ctrl-C (or SIGTERM) forwarded so that launch.sh stops everything it started, and
a failed run raised as one TrainingFailed naming the cause and the exit code."""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
LAUNCH = CHECKOUT / "launch.sh"
LAUNCH_ARGS_ENV = "GRPO_LAUNCH_ARGS"  # launch.sh train options for an unchanged script (e.g. "--workers 2")


class TrainingFailed(RuntimeError):
    """The run ended with a non-zero exit code: `exit_code`, `run_dir`, and the cause in the message."""

    def __init__(self, message: str, exit_code: int, run_dir: Path) -> None:
        super().__init__(message)
        self.exit_code, self.run_dir = exit_code, run_dir


def environment(user_dir: Path | None) -> dict:
    """The script's interpreter and its packages, as they are (launch.sh's GRPO_PYTHON: no scripts/setup.sh), its
    bin/ first on PATH (the `deepspeed` launcher), the checkout's DeepSpeed op cache as launch.sh keeps it."""
    env = dict(os.environ)
    env["GRPO_PYTHON"] = sys.executable
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    if user_dir is not None:  # the script's own modules (its rewards) import from its folder in every process
        env.setdefault("GRPO_USER_DIR", str(user_dir))
    return env


def _cause(run_dir: Path, tail: collections.deque) -> str:
    """The run's own one-line diagnosis (launch.sh / a rank wrote it), else launch.sh's last [launch] line."""
    end = run_dir / "run_end.json"
    if end.is_file():
        diagnosis = json.loads(end.read_text()).get("diagnosis")
        if diagnosis:
            return diagnosis
    lines = [x for x in tail if x.strip()]
    said = [x for x in lines if x.startswith("[launch]") and "stopped everything" not in x]
    return (said or lines or ["no output"])[-1].strip()


def run_launch(args: list[str], run_dir: Path, user_dir: Path | None) -> None:
    """`launch.sh train ARGS` from the script's working folder; returns when it exits 0, else TrainingFailed."""
    code, tail = stream(["bash", str(LAUNCH), "train", *args], environment(user_dir))
    if code != 0:
        raise TrainingFailed(f"training run failed (launch.sh exit code {code}): {_cause(run_dir, tail)} "
                             f"(logs: {run_dir})", code, run_dir)


def stream(cmd: list[str], env: dict, cwd: Path | None = None) -> tuple[int, collections.deque]:
    """Run cmd, its stdout on ours, its stderr echoed to ours (the last 40 lines kept); Ctrl-C or SIGTERM stops it
    (and what it started) before KeyboardInterrupt goes on. -> (exit code, last stderr lines)."""
    tail: collections.deque = collections.deque(maxlen=40)
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True, preexec_fn=_default_sigint)  # Ctrl-C reaches us: _stop
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not None:
        signal.signal(signal.SIGTERM, _raise_interrupt)  # a `kill` of the script stops the run too
    try:
        for line in proc.stderr:
            tail.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()
        return proc.wait(), tail
    except KeyboardInterrupt:
        _stop(proc)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _default_sigint() -> None:
    """launch.sh's trap needs SIGINT at its default disposition: bash cannot trap a signal ignored on entry (a
    script started in the background of a non-interactive shell inherits it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to launch.sh: its trap stops every process it started (up to ~15 s). A second Ctrl-C meanwhile is
    ignored (it would end launch.sh's cleanup half-way, leaving its children); what is left of launch.sh's own
    session after 60 s is killed."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        print("[api] stopping the run (launch.sh stops every process it started) ...", file=sys.stderr, flush=True)
        proc.send_signal(signal.SIGINT)
        for line in proc.stderr:  # its last lines: "stopped everything", how to resume
            sys.stderr.write(line)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
