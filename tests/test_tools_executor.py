"""The tool executor process (issue 32): user tools and `python` run in one reused child process with a per-call
timeout, RLIMIT_CPU/AS/FSIZE and a scratch folder per episode; a hanging tool is killed (counted) and the next call
works; a crashing tool is an error result; output is truncated; environments keep state within an episode."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from trainer.tools import ToolBox, ToolCall
from trainer.tools.schemas import load_tools

HERE = Path(__file__).resolve().parent
MOD = "tools_user_ex"  # a name no other test module uses (sys.modules caches it per process)
FNS = ["shout", "echo_later", "multiply", "sleepy", "spin", "crash", "die", "chatty", "allocate", "write_file",
       "list_folder"]


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    """One ToolBox for the module: the executor is reused across calls, as in a run."""
    folder = tmp_path_factory.mktemp("user")
    shutil.copy(HERE / "tools_user_code.py", folder / f"{MOD}.py")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRPO_USER_DIR", str(folder))
        tb = ToolBox(load_tools(["python", "calculator"] + [f"{MOD}:{f}" for f in FNS], f"{MOD}.py:Counter"),
                     f"{MOD}.py:Counter", timeout=2.0, output_chars=200, memory_mb=256, file_mb=1)
        yield tb
        tb.close()


def run1(box: ToolBox, tool: str, **arguments):
    [ep] = box.start_episodes(1)
    try:
        [[r]] = box.run([(ep, [ToolCall(tool, arguments)])])
    finally:
        box.end_episodes([ep])
    return r


def test_a_user_tool_runs_in_a_reused_process(box):
    assert run1(box, "multiply", a=6, b=7).content == "42"
    pid = box.executor.proc.pid
    assert pid != os.getpid()
    assert run1(box, "multiply", a=2, b=3).content == "6" and box.executor.proc.pid == pid


def test_a_hanging_tool_is_killed_within_the_timeout_counted_and_the_next_call_works(box):
    box.reset_stats()
    for name, args in (("sleepy", {"seconds": 60}), ("spin", {})):
        t0 = time.monotonic()
        r = run1(box, name, **args)
        assert r.status == "timeout" and "2 seconds" in r.content
        assert time.monotonic() - t0 < 2.0 + 3.0  # the timeout, plus a kill and a fresh start
        assert run1(box, "multiply", a=3, b=3).content == "9"
    s = box.stats()
    assert s["timed_out"] == 2 and s["kills"] == 2 and s["per_tool"]["sleepy"]["timed_out"] == 1
    assert s["per_tool"]["multiply"] == {"calls": 2, "failed": 0, "timed_out": 0, "seconds": pytest.approx(
        s["per_tool"]["multiply"]["seconds"])}


def test_a_raising_tool_is_an_error_in_one_line(box):
    r = run1(box, "crash", message="bad input\nsecond line")
    assert r.status == "error" and r.content == "Error: RuntimeError: bad input second line"
    r = run1(box, "multiply", a=1)  # a call with a missing argument is the tool's error too
    assert r.status == "error" and "missing 1 required positional argument" in r.content


def test_a_tool_that_kills_its_process_is_an_error_and_the_next_call_works(box):
    r = run1(box, "die")
    assert r.status == "error" and "process ended" in r.content
    assert run1(box, "multiply", a=4, b=4).content == "16"


def test_huge_output_is_truncated(box):
    r = run1(box, "chatty", n=10 ** 6)
    assert r.status == "ok" and len(r.content) <= 200 and "truncated" in r.content
    r = run1(box, "python", code="for i in range(10**5): print(i)")
    assert len(r.content) <= 200 and r.content.startswith("0\n1\n2\n")


def test_allocating_too_much_is_an_error_result_not_a_crash(box):
    """RLIMIT_AS: 256 MiB over the imports here."""
    assert run1(box, "allocate", megabytes=16).status == "ok"
    r = run1(box, "allocate", megabytes=1024)
    assert r.status == "error" and "MemoryError" in r.content
    assert run1(box, "multiply", a=5, b=5).content == "25"


def test_a_file_past_rlimit_fsize_fails_as_an_error(box):
    assert run1(box, "write_file", name="small.bin", megabytes=0).status == "ok"
    r = run1(box, "write_file", name="big.bin", megabytes=4)  # file_mb=1
    assert r.status == "error" and "File too large" in r.content


def test_each_episode_has_its_own_scratch_folder_removed_at_its_end_and_at_close(box):
    a, b = box.start_episodes(2)
    [[wa], [wb]] = box.run([(a, [ToolCall("write_file", {"name": "mine.txt", "megabytes": 0})]),
                            (b, [ToolCall("list_folder", {})])])
    folder_a = Path(wa.content).parent
    assert folder_a.parent == Path(box.executor.scratch) and folder_a.is_dir()
    assert "mine.txt" not in wb.content and str(folder_a) not in wb.content  # b does not see a's file
    [[py]] = box.run([(a, [ToolCall("python", {"code": "import os; print(sorted(os.listdir('.')))"})])])
    assert py.content.strip() == "['mine.txt']"
    box.end_episodes([a, b])
    assert not folder_a.exists()


def test_close_removes_the_scratch_folder(tmp_path):
    tb = ToolBox(load_tools(["python"], None), timeout=5.0, output_chars=100)
    [ep] = tb.start_episodes(1)
    [[r]] = tb.run([(ep, [ToolCall("python", {"code": "open('f.txt', 'w').write('x'); print('done')"})])])
    assert r.content.strip() == "done" and os.path.isdir(tb.executor.scratch)
    child = tb.executor.proc
    tb.close()
    assert not os.path.exists(tb.executor.scratch) and child.poll() is not None


def test_the_python_tool_returns_stdout_and_stderr(box):
    r = run1(box, "python", code="import sys\nprint('out')\nprint('err', file=sys.stderr)\n1/0")
    assert r.status == "ok" and r.content == "out\nerr\nZeroDivisionError: division by zero\n"
    assert run1(box, "python", code="exit(0)").content == "(no output)"  # exit() ends the snippet, not the executor
    assert run1(box, "python", code="x = 1").content == "(no output)"


def test_a_stateful_environment_keeps_state_within_an_episode_and_is_fresh_per_episode(box):
    a, b = box.start_episodes(2, [{"start": 10}, {}])
    assert box.observations[a] == "The counter starts at 10." and box.observations[b] == "The counter starts at 0."
    add = [ToolCall("add", {"amount": 1}), ToolCall("add", {"amount": 2})]
    assert [[r.content for r in rs] for rs in box.run([(a, add), (b, add)])] == [["11", "13"], ["1", "3"]]
    assert [r.content for r in box.run([(a, add[:1])])[0]] == ["14"]
    box.end_episodes([a, b])
    [c] = box.start_episodes(1)
    assert box.run([(c, add[:1])])[0][0].content == "1"
    # a kill (another call's timeout) loses every live instance: their calls say so, they do not restart silently
    assert box.run([(c, [ToolCall("sleepy", {"seconds": 60})])])[0][0].status == "timeout"
    lost = box.run([(c, add[:1])])[0][0]
    assert lost.status == "error" and "environment is gone" in lost.content
    box.end_episodes([c])


CPU_PROBE = """
import resource, signal, time
from trainer.tools.executor_worker import CPULimitExceeded, _on_sigxcpu, call_with_cpu_limit
signal.signal(signal.SIGXCPU, _on_sigxcpu)
def spin():
    while True:
        pass
