"""The shared child-pipe reader (trainer/run/child_pipe.py): a deadline gives None and keeps what arrived, the end of
the pipe raises ChildExited, lines that share one read or span two come out whole; and each caller maps a dead
child its own way (the tool executor: "died"; the reward caller: RuntimeError)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from trainer.rewards.timeout import ProcessCaller
from trainer.run.child_pipe import ChildExited, JsonLineReader
from trainer.tools.executor import ToolExecutor


@pytest.fixture
def pipe():
    """(reader over the read end, write end fd)."""
    r, w = os.pipe()
    stream = os.fdopen(r, "rb", buffering=0)
    yield JsonLineReader(stream), w
    stream.close()
    try:
        os.close(w)
    except OSError:  # the test closed it already (the "child exited" case)
        pass


def test_deadline_passes_gives_none(pipe) -> None:
    reader, _w = pipe
    t0 = time.monotonic()
    assert reader.read(0.3) is None
    assert 0.3 <= time.monotonic() - t0 < 3.0


def test_several_lines_in_one_read(pipe) -> None:
    reader, w = pipe
    os.write(w, b'{"a": 1}\n{"b": [2, 3]}\n"tail"\n')  # one write: the first os.read takes all three
    assert reader.read(1.0) == {"a": 1}
    # timeout 0: the next lines are served from the buffer, without waiting on the pipe
    assert reader.read(0) == {"b": [2, 3]}
    assert reader.read(0) == "tail"
    assert reader.read(0.05) is None


def test_line_split_across_reads(pipe) -> None:
    reader, w = pipe
    os.write(w, b'{"ok": "par')
    assert reader.read(0.1) is None  # half a line: not parsed, and not lost either
    os.write(w, b'ts"}\n{"next"')
    assert reader.read(1.0) == {"ok": "parts"}
    os.write(w, b": true}\n")
    assert reader.read(1.0) == {"next": True}


def test_end_of_pipe_raises_child_exited(pipe) -> None:
    reader, w = pipe
    os.write(w, b'{"last": 1}\n{"half')
    os.close(w)
    assert reader.read(1.0) == {"last": 1}  # what came before the exit is still read
    with pytest.raises(ChildExited):
        reader.read(1.0)


def test_real_child_that_exits() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdout.write('{\"ready\": true}\\n')"],
                            stdout=subprocess.PIPE, bufsize=0)
    try:
        reader = JsonLineReader(proc.stdout)
        assert reader.read(30.0) == {"ready": True}
        t0 = time.monotonic()
        with pytest.raises(ChildExited):
            reader.read(30.0)
        assert time.monotonic() - t0 < 20.0  # the exit is seen when it happens, not at the deadline
    finally:
        proc.wait()
        proc.stdout.close()


def test_tool_executor_maps_a_dead_child_to_died() -> None:
    ex = ToolExecutor({}, None, [], timeout=5.0, output_chars=100)
    try:
        ex._start()
        ex.proc.kill()
        assert ex._read(30.0) == "died"
    finally:
        ex.close()


def test_reward_caller_maps_a_dead_worker_to_an_error() -> None:
    caller = ProcessCaller(["contains"], timeout=5.0)
    try:
        caller._start()
        caller.proc.kill()
        with pytest.raises(RuntimeError, match="reward worker exited unexpectedly"):
            caller._read(30.0)
    finally:
        caller.close()


def test_a_reward_worker_that_dies_at_start_is_reaped_and_says_so(tmp_path, monkeypatch) -> None:
    """A reward module that takes the worker down while the worker imports it (not here, in the parent)."""
    (tmp_path / "dies_in_reward_worker.py").write_text(
        "import os, sys\n"
        "if sys.argv[0].endswith('timeout.py'):\n"
        "    os._exit(3)\n"
        "def r(completion, ground_truth):\n"
        "    return 1.0\n")
    monkeypatch.setenv("GRPO_USER_DIR", str(tmp_path))
    caller = ProcessCaller(["dies_in_reward_worker.py:r"], timeout=5.0)
    try:
        with pytest.raises(RuntimeError, match="reward worker failed to start: reward worker exited unexpectedly"):
            caller._start()
        assert caller.proc is None  # reaped: nothing left to write to
    finally:
        caller.close()


def test_a_group_sigterm_while_the_reward_worker_starts_does_not_kill_it(tmp_path) -> None:
    """launch.sh ends a finished run with SIGTERM to each process group: a genonly worker that is starting its reward
    worker (after a timeout killed the last one) must finish the round, not die because the signal reached the child
    before the child's own handlers were set (CI: 'reward worker exited unexpectedly (code -15)')."""
    (tmp_path / "reward.py").write_text("def r(completion, ground_truth):\n"
                                        "    return float(completion == ground_truth)\n")
    # the window: the worker's interpreter is up, its own handlers not yet set (~0.2 s of imports), made 3 s
    (tmp_path / "sitecustomize.py").write_text("import os, time\nif os.environ.get('SLOW_START'):\n    time.sleep(3)\n")
    script = ("import os, signal\n"
              "from trainer.rewards.timeout import ProcessCaller\n"
              "signal.signal(signal.SIGTERM, lambda *a: print('stop asked', flush=True))  # as trainer/worker.py\n"
              "os.environ['SLOW_START'] = '1'  # for the reward worker only\n"
              "print('starting', flush=True)\n"
              "caller = ProcessCaller(['reward.py:r'], timeout=30.0)\n"
              "print(caller.call_simple(0, [('7', '7'), ('6', '7')]), flush=True)\n"
              "caller.close()\n")
    path = os.pathsep.join([str(tmp_path), *(p for p in sys.path if p)])
    env = {**os.environ, "GRPO_USER_DIR": str(tmp_path), "PYTHONPATH": path}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    assert proc.stdout.readline().strip() == "starting"
    time.sleep(1.5)  # the reward worker is in sitecustomize's sleep
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "stop asked" in out and "([1.0, 0.0], [])" in out, out + err[-2000:]