t0 = time.process_time()
try:
    call_with_cpu_limit(spin, {}, 0.5)
except CPULimitExceeded:
    print("limited after", round(time.process_time() - t0, 1))
print("lifted", resource.getrlimit(resource.RLIMIT_CPU)[0] == resource.RLIM_INFINITY)
"""


def test_rlimit_cpu_stops_a_call_and_is_lifted_after_it():
    """The executor child's CPU-time limit per call (its wall timeout usually comes first; threads that release
    the GIL can use CPU faster than wall time)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", CPU_PROBE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0].startswith("limited after") and float(lines[0].split()[-1]) <= 3.0 and lines[1] == "lifted True"


def test_an_async_tool_runs(box):
    assert run1(box, "shout", text="hi").content == "HI"


def test_async_tools_share_one_event_loop_across_calls(box):
    """TRL runs async tools on one persistent loop: a tool keeping a loop-bound object (a client, a queue) across
    calls works on its second call (asyncio.run per call: "bound to a different event loop")."""
    pid = box.executor.proc.pid
    assert [run1(box, "echo_later", text=t).content for t in ("a", "b", "c")] == ["a", "b", "c"]
    assert box.executor.proc.pid == pid  # one process, one loop


STUCK_PROBE = """
import asyncio, signal
from trainer.tools.executor_worker import STUCK, CPULimitExceeded, _on_sigxcpu, call_with_cpu_limit
from tools_user_code import spin_async
signal.signal(signal.SIGXCPU, _on_sigxcpu)
try:
    call_with_cpu_limit(spin_async, {}, 0.5)
except CPULimitExceeded:
    print("limited, stuck", STUCK.is_set())
"""


def test_an_async_call_past_its_cpu_limit_that_holds_the_loop_ends_the_process():
    """An `async def` that never awaits cannot be cancelled on the persistent loop: the worker says so (STUCK) and
    exits after answering, so the next call gets a fresh process and loop."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", STUCK_PROBE], capture_output=True, text=True, timeout=60,
                       cwd=HERE, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])})
    assert r.stdout.strip() == "limited, stuck True", r.stdout + r.stderr


def test_get_reward_scores_each_episode_from_its_environment(box):
    """TRL: an environment with get_reward() owns a reward, read from the instance's state."""
    a, b = box.start_episodes(2, [{"start": 5}, {}])
    box.run([(a, [ToolCall("add", {"amount": 2})])])
    name = box.env_reward  # the class's name: TRL's name of the reward
    assert box.episode_rewards([a, b]) == [{name: 7.0}, {name: 0.0}]
    box.end_episodes([a, b])
    plain = ToolBox(load_tools([], f"{MOD}:Plain"), f"{MOD}:Plain", timeout=5.0, output_chars=100)
    try:
        [ep] = plain.start_episodes(1)
        assert plain.observations[ep] is None  # reset() returned None: nothing is added to the prompt
        assert plain.run([(ep, [ToolCall("note", {"text": "x"})])])[0][0].content == "1"
        assert plain.episode_rewards([ep]) == [None]
    finally:
        plain.close()


def test_an_unclosed_executor_is_cleaned_up_when_dropped():
    import gc
    tb = ToolBox(load_tools(["python"], None), timeout=5.0, output_chars=100)
    [ep] = tb.start_episodes(1)
    tb.run([(ep, [ToolCall("python", {"code": "print(1)"})])])
    scratch, child = tb.executor.scratch, tb.executor.proc
    del tb
    gc.collect()
    assert not os.path.exists(scratch) and child.poll() is not None


def test_an_episode_never_started_is_the_callers_error(box):
    with pytest.raises(KeyError, match="was not started"):
        box.run([(10 ** 6, [ToolCall("multiply", {"a": 1, "b": 1})])])


def test_an_executor_that_dies_at_start_says_so_not_that_it_timed_out(tmp_path, monkeypatch):
    """A tool module that takes the executor process down while it is imported there (not here, in the parent):
    the error names the exit, at once, instead of waiting out the start-up timeout."""
    (tmp_path / "dies_in_child.py").write_text(
        "import os, sys\n"
        "if sys.argv[0].endswith('executor_worker.py'):\n"
        "    os._exit(3)\n"
        "def f(x: int) -> int:\n"
        "    \"\"\"Echo.\n\n    Args:\n        x: a number.\n    \"\"\"\n"
        "    return x\n")
    monkeypatch.setenv("GRPO_USER_DIR", str(tmp_path))
    tb = ToolBox(load_tools(["dies_in_child.py:f"], None), timeout=5.0, output_chars=100)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"failed to start: it exited \(code 3"):
            [ep] = tb.start_episodes(1)
            tb.run([(ep, [ToolCall("f", {"x": 1})])])
    finally:
        tb.close()
    assert time.monotonic() - t0 < 60


def test_a_reset_only_environment_from_a_pool_of_instances_reset_per_rollout(tmp_path, monkeypatch):
    """TRL: a class whose only public method is reset is accepted (no tools); instances are pooled, each new
    rollout's reset() starting one afresh (two live episodes: two instances; after they end, they are reused)."""
    shutil.copy(HERE / "tools_user_code.py", tmp_path / "reset_only_ex.py")
    monkeypatch.setenv("GRPO_USER_DIR", str(tmp_path))
    spec = "reset_only_ex:OnlyReset"
    assert load_tools([], spec) == []
    box = ToolBox(load_tools([], spec), spec, timeout=5.0, output_chars=100)
    try:
        assert box.schemas == [] and box.env_reward == "OnlyReset"
        a, b = box.start_episodes(2)
        assert [box.observations[a], box.observations[b]] == [" (instance 1)", " (instance 2)"]
        assert box.episode_rewards([a, b]) == [{"OnlyReset": 1.0}, {"OnlyReset": 2.0}]
        box.end_episodes([a, b])
        c, d, e = box.start_episodes(3)  # the two pooled instances, reset again, then a new one
        assert sorted(box.observations[x] for x in (c, d, e)) == [" (instance 1)", " (instance 2)", " (instance 3)"]
        box.end_episodes([c, d, e])
    finally:
        box.close()


def test_a_dict_of_environments_is_routed_by_the_environment_column(tmp_path, monkeypatch):
    """TRL's multi-environment form: {name: class}; each row's `environment` column picks its environment, whose
    methods are that rollout's tools (and the tools its prompt lists); get_reward() of a class scores only its
    own rollouts (None for another environment's)."""
    from common.config import GRPOConfig
    from common.settings.knobs import load_config

    shutil.copy(HERE / "tools_user_code.py", tmp_path / "multi_env_ex.py")
    monkeypatch.setenv("GRPO_USER_DIR", str(tmp_path))
    envs = {"count": "multi_env_ex:Counter", "notes": "multi_env_ex:Plain"}
    cfg = load_config(GRPOConfig, ["--environment_factory", json.dumps(envs)])
    assert cfg.environment_factory == json.dumps(envs) and cfg.env_reward_names() == ["Counter"]
    assert GRPOConfig(environment_factory=envs).validate().reward_specs() == []  # the environment's reward alone
    box = ToolBox(load_tools([], envs), envs, timeout=5.0, output_chars=100)
    try:
        listed = lambda row: [s["function"]["name"] for s in box.prompt_tools(row)]  # noqa: E731
        assert listed({"environment": "count"}) == ["add"] and listed({"environment": "notes"}) == ["note"]
        a, b = box.start_episodes(2, [{"environment": "count", "start": 3}, {"environment": "notes"}])
        assert box.observations[a] == "The counter starts at 3." and box.observations[b] is None
        [[r1], [r2], [r3]] = box.run([(a, [ToolCall("add", {"amount": 2})]), (b, [ToolCall("add", {"amount": 1})]),
                                      (b, [ToolCall("note", {"text": "x"})])])
        assert (r1.status, r1.content) == ("ok", "5") and r2.status == "unknown_tool" and r3.content == "1"
        assert box.episode_rewards([a, b]) == [{"Counter": 5.0}, None]
        box.end_episodes([a, b])
        with pytest.raises(ValueError, match="`environment` column must name one, got 'chess'"):
            box.start_episodes(1, [{"environment": "chess"}])
    finally:
        box.close()
